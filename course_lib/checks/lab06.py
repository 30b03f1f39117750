"""Lab 06's exercise checks (hybrid sharding): the 2-D HSDP mesh and its placements, the bytes per mesh axis,
choosing the sharding factor F for a memory budget and two link speeds, and the FSDP × TP partition specs.

The mesh check runs the learner's code on 8 gloo ranks as (replicate 2, shard 4) -- unequal factors, so that
swapped axes cannot pass by symmetry -- and reads the placements *and* the ledger (which group each
collective ran over). The others are pure: several cases each, awkward ones included (F = 1, F = N).

Each check is split (:mod:`course_lib.checks.judge`): the *run half* calls the learner's function on the check's
inputs and returns what came out as plain data (the mesh's shape and names, placements as text, ledger rows; the
numbers; a PartitionSpec as its entries), and the *judge half* (``judge_hsdp_shard``, ``judge_axis_bytes``,
``judge_choose_f``, ``judge_tp_spec``) computes the expected values itself (the ring formulas, the best F, the
FSDP × TP rule) and names the likely mistake.

Longer than ~300 lines: four exercise checks, each with its cases, its run and judge halves and the diagnoses of
its classic mistakes.
"""
from __future__ import annotations

from course_lib.models import LAB_CONFIG
from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.lab05 import case_result, run_cases, spec_plain, spec_text
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "check_hsdp_shard", "check_axis_bytes", "reference_axis_bytes", "check_choose_f",
           "reference_choose_f", "check_tp_spec", "tp_spec_mistake", "judge_hsdp_shard", "judge_axis_bytes",
           "judge_choose_f", "judge_tp_spec"]

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
def _placement_text(p) -> str:
    """A placement as torch prints it (``Shard(dim=0)``), read without calling a learner's class's methods."""
    from torch.distributed.tensor import Replicate, Shard
    if type(p) is Replicate:
        return "Replicate()"
    if type(p) is Shard:
        return f"Shard(dim={int(p.dim)})"
    return str(p) if (type(p).__module__ or "").startswith("torch.") else f"{type(p).__name__}(...)"


def _shard_on_rank(fn, replicate: int, shard: int):
    """Run half, on one rank: the learner's ``fn(model, replicate, shard)`` on the course GPT, then one step; the
    mesh it returned, every parameter's placements and mesh, the FSDP units and the ledger, as plain data."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
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
    if mesh is None or type(mesh) is not DeviceMesh:
        said = None if mesh is None else {_plain.UNPLAIN: type(mesh).__name__}
    else:
        said = (tuple(int(d) for d in mesh.mesh.shape), tuple(str(a) for a in (mesh.mesh_dim_names or ())))
    out = {"mesh": said,
           "plain": [k for k, p in params.items() if not isinstance(p, DTensor)],
           "placements": {k: "(" + ", ".join(map(_placement_text, p.placements)) + ("," if len(p.placements) == 1 else "")
                          + ")" for k, p in params.items() if isinstance(p, DTensor)},
           "param_mesh": sorted({tuple(int(d) for d in p.device_mesh.mesh.shape) for p in params.values()
                                 if isinstance(p, DTensor)}),
           "units": sum(type(m).__name__.startswith("FSDP") for m in model.modules())}
    x, y = (torch.from_numpy(a) for a in TokenTask(LAB_CONFIG.vocab_size, LAB_CONFIG.seq_len).rank_batch(
        0, 8, dist.get_rank(), dist.get_world_size()))
    lt.recorder().reset()
    with lt.phase("forward"):
        loss = loss_fn(model(x), y)
    loss.backward()
    out["ops"] = [(r.op, r.phase, r.group_size, tuple(r.group_ranks or ()))
                  for r in lt.recorder().ledger().filter(rank=dist.get_rank())]
    return _plain.plain(out)


def _hsdp_meshes(replicate: int, shard: int) -> list:
    return [(replicate, shard)] + ([(shard, replicate)] if replicate != shard else [])


def run_hsdp_shard(fn, replicate: int, shard: int) -> dict:
    """Run half: ``fn`` on ``replicate · shard`` gloo ranks as (replicate, shard), then with the factors exchanged;
    rank 0's plain record of each run."""
    from course_lib.launch import run
    return {"runs": [run(_shard_on_rank, fn, R, F, world_size=replicate * shard)[0]
                     for R, F in _hsdp_meshes(replicate, shard)]}


