"""Lab 06's exercise checks (hybrid sharding): the 2-D HSDP mesh and its placements, the bytes per mesh axis,
choosing the sharding factor F for a memory budget and two link speeds, and the FSDP × TP partition specs.

The mesh check runs the learner's code on 8 gloo ranks as (replicate 2, shard 4) -- unequal factors, so that
swapped axes cannot pass by symmetry -- and reads the placements *and* the ledger (which group each
collective ran over). The others are pure: several cases each, awkward ones included (F = 1, F = N).

Longer than ~300 lines: four exercise checks, each with its cases and the diagnoses of its classic mistakes.
"""
from __future__ import annotations

from course_lib import checks
from course_lib.models import LAB_CONFIG
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "check_hsdp_shard", "check_axis_bytes", "reference_axis_bytes", "check_choose_f",
           "reference_choose_f", "check_tp_spec", "tp_spec_mistake"]

#: Layered hints, idea first, code last.
HINTS = {
    "shard_hsdp": [
        "HSDP is FSDP over a 2-D mesh: one dimension holds the copies (replicate), the other the cuts (shard). "
        "FSDP2 reads the mesh's dims by position, not by name.",
        "In torch 2.13, fully_shard replicates over mesh dim 0 and shards over dim 1: the mesh shape is "
        "(replicate, shard). Shard bottom-up as in Lab 04: each block, then the root, all with the same mesh.",
        "mesh = init_device_mesh('cpu', (replicate, shard), mesh_dim_names=('replicate', 'shard')); "
        "fully_shard(block, mesh=mesh) for each block; fully_shard(model, mesh=mesh); return mesh",
    ],
    "axis_bytes": [
        "Inside a shard group HSDP is FSDP over F ranks; across replica groups only the reduced gradient "
        "shard is all-reduced, over R ranks.",
        "shard axis: two all-gathers (forward, backward again) and one reduce-scatter of Ψpad elements over F "
        "ranks, ring cost (F-1)/F each. replicate axis: an all-reduce (ring 2(R-1)/R) of Ψpad/F elements.",
        "{'shard': 3 * (F - 1) / F * psi_pad * b, 'replicate': 2 * (R - 1) / R * psi_pad / F * b}",
    ],
    "choose_f": [
        "F trades memory (16Ψ/F per rank) against traffic: fit the budget first, then pick the F whose step "
        "moves its bytes over the fastest links.",
        "Candidates: divisors F of N with 16Ψ/F <= budget. For each: the shard axis's 3(F-1)/F·4Ψ bytes run at "
        "the intra-node speed if F <= ranks per node, else at the inter-node speed; the replicate axis's "
        "2(R-1)/R·4Ψ/F bytes cross nodes. Take the fastest; on a tie the smaller F.",
        "min((F for F in divisors if 16*psi/F <= budget), key=lambda F: (t(F), F)), with t(F) = "
        "3*(F-1)/F*4*psi/(bw_intra if F <= per_node else bw_inter) + 2*(R-1)/R*4*psi/F/bw_inter",
    ],
    "tp_spec": [
        "FSDP × TP cuts a big 2-D kernel twice: its rows over the 'fsdp' axis (storage, like FSDP) and its "
        "columns over the 'tensor' axis (each tensor-parallel device computes its slice of the features).",
        "One mesh axis per dimension, rows first: P('fsdp', 'tensor'). Only when both divide and the array is "
        "big; anything else falls back to the FSDP rule over 'fsdp' alone (fsdp_jax.fsdp_spec(shape, fsdp)).",
        "if len(shape) == 2 and prod(shape) >= min_size and shape[0] % fsdp == 0 and shape[1] % tensor == 0: "
        "return P('fsdp', 'tensor'); else: return fsdp_jax.fsdp_spec(shape, fsdp, min_size=min_size)",
    ],
}