def judge_hsdp_shard(data: dict, replicate: int = 2, shard: int = 4) -> str:
    """Judge half: each run's mesh, placements, units and collective groups against HSDP on (replicate, shard)."""
    from course_lib.strategies.hsdp import torch as hsdp
    n, meshes = replicate * shard, _hsdp_meshes(replicate, shard)
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or len(runs) != len(meshes) or not all(isinstance(o, dict) for o in runs):
        raise AssertionError(f"no result from each of the {len(meshes)} meshes")
    first = None
    for (R, F), o in zip(meshes, runs):
        _hsdp_mistake(o, R, F, n, first, tuple(hsdp.MESH_DIMS))
        if first is None:
            first, first_o = ((R, F), tuple(o["mesh"][0])), o
    o = first_o
    want = str(("Replicate()", "Shard(dim=0)")).replace("'", "")
    return (f"mesh ({replicate}, {shard}) named {hsdp.MESH_DIMS}; {len(o['placements'])} DTensors {want}; "
            f"{o['units']} units; all-gathers over {shard} ranks, all-reduces over {replicate}")


@exercise("06", 'shard_hsdp', cell='def shard_hsdp(', hints=HINTS['shard_hsdp'], guards=("argument", "cost"),
          mistakes={'axes swapped': 'axes are swapped', '1-D mesh': '1-D mesh', 'root never sharded': 'the root was never sharded',
                    'arguments ignored': 'ignores its arguments', 'one unit': 'the whole model gathered at once',
                    'names swapped': 'mesh_dim_names=', 'not a mesh': 'return the DeviceMesh you built'},
          judge=judge_hsdp_shard,
          references=("course_lib.strategies.hsdp.torch.shard_hsdp", "course_lib.strategies.hsdp.torch.shard_gpt_hsdp",
                      "course_lib.strategies.hsdp.torch.hsdp_mesh"))
def check_hsdp_shard(fn, name: str = "shard_hsdp", replicate: int = 2, shard: int = 4) -> bool:
    """``fn(model, replicate, shard) -> mesh``: HSDP on the course GPT, run on ``replicate · shard`` ranks, then
    again with the factors exchanged (``shard · replicate``, the same ranks), so that each argument matters."""
    fn = _guard(fn, "06", "shard_hsdp")
    return decide(name, lab="06", tests=f"on {replicate * shard} ranks as replicate={replicate}, shard={shard} (then "
                  f"{shard} x {replicate}): a mesh of shape ({replicate}, {shard}), every parameter a DTensor "
                  "(Replicate(), Shard(0)), one unit per block plus the root, all-gathers in groups of the shard factor",
                  run=lambda: run_hsdp_shard(fn, replicate, shard), judge=judge_hsdp_shard,
                  params={"replicate": replicate, "shard": shard})


def _hsdp_mistake(o: dict, replicate: int, shard: int, n: int, first, mesh_dims) -> None:
    """Raise the first thing wrong with one run of the learner's ``shard_hsdp(model, replicate, shard)``."""
    want = str(("Replicate()", "Shard(dim=0)")).replace("'", "")
    if o["mesh"] is None:
        raise AssertionError("the function returned None: return the DeviceMesh you built")
    if isinstance(o["mesh"], dict):
        raise AssertionError(f"the function returned a {o['mesh'].get(_plain.UNPLAIN)}: return the DeviceMesh you built")
    shape, names = (tuple(v) for v in o["mesh"])
    if first is not None and shape == first[1] and (replicate, shard) != first[0]:
        raise AssertionError(f"replicate={replicate}, shard={shard} gave the mesh {shape}, the same as replicate="
                             f"{first[0][0]}, shard={first[0][1]} → the mesh ignores its arguments: build its shape "
                             "from replicate and shard")
    if shape == (shard, replicate) and replicate != shard:
        raise AssertionError(f"mesh shape {shape}, expected ({replicate}, {shard}) → the axes are swapped: "
                             "FSDP2 replicates over mesh dim 0 and shards over dim 1, whatever the names say "
                             f"(your model would be cut {replicate} ways, not {shard})")
    if len(shape) == 1:
        raise AssertionError(f"a 1-D mesh of {shape[0]} ranks → that is FSDP over all {n} ranks; HSDP needs the "
                             f"2-D mesh ({replicate}, {shard})")
    if shape != (replicate, shard):
        raise AssertionError(f"mesh shape {shape}, expected (replicate, shard) = ({replicate}, {shard})")
    if names and names != mesh_dims:
        raise AssertionError(f"mesh_dim_names={names}, expected {mesh_dims} → FSDP2 uses dim 0 to replicate "
                             "and dim 1 to shard; name them so (the ledger reports collectives by these names)")
    if o["plain"]:
        root = [k for k in o["plain"] if not k.startswith("blocks.")]
        hint = ("the root was never sharded: call fully_shard(model, mesh=mesh) after the blocks"
                if root and len(root) == len(o["plain"]) else "some modules were not passed to fully_shard")
        raise AssertionError(f"{len(o['plain'])} parameter(s) are plain tensors, e.g. {o['plain'][0]} → {hint}")
    if o["param_mesh"] and any(m != (replicate, shard) for m in o["param_mesh"]):
        other = next(m for m in o["param_mesh"] if m != (replicate, shard))
        kind = (f"a 1-D mesh of {other[0]} ranks: FSDP's traffic, every all-gather across all {other[0]} ranks"
                if len(other) == 1 else f"a mesh of shape {other}")
        raise AssertionError(f"you returned the mesh {shape}, but the parameters are sharded on {kind} → pass the "
                             "2-D mesh you return to fully_shard (the values train the same; the bytes do not)")
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


# -- exercise 2: bytes per mesh axis ---------------------------------------------------------------------------
def reference_axis_bytes(psi_pad: int, replicate: int, shard: int, b: int = 4) -> dict[str, float]:
    """Wire bytes one rank sends per step on each axis, every unit resharded after forward (ring formulas)."""
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}


#: (Ψpad, R, F, b): unequal R and F (swaps show), F = 1 and R = 1 (the boundaries), b = 2 (bf16) so b matters.
_AXIS_CASES = [(147_000, 2, 4, 4), (146_908, 4, 2, 4), (100_000, 1, 8, 4), (99_992, 8, 1, 4), (1_200, 3, 4, 4),
               (1_024, 2, 2, 4), (147_000, 2, 4, 2), (99_992, 8, 1, 2)]


def _axis_candidates() -> list:
    """Classic wrong formulas ``(psi, R, F, b) -> {shard, replicate}``, each with the mistake it makes."""
    ref = reference_axis_bytes

    def one(shard=None, replicate=None):
        return lambda p, R, F, b: {"shard": ref(p, R, F, b)["shard"] if shard is None else shard(p, R, F, b),
                                   "replicate": ref(p, R, F, b)["replicate"] if replicate is None else replicate(p, R, F, b)}
    return [
        (lambda p, R, F, b: ref(p, F, R, b),
         "R and F swapped: the shard axis has the F ranks of a shard group, the replicate axis R"),
        (lambda p, R, F, b: ref(p, R, F, 4), "b ignored: bytes per element are an argument (b = 2 for bf16): "
         "multiply by b, not by 4"),
        (lambda p, R, F, b: {k: v / b for k, v in ref(p, R, F, b).items()}, "bytes, not elements: multiply by b "
         "bytes per element"),
        (one(replicate=lambda p, R, F, b: 2 * (R - 1) / R * p * b), "the all-reduce carries only the reduced "
         "shard, Ψpad/F elements, not the whole Ψpad: each replica group sums one shard"),
        (one(replicate=lambda p, R, F, b: 2 * (R - 1) / R * p / R * b), "the all-reduce carries one shard, "
         "Ψpad/F elements (F = shard, the ranks a copy is cut across), not Ψpad/R"),
        (one(replicate=lambda p, R, F, b: 2 * (R * F - 1) / (R * F) * p / F * b), "the all-reduce runs over the "
         "R ranks of a replica group, not over all N: use 2(R-1)/R"),
        (one(shard=lambda p, R, F, b: 3 * (R * F - 1) / (R * F) * p * b), "the shard axis's collectives run over "
         "the F ranks of a shard group, not over all N: use (F-1)/F"),
        (one(shard=lambda p, R, F, b: 2 * (F - 1) / F * p * b), "with every unit resharded after forward, the "
         "backward all-gathers again: 2 all-gathers + 1 reduce-scatter = 3(F-1)/F"),
        (one(shard=lambda p, R, F, b: 4 * (F - 1) / F * p * b), "the reduce-scatter is half an all-reduce: "
         "(F-1)/F, not 2(F-1)/F (the ring formula; gloo's implementation may send more)"),
    ]