# -- exercise 1: the 2-D mesh and the placements ------------------------------------------------------------
def _shard_on_rank(fn, replicate: int, shard: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from course_lib.comm import torch_ledger as lt
    from course_lib.models import TorchGPT, loss_fn, torch_init_
    from course_lib.models.data import TokenTask
    with torch.device("meta"):
        model = TorchGPT(LAB_CONFIG)
    mesh = fn(model, replicate, shard)
    model.to_empty(device="cpu")
    torch_init_(model, LAB_CONFIG, seed=0)
    params = dict(model.named_parameters())
    out = {"mesh": None if mesh is None else (tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ())),
           "plain": [k for k, p in params.items() if not isinstance(p, DTensor)],
           "placements": {k: str(tuple(p.placements)) for k, p in params.items() if isinstance(p, DTensor)},
           "param_mesh": sorted({tuple(p.device_mesh.mesh.shape) for p in params.values() if isinstance(p, DTensor)}),
           "units": sum(type(m).__name__.startswith("FSDP") for m in model.modules())}
    x, y = (torch.from_numpy(a) for a in TokenTask(LAB_CONFIG.vocab_size, LAB_CONFIG.seq_len).rank_batch(
        0, 8, dist.get_rank(), dist.get_world_size()))
    lt.recorder().reset()
    with lt.phase("forward"):
        loss = loss_fn(model(x), y)
    loss.backward()
    out["ops"] = [(r.op, r.phase, r.group_size, tuple(r.group_ranks or ()))
                  for r in lt.recorder().ledger().filter(rank=dist.get_rank())]
    return out


@exercise("06", 'shard_hsdp', cell='def shard_hsdp(', hints=HINTS['shard_hsdp'],
          mistakes={'axes swapped': 'axes are swapped', '1-D mesh': '1-D mesh', 'root never sharded': 'the root was never sharded'})
def check_hsdp_shard(fn, name: str = "shard_hsdp", replicate: int = 2, shard: int = 4) -> bool:
    """``fn(model, replicate, shard) -> mesh``: HSDP on the course GPT, run on ``replicate · shard`` ranks."""
    from course_lib.launch import run
    from course_lib.strategies.hsdp import torch as hsdp
    n = replicate * shard
    with checks.check(name, tests=f"on {n} ranks as replicate={replicate}, shard={shard}: a mesh of shape "
                      f"({replicate}, {shard}), every parameter a DTensor (Replicate(), Shard(0)), one unit "
                      "per block plus the root, all-gathers in groups of the shard factor") as c:
        res = run(_shard_on_rank, fn, replicate, shard, world_size=n)
        o = res[0]
        want = str(("Replicate()", "Shard(dim=0)")).replace("'", "")
        if o["mesh"] is None:
            raise AssertionError("the function returned None: return the DeviceMesh you built")
        shape, names = o["mesh"]
        if shape == (shard, replicate) and replicate != shard:
            raise AssertionError(f"mesh shape {shape}, expected ({replicate}, {shard}) → the axes are swapped: "
                                 "FSDP2 replicates over mesh dim 0 and shards over dim 1, whatever the names say "
                                 f"(your model would be cut {replicate} ways, not {shard})")
        if len(shape) == 1:
            raise AssertionError(f"a 1-D mesh of {shape[0]} ranks → that is FSDP over all {n} ranks; HSDP needs the "
                                 f"2-D mesh ({replicate}, {shard})")
        if shape != (replicate, shard):
            raise AssertionError(f"mesh shape {shape}, expected (replicate, shard) = ({replicate}, {shard})")
        if names and names != hsdp.MESH_DIMS:
            raise AssertionError(f"mesh_dim_names={names}, expected {hsdp.MESH_DIMS} → FSDP2 uses dim 0 to replicate "
                                 "and dim 1 to shard; name them so (the ledger reports collectives by these names)")
        if o["plain"]:
            root = [k for k in o["plain"] if not k.startswith("blocks.")]
            hint = ("the root was never sharded: call fully_shard(model, mesh=mesh) after the blocks"
                    if root and len(root) == len(o["plain"]) else "some modules were not passed to fully_shard")
            raise AssertionError(f"{len(o['plain'])} parameter(s) are plain tensors, e.g. {o['plain'][0]} → {hint}")
        bad = {k: v for k, v in o["placements"].items() if v != want}
        if bad:
            k, v = next(iter(bad.items()))
            raise AssertionError(f"{k} has placements {v}, expected {want} → shard with fully_shard(..., mesh=mesh) "
                                 "on the 2-D mesh (no custom placements)")
        if o["units"] < LAB_CONFIG.n_layers + 1:
            raise AssertionError(f"{o['units']} FSDP unit(s), expected {LAB_CONFIG.n_layers + 1} (each block, then "
                                 "the root) → the root alone makes one unit: the whole model gathered at once; shard "
                                 "bottom-up")
        ag = [g for op, _, g, _ in o["ops"] if op == "all_gather"]
        ar = [g for op, _, g, _ in o["ops"] if op == "all_reduce"]
        if set(ag) != {shard} or set(ar) != {replicate}:
            raise AssertionError(f"all-gathers over groups of {sorted(set(ag))} and all-reduces over {sorted(set(ar))} "
                                 f"ranks, expected {shard} and {replicate}")
        c.ok(f"mesh ({replicate}, {shard}) named {hsdp.MESH_DIMS}; {len(o['placements'])} DTensors {want}; "
             f"{o['units']} units; all-gathers over {shard} ranks, all-reduces over {replicate}")
    return bool(c.passed)


# -- exercise 2: bytes per mesh axis ---------------------------------------------------------------------------
def reference_axis_bytes(psi_pad: int, replicate: int, shard: int, b: int = 4) -> dict[str, float]:
    """Wire bytes one rank sends per step on each axis, every unit resharded after forward (ring formulas)."""
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}


_AXIS_CASES = [(147_000, 2, 4), (146_908, 4, 2), (100_000, 1, 8), (99_992, 8, 1), (1_200, 3, 4), (1_024, 2, 2)]


def _axis_mistake(fn, psi, R, F, got) -> str | None:
    """Name the likely mistake by finding which wrong formula the learner's numbers match."""
    N, b = R * F, 4
    close = lambda a, e: abs(a - e) <= 1e-6 * max(1.0, abs(e))  # noqa: E731
    s, r = got.get("shard"), got.get("replicate")
    swapped = reference_axis_bytes(psi, F, R, b)
    guesses = [
        (lambda: R != F and close(s, swapped["shard"]) and close(r, swapped["replicate"]),
         "R and F swapped: the shard axis has the F ranks of a shard group, the replicate axis R"),
        (lambda: close(r, 2 * (R - 1) / R * psi * b), "the all-reduce carries only the reduced shard, Ψpad/F "
         "elements, not the whole Ψpad: each replica group sums one shard"),
        (lambda: close(r, 2 * (N - 1) / N * psi / F * b), "the all-reduce runs over the R ranks of a replica group, "
         "not over all N: use 2(R-1)/R"),
        (lambda: close(s, 3 * (N - 1) / N * psi * b), "the shard axis's collectives run over the F ranks of a shard "
         "group, not over all N: use (F-1)/F"),
        (lambda: close(s, 2 * (F - 1) / F * psi * b), "with every unit resharded after forward, the backward "
         "all-gathers again: 2 all-gathers + 1 reduce-scatter = 3(F-1)/F"),
        (lambda: close(s, 4 * (F - 1) / F * psi * b), "the reduce-scatter is half an all-reduce: (F-1)/F, not "
         "2(F-1)/F (the ring formula; gloo's implementation may send more)"),
        (lambda: close(s, 3 * (F - 1) / F * psi) or close(r, 2 * (R - 1) / R * psi / F), "bytes, not elements: "
         "multiply by b bytes per element"),
    ]
    try:
        return next((why for test, why in guesses if test()), None)
    except TypeError:
        return None


@exercise("06", 'axis_bytes', cell='def axis_bytes(', hints=HINTS['axis_bytes'],
          mistakes={'all-reduce over R ranks': 'over the R ranks', 'backward re-gather': 'backward all-gathers again', 'half an all-reduce': 'half an all-reduce',
                    'whole Ψ across replicas': 'reduced shard'})
def check_axis_bytes(fn, name: str = "axis_bytes") -> bool:
    """``fn(psi_pad, replicate, shard, b=4) -> {"shard": bytes, "replicate": bytes}`` per rank per step."""
    with checks.check(name, tests="the wire bytes one rank sends per step on each mesh axis, for 6 meshes "
                      "including F = 1 and F = N, against the ring formulas") as c:
        for psi, R, F in _AXIS_CASES:
            got = fn(psi, R, F)
            if not isinstance(got, dict) or set(got) != {"shard", "replicate"}:
                raise AssertionError(f"{name}({psi}, {R}, {F}) returned {got!r}; return a dict with the keys "
                                     "'shard' and 'replicate'")
            want = reference_axis_bytes(psi, R, F)
            wrong = [k for k in want if abs(float(got[k]) - want[k]) > 1e-6 * max(1.0, want[k])]
            if wrong:
                why = _axis_mistake(fn, psi, R, F, got)
                raise AssertionError(
                    f"Ψpad={psi:,}, R={R}, F={F}: got {', '.join(f'{k} {float(got[k]):,.0f}' for k in wrong)}, "
                    f"expected {', '.join(f'{k} {want[k]:,.0f}' for k in wrong)}"
                    + (f"\n   likely mistake: {why}" if why else ""))
        c.ok(f"{len(_AXIS_CASES)} meshes (F = 1 and F = N included) match the ring formulas")
    return bool(c.passed)