def _axis_each(cases, gots, close) -> str | None:
    """Both axes wrong, each by its own classic mistake: name each one (axis by axis, the candidate formula that
    gives the learner's numbers for that axis on every case). None unless both axes are explained."""
    whys = {}
    for axis in ("shard", "replicate"):
        if all(close(g[axis], reference_axis_bytes(*case)[axis]) for case, g in zip(cases, gots)):
            return None                               # this axis is right: the one-mistake diagnoses cover it
        whys[axis] = next((why for formula, why in _axis_candidates()
                           if all(close(g[axis], formula(*case)[axis]) for case, g in zip(cases, gots))), None)
    if None in whys.values() or whys["shard"] == whys["replicate"]:
        return None
    return (f"two mistakes, one per axis:\n   - shard axis: {whys['shard']}\n"
            f"   - replicate axis: {whys['replicate']}")


def _axis_mistake(cases, gots) -> str | None:
    """The mistake whose formula gives the learner's numbers on *every* case (both axes), else what the cases
    that went wrong have in common (only F = 1, or only R = 1: a boundary), else None."""
    close = lambda a, e: abs(float(a) - e) <= 1e-6 * max(1.0, abs(e))  # noqa: E731
    same = lambda got, want: all(close(got[k], want[k]) for k in want)  # noqa: E731
    for formula, why in _axis_candidates():
        if all(same(g, formula(*case)) for case, g in zip(cases, gots)):
            return why
    both = _axis_each(cases, gots, close)
    if both:
        return both
    wrong = [case for case, g in zip(cases, gots) if not same(g, reference_axis_bytes(*case))]
    if wrong and all(F == 1 for _, _, F, _ in wrong):
        return ("right except at F = 1: a shard group of one rank moves nothing on the shard axis, but the R = N "
                "copies still all-reduce the whole gradient on the replicate axis (F = 1 is DDP)")
    if wrong and all(R == 1 for _, R, _, _ in wrong):
        return ("right except at R = 1: one copy has no replica to all-reduce with (0 bytes on the replicate axis), "
                "and its shard axis is FSDP over all N ranks")
    return None


def _shown(v) -> str:
    """Judge half: a returned value for the ❌ line: its repr when plain, else its type's name."""
    if isinstance(v, dict) and set(v) == {_plain.UNPLAIN}:
        return f"a {v[_plain.UNPLAIN]}"
    return repr(v)


def run_axis_bytes(fn) -> dict:
    """Run half: the learner's ``{"shard", "replicate"}`` for each case (b = 4 left to its default), as plain data."""
    return {"got": run_cases(lambda c: fn(*c[:3]) if c[3] == 4 else fn(*c), _AXIS_CASES)}


def judge_axis_bytes(data: dict, name: str = "axis_bytes") -> str:
    """Judge half: every case's two numbers against the ring formulas (:func:`reference_axis_bytes`), the mistake
    whose formula gives all of them named."""
    entries, gots = data.get("got") if isinstance(data, dict) else None, []
    for i, (psi, R, F, b) in enumerate(_AXIS_CASES):
        got = case_result(entries, i, name)["got"]
        if not isinstance(got, dict) or set(got) != {"shard", "replicate"}:
            raise AssertionError(f"{name}({psi}, {R}, {F}{'' if b == 4 else f', b={b}'}) returned {_shown(got)}; "
                                 "return a dict with the keys 'shard' and 'replicate'")
        gots.append(got)
    for (psi, R, F, b), got in zip(_AXIS_CASES, gots):
        want = reference_axis_bytes(psi, R, F, b)
        wrong = [k for k in want if abs(float(got[k]) - want[k]) > 1e-6 * max(1.0, want[k])]
        if wrong:
            why = _axis_mistake(_AXIS_CASES, gots)
            raise AssertionError(
                f"Ψpad={psi:,}, R={R}, F={F}, b={b}: got {', '.join(f'{k} {float(got[k]):,.0f}' for k in wrong)}, "
                f"expected {', '.join(f'{k} {want[k]:,.0f}' for k in wrong)}"
                + (f"\n   likely mistake: {why}" if why else ""))
    return f"{len({(R, F) for _, R, F, _ in _AXIS_CASES})} meshes (F = 1 and F = N included) match the ring formulas"