# -- exercise 3: choose F ------------------------------------------------------------------------------------
def reference_choose_f(psi: int, world: int, per_node: int, budget: float, bw_intra: float, bw_inter: float):
    """The F (a divisor of ``world``) whose model state 16Ψ/F fits ``budget`` bytes and whose step moves its
    bytes fastest (shard axis at ``bw_intra`` if the shard group fits in a node, replicate axis across nodes);
    the smaller F on a tie; None if no F fits."""
    def t(F):
        R = world // F
        shard_bw = bw_intra if F <= per_node else bw_inter
        return 3 * (F - 1) / F * 4 * psi / shard_bw + (2 * (R - 1) / R * 4 * psi / F / bw_inter if R > 1 else 0.0)
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits, key=lambda F: (round(t(F), 12), F)) if fits else None


GB = 1e9
_F_CASES = [  # (psi, world, per_node, budget bytes, bw_intra, bw_inter) -> the answer, and why
    (1_000_000_000, 16, 8, 4e9, 300 * GB, 25 * GB),      # F in {4, 8, 16} fit; 8 = a node: fewest bytes across
    (1_000_000_000, 16, 8, 1.5e9, 300 * GB, 25 * GB),    # only F = 16 fits: FSDP across both nodes
    (1_000_000_000, 16, 8, 64e9, 300 * GB, 25 * GB),     # all fit; F = 8 still wins: F = 1 all-reduces 4Ψ across
    (1_000_000_000, 16, 8, 64e9, 300 * GB, 300 * GB),    # one flat fast network: F = 1 (DDP) moves the least
    (2_000_000_000, 8, 8, 10e9, 300 * GB, 25 * GB),      # one node: F = 8 (FSDP inside it)
    (1_000_000_000, 16, 4, 0.5e9, 300 * GB, 25 * GB),    # nothing fits, not even F = 16: None
    (1_000_000_000, 16, 8, 2e9, 300 * GB, 25 * GB),      # 16Ψ/8 = 2 GB: F = 8 fits exactly ("fits" is <=)
]


@exercise("06", 'choose_f', cell='def choose_f(', hints=HINTS['choose_f'],
          mistakes={'plain FSDP': 'plain FSDP', 'time not compared': 'predicted time',
                    'exact fit refused': "'fits' means at most the budget"})
def check_choose_f(fn, name: str = "choose_f") -> bool:
    """``fn(psi, world, per_node, budget, bw_intra, bw_inter) -> F or None``."""
    with checks.check(name, tests="7 clusters and budgets (one an exact fit): the F that fits 16Ψ/F in the budget and moves a step's "
                      "bytes fastest, None when nothing fits") as c:
        for case in _F_CASES:
            psi, world, per_node, budget, bwi, bwx = case
            want = reference_choose_f(*case)
            got = fn(*case)
            if got == want:
                continue
            where = (f"Ψ={psi:.0e}, N={world}, {per_node} ranks/node, budget {budget / GB:g} GB, "
                     f"links {bwi / GB:g} / {bwx / GB:g} GB/s: got F={got}, expected F={want}")
            if want is None:
                raise AssertionError(f"{where} → 16Ψ/F exceeds the budget for every F, even F = N: return None")
            if got is not None and (not isinstance(got, int) or world % got):
                raise AssertionError(f"{where} → F must divide N={world} (the mesh is R x F)")
            if got is not None and 16 * psi / got > budget:
                raise AssertionError(f"{where} → F={got} does not fit: 16Ψ/F = {16 * psi / got / GB:g} GB > "
                                     f"{budget / GB:g} GB")
            if 16 * psi / want == budget:
                raise AssertionError(f"{where} → 16Ψ/F = {16 * psi / want / GB:g} GB for F={want} is exactly the "
                                     "budget, and fits: 'fits' means at most the budget (<=, not <)")
            if got == world:
                raise AssertionError(f"{where} → F = N (plain FSDP) fits, but its all-gathers cross the slow "
                                     "inter-node link; a smaller F that fits keeps them inside a node")
            if got == per_node and want < per_node:
                raise AssertionError(f"{where} → with links this fast across nodes, a smaller F that fits moves "
                                     "fewer bytes per step: compare the predicted times, not the node size")
            raise AssertionError(f"{where} → among the F that fit, pick the smallest predicted time "
                                 "(shard-axis bytes at the link their group uses, plus the replicate all-reduce "
                                 "across nodes)")
        c.ok(f"{len(_F_CASES)} clusters: memory first, then the fastest links")
    return bool(c.passed)