@exercise("06", 'axis_bytes', cell='def axis_bytes(', hints=HINTS['axis_bytes'], guards=("argument", "boundary"),
          mistakes={'all-reduce over R ranks': 'over the R ranks', 'backward re-gather': 'backward all-gathers again',
                    'half an all-reduce': 'half an all-reduce', 'whole Ψ across replicas': 'reduced shard',
                    'R and F swapped': 'R and F swapped', 'b ignored': 'b ignored', 'bytes not elements': 'bytes, not elements',
                    'shard of Ψ/R': 'not Ψpad/R', 'shard axis over N': 'F ranks of a shard group',
                    'F = 1 is DDP': 'F = 1 is DDP', 'R = 1 all-reduces': 'no replica to all-reduce with',
                    'not a dict': 'return a dict', 'both axes wrong': 'two mistakes, one per axis'},
          judge=judge_axis_bytes, references=("course_lib.checks.lab06.reference_axis_bytes",))
def check_axis_bytes(fn, name: str = "axis_bytes") -> bool:
    """``fn(psi_pad, replicate, shard, b=4) -> {"shard": bytes, "replicate": bytes}`` per rank per step."""
    fn = _guard(fn, "06", "axis_bytes")
    return decide(name, lab="06", tests="the wire bytes one rank sends per step on each mesh axis, for 6 meshes "
                  "including F = 1 and F = N, and b = 2 as well as 4 bytes per element, against the ring formulas",
                  run=lambda: run_axis_bytes(fn), judge=judge_axis_bytes, params={"name": name})


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
    (1_000_000_000, 16, 8, 64e9, 100 * GB, 100 * GB),    # one flat network (not the 300 GB/s inside): F = 1 (DDP)
    (2_000_000_000, 8, 4, 10e9, 300 * GB, 25 * GB),      # 4 GPUs a node: F = 4 (8 would cross), though 8 fits too
    (1_000_000_000, 16, 4, 0.5e9, 300 * GB, 25 * GB),    # nothing fits, not even F = 16: None
    (1_000_000_000, 16, 8, 2e9, 300 * GB, 25 * GB),      # 16Ψ/8 = 2 GB: F = 8 fits exactly ("fits" is <=)
]
_F_ARGS = ("psi", "world", "per_node", "budget", "bw_intra", "bw_inter")


def _choose_f_variant(psi, world, per_node, budget, bw_intra, bw_inter, *, strict=False, node_lt=False,
                      no_replicate=False, pick=None):
    """:func:`reference_choose_f` with one classic slip: ``strict`` (< budget), ``node_lt`` (F < per_node counts
    as inside a node), ``no_replicate`` (the replicate all-reduce left out), ``pick`` ("smallest"/"largest" fit)."""
    def t(F):
        R = world // F
        inside = F < per_node if node_lt else F <= per_node
        rep = 0.0 if no_replicate or R == 1 else 2 * (R - 1) / R * 4 * psi / F / bw_inter
        return 3 * (F - 1) / F * 4 * psi / (bw_intra if inside else bw_inter) + rep
    fits = [F for F in range(1, world + 1) if world % F == 0 and (16 * psi / F < budget if strict else
                                                                  16 * psi / F <= budget)]
    if pick == "world":
        return world
    if not fits:
        return None
    if pick:
        return {"smallest": fits[0], "largest": fits[-1]}.get(pick, world)
    return min(fits, key=lambda F: (round(t(F), 12), F))


_F_MISTAKES = [   # (how the slip is computed, what the ❌ line says)
    ({"pick": "world"}, "F = N every time is plain FSDP: where a smaller F fits, its all-gathers need not cross the "
                        "slow inter-node link; and where even F = N does not fit, return None"),
    ({"strict": True}, "a factor whose 16Ψ/F is exactly the budget fits: 'fits' means at most the budget (<=, not <)"),
    ({"node_lt": True}, "a shard group of exactly per_node ranks is one whole node: its collectives run on the "
                        "fast links (F <= per_node is inside a node, not F < per_node)"),
    ({"pick": "largest"}, "the most sharding that fits is plain FSDP (F = N) when the budget allows: its "
                          "all-gathers cross the slow inter-node link; a smaller F that fits keeps them inside a node"),
    ({"pick": "smallest"}, "the least sharding that fits is feasible, not the fastest: among the F that fit, pick "
                           "the smallest predicted time"),
    ({"no_replicate": True}, "the replicate axis's all-reduce (2(R-1)/R of Ψ/F elements, across nodes) is part of "
                             "the predicted time too"),
]


def _choose_f_mistake(gots) -> str | None:
    """Which slip gives the learner's answers on every case: a classic one, or an argument read as a constant."""
    for kw, why in _F_MISTAKES:
        if all(g == _choose_f_variant(*case, **kw) for case, g in zip(_F_CASES, gots)):
            return why
    for i, arg in enumerate(_F_ARGS):
        for v in dict.fromkeys(case[i] for case in _F_CASES):
            fixed = [reference_choose_f(*case[:i], v, *case[i + 1:]) for case in _F_CASES]
            if all(g == f for g, f in zip(gots, fixed)):
                return (f"your answers are those of {arg} = {v:g} in every case: the answer ignores its argument "
                        f"`{arg}` (each argument changes the answer in some case)")
    return None


def run_choose_f(fn) -> dict:
    """Run half: the learner's F (or None) for each cluster, as plain data."""
    return {"got": run_cases(lambda c: fn(*c), _F_CASES)}


def judge_choose_f(data: dict, name: str = "choose_f") -> str:
    """Judge half: each F against :func:`reference_choose_f`, the classic slip that gives every answer named."""
    entries = data.get("got") if isinstance(data, dict) else None
    if isinstance(entries, list):                 # a crash in any case first, as when all cases ran before judging
        for e in entries:
            if isinstance(e, dict) and "crash" in e:
                case_result([e], 0, name)
    gots = [case_result(entries, i, name)["got"] for i in range(len(_F_CASES))]
    # a classic slip that gives every answer names the cause; else what is wrong with F itself (not a
    # divisor, over the budget, not None), in any case; else the first wrong case, by its times
    why = _choose_f_mistake(gots) if gots != [reference_choose_f(*case) for case in _F_CASES] else None
    for case, got in zip(_F_CASES, gots):
        psi, world, per_node, budget, bwi, bwx = case
        where = (f"Ψ={psi:.0e}, N={world}, {per_node} ranks/node, budget {budget / GB:g} GB, "
                 f"links {bwi / GB:g} / {bwx / GB:g} GB/s: got F={got}, expected F={reference_choose_f(*case)}")
        if why is not None and got != reference_choose_f(*case):
            raise AssertionError(f"{where} → {why}")
        if got is not None and reference_choose_f(*case) is None:
            raise AssertionError(f"{where} → 16Ψ/F exceeds the budget for every F, even F = N: return None")
        if got is not None and (not isinstance(got, int) or isinstance(got, bool) or got < 1 or world % got):
            raise AssertionError(f"{where} → F must divide N={world} (the mesh is R x F)")
        if got is not None and 16 * psi / got > budget:
            raise AssertionError(f"{where} → F={got} does not fit: 16Ψ/F = {16 * psi / got / GB:g} GB > "
                                 f"{budget / GB:g} GB")
    for case, got in zip(_F_CASES, gots):
        psi, world, per_node, budget, bwi, bwx = case
        want = reference_choose_f(*case)
        if got == want:
            continue
        where = (f"Ψ={psi:.0e}, N={world}, {per_node} ranks/node, budget {budget / GB:g} GB, "
                 f"links {bwi / GB:g} / {bwx / GB:g} GB/s: got F={got}, expected F={want}")
        if why is None and 16 * psi / want == budget:
            why = "'fits' means at most the budget (<=, not <)"
        if why is None and got == world:
            why = ("F = N (plain FSDP) fits, but its all-gathers cross the slow inter-node link; a smaller F "
                   "that fits keeps them inside a node")
        raise AssertionError(f"{where} → " + (why or "among the F that fit, pick the smallest predicted time "
                                              "(shard-axis bytes at the link their group uses, plus the "
                                              "replicate all-reduce across nodes)"))
    return f"{len(_F_CASES)} clusters: memory first, then the fastest links"