# -- exercise 4: FSDP × TP partition specs ------------------------------------------------------------------
def tp_spec_mistake(spec, shape, fsdp: int, tensor: int) -> str | None:
    """What is wrong with ``spec`` for a big 2-D ``shape`` on an (F, T) mesh; None for ``P('fsdp', 'tensor')``."""
    from jax.sharding import PartitionSpec
    if not isinstance(spec, PartitionSpec):
        return f"returned {type(spec).__name__} {spec!r}, not a PartitionSpec"
    entries = [e if isinstance(e, tuple) else (e,) for e in tuple(spec)] + [(None,)] * 2
    flat = [a for e in entries for a in e if a is not None]
    if len(flat) != len(set(flat)):
        return f"{spec} names a mesh axis twice; each axis may cut at most one dimension"
    if any(len([a for a in e if a is not None]) > 1 for e in entries):
        return (f"{spec} cuts one dimension over both axes: that is FSDP over F·T devices (the same memory), "
                "not tensor parallelism -- the columns (output features) must go to 'tensor'")
    got = tuple(e[0] for e in entries[:2])
    if got == ("tensor", "fsdp"):
        return f"{spec} swaps the axes: rows (dim 0) go to 'fsdp', columns (dim 1) to 'tensor'"
    missing = [a for a in ("fsdp", "tensor") if a not in flat]
    if missing:
        return (f"{spec} leaves the kernel whole along {missing}: replicated there, a device holds "
                f"1/{(fsdp if 'fsdp' in flat else 1) * (tensor if 'tensor' in flat else 1)} of it, "
                f"not 1/(F·T) = 1/{fsdp * tensor}")
    return None if got == ("fsdp", "tensor") else f"{spec}: expected P('fsdp', 'tensor')"


_TP_CASES = [((64, 192), 4, 2), ((256, 64), 4, 2), ((512, 64), 2, 4), ((64, 256), 8, 1), ((66, 64), 4, 2),
             ((64,), 4, 2), ((16, 8), 4, 2), ((64, 6), 4, 4)]


@exercise("06", 'tp_spec', cell='def tp_spec(', hints=HINTS['tp_spec'],
          mistakes={'cut over both axes on dim 0': 'over both axes', 'tensor axis unused': 'whole along', 'small arrays cut': 'small arrays'})
def check_tp_spec(fn, name: str = "tp_spec") -> bool:
    """``fn(shape, fsdp, tensor) -> PartitionSpec``, against :func:`course_lib.strategies.tp.jax.fsdp_tp_spec`."""
    from jax.sharding import PartitionSpec as P
    from course_lib.strategies.tp import jax as tp_jax
    with checks.check(name, tests="8 shapes on (F, T) meshes: big 2-D kernels P('fsdp', 'tensor'), what cannot be "
                      "cut that way falls back to FSDP over 'fsdp', small arrays replicated") as c:
        for shape, F, T in _TP_CASES:
            want = tp_jax.fsdp_tp_spec(shape, F, T)
            got = fn(shape, F, T)
            if got == want:
                continue
            where = f"shape {shape} on a mesh (fsdp={F}, tensor={T}): got {got}, expected {want}"
            if want == P("fsdp", "tensor"):
                why = tp_spec_mistake(got, shape, F, T)
            elif len(shape) == 2 and shape[0] % F == 0 and shape[1] % T:
                why = f"{shape[1]} columns do not divide by tensor={T}: NamedSharding refuses uneven cuts; fall back"
            elif len(shape) == 2 and shape[0] % F:
                why = f"{shape[0]} rows do not divide by fsdp={F}; fall back to the FSDP rule (another dimension)"
            else:
                why = "small arrays (biases, norms) stay replicated: P() -- cutting them saves nothing"
            raise AssertionError(f"{where}\n   likely mistake: {why}")
        c.ok(f"{len(_TP_CASES)} shapes: big kernels P('fsdp', 'tensor'), the rest fall back to FSDP or replicate")
    return bool(c.passed)