@exercise("06", 'choose_f', cell='def choose_f(', hints=HINTS['choose_f'], guards=("feasible", "boundary", "argument"),
          mistakes={'plain FSDP': 'plain FSDP', 'time not compared': 'predicted time',
                    'exact fit refused': "'fits' means at most the budget", 'full node counted across': 'one whole node',
                    'argument ignored': 'ignores its argument', 'does not fit': 'does not fit',
                    'not a divisor': 'must divide', 'None expected': 'return None'},
          judge=judge_choose_f, references=("course_lib.checks.lab06.reference_choose_f",))
def check_choose_f(fn, name: str = "choose_f") -> bool:
    """``fn(psi, world, per_node, budget, bw_intra, bw_inter) -> F or None``."""
    fn = _guard(fn, "06", "choose_f")
    return decide(name, lab="06", tests="7 clusters and budgets (one an exact fit, one with 4 GPUs a node, one flat "
                  "network): the F that fits 16Ψ/F in the budget and moves a step's bytes fastest, None when "
                  "nothing fits", run=lambda: run_choose_f(fn), judge=judge_choose_f, params={"name": name})


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


#: (shape, F, T): rows and columns each tested against their own axis ((100, 36): the columns divide by F, not
#: by T; the rows by F, not by F·T), exactly MIN_SIZE elements (32 x 32 = 1024), T = 1, fallbacks, small arrays.
_TP_CASES = [((64, 192), 4, 2), ((512, 64), 2, 4), ((64, 256), 8, 1), ((66, 64), 4, 2), ((32, 32), 4, 2),
             ((64,), 4, 2), ((16, 8), 4, 2), ((100, 36), 4, 8)]   # last: columns and rows divide F, not T or F·T


def _fallback_mistake(got, shape, fsdp: int, tensor: int) -> str | None:
    """A fallback that uses both mesh axes: cut over ('fsdp', 'tensor') together, or the FSDP rule run for F·T."""
    from jax.sharding import PartitionSpec
    from course_lib.strategies.fsdp import jax as fsdp_jax
    if isinstance(got, PartitionSpec) and any(isinstance(e, tuple) and len([a for a in e if a]) > 1 for e in got):
        return (f"the fallback cuts a dimension across the two axes together ({got}): FSDP over F·T = {fsdp * tensor} devices. The "
                f"fallback is FSDP over 'fsdp' alone (fsdp_spec(shape, F)); the tensor axis holds it whole")
    if got == fsdp_jax.fsdp_spec(shape, fsdp * tensor) and got != fsdp_jax.fsdp_spec(shape, fsdp):
        return (f"the fallback ran the FSDP rule for the product of both mesh axes, F·T = {fsdp * tensor} "
                f"(fsdp_spec(shape, {fsdp * tensor}) = {got}), but it cuts over 'fsdp' alone: test the dimensions "
                f"against fsdp = {fsdp}")
    return None


def _rebuilt(d: dict):
    """Judge half: the PartitionSpec the plain entries describe, built here (never the learner's object)."""
    from jax.sharding import PartitionSpec as P
    try:
        return P(*d["spec"], unreduced=set(d.get("unreduced", ())), reduced=set(d.get("reduced", ())))
    except Exception as exc:  # noqa: BLE001 - entries JAX refuses
        raise AssertionError(f"returned a PartitionSpec JAX cannot rebuild ({type(exc).__name__}): each entry is "
                             "None, an axis name or a tuple of them") from None


def _spec_key(d: dict) -> tuple:
    return tuple(d["spec"]), tuple(d.get("unreduced", ())), tuple(d.get("reduced", ()))


def run_tp_spec(fn) -> dict:
    """Run half: the learner's spec for each (shape, F, T), as its entries (plain data)."""
    return {"got": run_cases(lambda c: spec_plain(fn(*c)), _TP_CASES)}


def judge_tp_spec(data: dict, name: str = "tp_spec") -> str:
    """Judge half: each spec against :func:`course_lib.strategies.tp.jax.fsdp_tp_spec` (entries compared as plain
    data), the likely mistake named."""
    import math
    from jax.sharding import PartitionSpec as P
    from course_lib.strategies.fsdp import jax as fsdp_jax
    from course_lib.strategies.tp import jax as tp_jax
    entries = data.get("got") if isinstance(data, dict) else None
    both = P("fsdp", "tensor")
    for i, (shape, F, T) in enumerate(_TP_CASES):
        d, want = case_result(entries, i, name)["got"], tp_jax.fsdp_tp_spec(shape, F, T)
        if not isinstance(d, dict) or not isinstance(d.get("spec"), (tuple, list)):
            other = d.get("other") if isinstance(d, dict) else d
            plain_value = not (isinstance(other, dict) and _plain.UNPLAIN in other)
            kind = d.get("type") if isinstance(d, dict) else type(d).__name__
            shown = f" {other!r}" if plain_value else f" {d['repr']}" if isinstance(d, dict) and "repr" in d else ""
            raise AssertionError(f"{name}({shape}, fsdp={F}, tensor={T}) returned {kind}{shown}"
                                 ", not a PartitionSpec: return P(...), "
                                 "e.g. P('fsdp', 'tensor') or P()")
        if _spec_key(d) == _spec_key(spec_plain(want)):
            continue
        got = _rebuilt(d)
        where = f"shape {shape} on a mesh (fsdp={F}, tensor={T}): got {spec_text(d)}, expected {want}"
        if want == both and math.prod(shape) == fsdp_jax.MIN_SIZE and got == fsdp_jax.fsdp_spec(shape, F):
            why = (f"{shape} has exactly MIN_SIZE = {fsdp_jax.MIN_SIZE} elements: 'a 2-D array of at least "
                   "MIN_SIZE elements' includes it (>=, not >)")
        elif want == both:
            why = tp_spec_mistake(got, shape, F, T)
        elif _fallback_mistake(got, shape, F, T):
            why = _fallback_mistake(got, shape, F, T)
        elif len(shape) == 2 and shape[0] % F == 0 and shape[1] % T:
            why = (f"{shape[1]} columns do not divide by tensor={T}: NamedSharding refuses uneven cuts; fall back"
                   + (f" (they do divide by fsdp={F}: test the columns against 'tensor')" if shape[1] % F == 0 else ""))
        elif len(shape) == 2 and shape[0] % F:
            why = f"{shape[0]} rows do not divide by fsdp={F}; fall back to the FSDP rule (another dimension)"
        else:
            why = "small arrays (biases, norms) stay replicated: P() -- cutting them saves nothing"
        raise AssertionError(f"{where}\n   likely mistake: {why}")
    return f"{len(_TP_CASES)} shapes: big kernels P('fsdp', 'tensor'), the rest fall back to FSDP or replicate"


@exercise("06", 'tp_spec', cell='def tp_spec(', hints=HINTS['tp_spec'], guards=("argument", "boundary"),
          mistakes={'cut over both axes on dim 0': 'over both axes', 'axes swapped': 'swaps the axes',
                    'tensor axis unused': 'whole along', 'small arrays cut': 'small arrays',
                    'MIN_SIZE excluded': 'at least MIN_SIZE',
                    'uneven columns cut': 'columns do not divide', 'uneven rows cut': 'rows do not divide',
                    'fallback over both axes': 'the fallback cuts a dimension across the two axes',
                    'fallback for F·T': 'the FSDP rule for the product of both mesh axes',
                    'not a PartitionSpec': 'not a PartitionSpec'},
          judge=judge_tp_spec, references=("course_lib.strategies.tp.jax.fsdp_tp_spec",))
def check_tp_spec(fn, name: str = "tp_spec") -> bool:
    """``fn(shape, fsdp, tensor) -> PartitionSpec``, against :func:`course_lib.strategies.tp.jax.fsdp_tp_spec`."""
    fn = _guard(fn, "06", "tp_spec")
    return decide(name, lab="06", tests="8 shapes on (F, T) meshes: big 2-D kernels P('fsdp', 'tensor') (rows tested "
                  "against 'fsdp', columns against 'tensor', MIN_SIZE elements exactly included), what cannot be cut "
                  "that way falls back to FSDP over 'fsdp', small arrays replicated",
                  run=lambda: run_tp_spec(fn), judge=judge_tp_spec, params={"name": name})
