"""Lab 04's exercise checks (FSDP2): ``fully_shard`` bottom-up, and an explicit prefetch plan; each split in two
halves (:mod:`course_lib.checks.judge`).

* **run half** -- runs the learner's function on real gloo ranks and reads what FSDP2 itself built, as plain facts:
  which modules became units, which parameters are DTensors and over which meshes, rank 0's ledger rows of one
  training step (forward and backward), and the prefetch lists FSDP2 will follow (as block indices).
* **judge half** -- ``judge_*``: the units, collectives and wire bytes a bottom-up sharding must give (the cost
  formula on the GPT's shapes, read here off a meta-device model) and the prefetch lists a depth asks for, computed
  here, compared, with the likely mistake named.

Values alone would pass a model sharded as one unit (it trains the same numbers), so the checks count units and
collectives.

Longer than ~300 lines: two exercise checks, each a run half on the ranks and a judge half with the diagnoses of its
classic mistakes (eight each).
"""
from __future__ import annotations

from course_lib import checks
from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.maths import costs
from course_lib.models import LAB_CONFIG, GPTConfig

__all__ = ["HINTS", "MEASURED", "check_shard_model", "check_prefetch_plan"]

#: Layered hints, general to specific (``checks.hint(name, level)``); the last level is near-code.
HINTS = {
    "shard_model": [
        "A unit is what FSDP gathers and frees together: here each transformer block, plus the root for "
        "whatever no block owns. The order matters: inner units first.",
        "Make every block of model.blocks a unit over the mesh, then the model itself: the root takes only "
        "the parameters no block took (embeddings, final norm, head). Leave the knobs at their defaults.",
        "for block in model.blocks: fully_shard(block, mesh=mesh); then fully_shard(model, mesh=mesh)",
    ],
    "set_prefetch": [
        "Each block names the blocks whose all-gathers start when it starts: in forward the ones that "
        "run after it, in backward the ones that run after it in the backward (which goes in reverse).",
        "Forward: blocks i+1 .. i+depth, none past the last. Backward: i-1, i-2, ... down to i-depth, "
        "nearest first, none before block 0. A block never prefetches itself.",
        "block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth]); "
        "block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])",
    ],
}

#: What the last passing checks measured, for the lab's prediction cells.
MEASURED: dict[str, float] = {}

TESTS = {
    "shard_model": "on 4 gloo ranks, one training step of the lab's GPT: every block and the root are FSDP "
                   "units, every parameter a DTensor over the mesh it is given (also one axis of a 2-D mesh); the "
                   "ledger shows 4 all-gathers in forward (one per unit), 3 in backward (the blocks again; the root "
                   "stays gathered) and 4 reduce-scatters",
    "set_prefetch": "a 5-block GPT with depth 2, then depth 3: the forward and backward prefetch lists FSDP2 "
                    "holds for every block (which blocks, in which order, up to both ends)",
}




def _ledger_rows(ledger) -> list[dict]:
    """A ledger's records as plain rows (what the judge needs of each)."""
    keep = ("op", "nbytes", "dtype", "group_size", "rank", "phase", "step")
    return [{k: getattr(r, k) for k in keep} for r in ledger]


# -- exercise 1: fully_shard bottom-up ------------------------------------------------------
def _fsdp2_on_rank(fn, cfg):
    """Run half, on one rank: the learner's sharding of the GPT, one training step; what FSDP2 built, as facts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from course_lib.comm import torch_ledger as lt
    from course_lib.launch import rank_info
    from course_lib.models import TorchGPT, loss_fn, torch_init_
    from course_lib.models.data import TokenTask
    device = torch.device(rank_info().device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    with torch.device("meta"):
        model = TorchGPT(cfg)
    fn(model, mesh)
    model.to_empty(device=device)
    torch_init_(model, cfg, seed=0)
    info = {"plain": [n_ for n_, p in model.named_parameters() if not isinstance(p, DTensor)],
            "root": isinstance(model, FSDPModule), "blocks": [isinstance(b, FSDPModule) for b in model.blocks],
            "units": [n_ or "root" for n_, m in model.named_modules() if isinstance(m, FSDPModule)],
            "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})}
    x, y = (torch.from_numpy(a).to(device) for a in
            TokenTask(cfg.vocab_size, cfg.seq_len).rank_batch(0, 8, dist.get_rank(), dist.get_world_size()))
    lt.recorder().reset()
    with lt.phase("forward"):
        loss = loss_fn(model(x), y)
    loss.backward()
    n = dist.get_world_size()
    if n % 2 == 0 and n > 2:   # the mesh is an argument too: a 2-D mesh's "shard" axis holds n/2 of the n ranks
        with lt.paused():
            sub = init_device_mesh(device.type, (2, n // 2), mesh_dim_names=("replicate", "shard"))["shard"]
            with torch.device("meta"):
                other = TorchGPT(cfg)
            fn(other, sub)
        info["sub_mesh"] = (sub.size(), sorted({p.device_mesh.size() for p in other.parameters()
                                               if isinstance(p, DTensor)}))
    return _plain.plain(info)


def run_shard_model(fn, world_size: int) -> dict:
    """Run half: every rank's facts and rank 0's ledger rows; FSDP2's own error for the wrong order, as a fact."""
    from course_lib.launch import run
    try:
        out = run(_fsdp2_on_rank, fn, LAB_CONFIG, world_size=world_size)
    except Exception as e:  # noqa: BLE001 - FSDP2's own error for the wrong order becomes a diagnosis
        if getattr(e, "exc_type", "") == "TypeError" and "Invariant encountered" in str(e):
            return {"error": {"type": "TypeError", "rank": getattr(e, "rank", None), "text": "Invariant encountered"}}
        raise
    return {"ranks": list(out), "ledger": _ledger_rows(out.ledger.filter(rank=0))}


def _gpt_units(cfg) -> list[list[tuple[int, ...]]]:
    """Judge side: the shapes of each unit a bottom-up sharding makes (the root's own parameters, then each block),
    read off a meta-device model (no memory, no random numbers drawn)."""
    import torch

    from course_lib.models import TorchGPT
    with torch.device("meta"):
        model = TorchGPT(cfg)
    return ([[tuple(p.shape) for n_, p in model.named_parameters() if not n_.startswith("blocks.")]]
            + [[tuple(p.shape) for p in b.parameters()] for b in model.blocks])


def _step_counts(led) -> tuple[int, int, int]:
    """(all-gathers in forward, all-gathers in backward, reduce-scatters) of one step's ledger."""
    return (len(led.filter(phase="forward", op="all_gather")), len(led.filter(phase="backward", op="all_gather")),
            len(led.filter(op="reduce_scatter")))


def judge_shard_model(data: dict, world_size: int = 4, name: str = "shard_model") -> str:
    """Judge half: units, DTensors and meshes from the run's facts; the step's collectives against the bottom-up
    plan and its wire bytes against the formula on the GPT's shapes (computed here)."""
    from course_lib.comm.ledger import Ledger
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        raise AssertionError(f"on rank {err.get('rank')}: FSDP2 raised TypeError at the first forward (\"Invariant "
                             "encountered: value was None\")\n   likely mistake: the root was sharded before "
                             "the blocks; shard bottom-up: every block first, the model last")
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or len(ranks) != world_size or not isinstance(ranks[0], dict) \
            or not isinstance(data.get("ledger"), list):
        raise AssertionError(f"no result from each of {world_size} ranks")
    o, shapes = ranks[0], _gpt_units(LAB_CONFIG)
    k = len(shapes)
    if not isinstance(o.get("blocks"), list) or len(o["blocks"]) != k - 1 or not all(x is True for x in o["blocks"]):
        raise AssertionError(f"blocks that are units: {o.get('blocks')}\n   likely mistake: call fully_shard(block) "
                             "on every block of model.blocks, so that each one is gathered and freed on its own")
    if o.get("root") is not True or o.get("plain"):
        raise AssertionError(f"parameters left unsharded: {o.get('plain')}\n   likely mistake: call "
                             "fully_shard(model) last: the root unit takes every parameter no block took")
    units = o.get("units") if isinstance(o.get("units"), list) else []
    if len(units) != k:
        inner = [u for u in units if u != "root" and str(u).count(".") > 1]
        raise AssertionError(f"{len(units)} units, expected {k} (root + {k - 1} blocks); extra units: "
                             f"{inner[:4]}{' ...' if len(inner) > 4 else ''}\n   likely mistake: only the "
                             "blocks and the root are units; sharding each layer inside a block multiplies "
                             "the collectives (each too small to hide behind compute)")
    sub = o.get("sub_mesh")
    if sub is not None and (not isinstance(sub, (list, tuple)) or len(sub) != 2 or sub[1] != [sub[0]]):
        size, got = (sub[0], sub[1]) if isinstance(sub, (list, tuple)) and len(sub) == 2 else ("?", sub)
        raise AssertionError(f"given a mesh of {size} ranks (one axis of a 2-D mesh), your parameters were sharded "
                             f"over meshes of {got} ranks\n   likely mistake: pass mesh=mesh to every "
                             "fully_shard call: without it FSDP2 shards over all the ranks, which is only the "
                             "same thing on a 1-D mesh of every rank")
    led = Ledger.from_dicts(data["ledger"])
    fwd, bwd, rs = _step_counts(led)
    if (fwd, bwd, rs) != (k, k - 1, k):
        if bwd == 0:
            why = ("no all-gather in backward: reshard_after_forward=False keeps every block gathered from its "
                   "forward to its backward (ZeRO-2's traffic, and the memory FSDP exists to save); leave the "
                   "default")
        elif (fwd, bwd, rs) == (k, k, k):
            why = ("the root was gathered again in backward: reshard_after_forward=True on the root frees it "
                   "only to gather it at once; FSDP2's default (None) keeps the root gathered, one all-gather "
                   "less: leave the default")
        else:
            why = "one all-gather per unit in forward, the blocks again in backward"
        raise AssertionError(f"rank 0 issued {fwd} all-gathers in forward, {bwd} in backward, {rs} "
                             f"reduce-scatters; expected {k}, {k - 1}, {k}\n   likely mistake: {why}")
    formula = costs.step_cost("fsdp", shapes, world_size, padding="dim0", root_unit=0).wire_bytes
    wire = costs.ledger_wire_bytes(led)
    if abs(costs.ratio(wire, formula) - 1) > 1e-9:
        dtypes = sorted({r.dtype for r in led})
        raise AssertionError(f"the right collectives, but rank 0 sent {wire:,.0f} wire bytes, the fp32 formula says "
                             f"{formula:,.0f} (dtypes on the wire: {dtypes})\n   likely mistake: a knob changed "
                             "what is sent (mp_policy, a bf16 model): shard with the defaults here")
    placements = o.get("placements") if isinstance(o.get("placements"), list) and o.get("placements") else ["?"]
    return (f"{k} units (root + {k - 1} blocks), every parameter a DTensor {placements[0]}; one step: "
            f"{fwd} all-gathers in forward, {bwd} in backward, {rs} reduce-scatters, {wire:,.0f} wire bytes "
            "(the formula)")


@exercise("04", 'shard_model', cell='def shard_model(', hints=HINTS['shard_model'], tests=TESTS['shard_model'],
          mistakes={'root only': 'call fully_shard(block) on every block', 'no root': 'call fully_shard(model) last',
                    'root first': 'the root was sharded before the blocks', 'mesh ignored': 'pass mesh=mesh',
                    'never resharded': 'reshard_after_forward=False', 'root resharded': 'keeps the root gathered',
                    'units too small': 'sharding each layer inside a block', 'a knob changed': 'a knob changed what is sent'},
          guards=("argument", "cost"), judge=judge_shard_model,
          references=("course_lib.strategies.fsdp.torch.shard_gpt",))
def check_shard_model(fn, world_size: int = 4, name: str = "shard_model") -> bool:
    """``fn(model, mesh)`` applies ``fully_shard`` over ``mesh`` to every block, then to the root."""
    from course_lib.comm.ledger import Ledger
    fn = _guard(fn, "04", "shard_model")
    ran: dict = {}
    ok = decide(name, lab="04", tests=TESTS["shard_model"],
                run=lambda: ran.setdefault("data", run_shard_model(fn, world_size)),
                judge=judge_shard_model, params={"world_size": world_size, "name": name})
    if ok:
        fwd, bwd, _ = _step_counts(Ledger.from_dicts(ran["data"]["ledger"]))
        MEASURED.update({"forward all-gathers": fwd, "backward all-gathers": bwd})
    return ok


# -- exercise 2: explicit prefetch, two units ahead ("Train Your Large Model on Multiple GPUs with
#    Fully Sharded Data Parallelism", Machine Learning Mastery, shows it) --------------------------
def _plan_cfg() -> GPTConfig:
    """The 5-block GPT both halves use (the run builds it, the judge counts its blocks)."""
    return GPTConfig(seq_len=31, d_ff=199, n_layers=5)


def _plan_on_rank(fn, cfg, depths):
    """Run half, on one rank: for each depth, a fresh FSDP2 GPT, the learner's plan, and the lists FSDP2 holds."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.launch import rank_info
    from course_lib.models import TorchGPT
    from course_lib.strategies.fsdp.torch import shard_gpt
    mesh = init_device_mesh(rank_info().device.split(":")[0], (dist.get_world_size(),))

    def indices(states, idx):        # read as stored (a list subclass's own iteration is not consulted)
        items = list.__iter__(states) if isinstance(states, list) else iter(states or [])
        return [idx.get(id(s), -1) for s in items]
    plans = []
    for depth in depths:   # each depth on a fresh model: the lists are set, not appended to
        with torch.device("meta"):
            model = TorchGPT(cfg)
        shard_gpt(model, mesh)
        fn(model, depth)
        idx = {id(b._get_fsdp_state()): i for i, b in enumerate(model.blocks)}
        fwd = [indices(b._get_fsdp_state()._states_to_forward_prefetch, idx) for b in model.blocks]
        bwd = [indices(b._get_fsdp_state()._states_to_backward_prefetch, idx) for b in model.blocks]
        plans.append((fwd, bwd))
    return _plain.plain(plans)


def _plan_mistake(i: int, got: list, want: list, depth: int, L: int, backward: bool) -> str:
    if i in got:
        return f"block {i} prefetches itself: it is already being gathered when its own hook runs"
    if backward and not got and want and i - depth < 0:
        return (f"a negative slice start wraps around: blocks[{i - depth}:{i}] is empty in Python; clip the start "
                "at 0 (none before block 0, but the ones that exist)")
    if not backward and want and got == want[:-1] and want[-1] == L - 1:
        return (f"the last block is left out: block {L - 1} is the last, and a slice's end is exclusive (a slice "
                "past the end simply stops there, no need to clip it below L)")
    if sorted(got) == sorted(want):
        return "the right blocks in the wrong order: backward reaches i-1 first, then i-2 (nearest first)"
    if backward and got and all(j > i for j in got):
        return "backward runs the blocks in reverse: block i is followed by i-1, i-2, ..., not by i+1"
    if not backward and any(j < i for j in got):
        return "the list wraps around past the last block: none after the last"
    if len(got) > depth:
        return (f"{len(got)} blocks ahead, not depth={depth}: prefetching every block holds them all gathered, "
                "the memory FSDP exists to save")
    if len(got) < len(want):
        return f"only {len(got)} block(s) ahead: use `depth`, not a fixed number"
    return ("the previous `depth` blocks, nearest first, none before block 0" if backward
            else "the next `depth` blocks, in execution order, none past the last")


def _index_lists(x, L: int) -> bool:
    return isinstance(x, list) and len(x) == L and all(isinstance(v, list) and all(type(j) is int for j in v)
                                                       for v in x)


def judge_prefetch_plan(data: dict, depth: int = 2, name: str = "set_prefetch") -> str:
    """Judge half: each block's forward and backward prefetch lists, at ``depth`` and ``depth + 1``, against the
    blocks that run next (computed here)."""
    L = _plan_cfg().n_layers
    depths = (depth, depth + 1)
    plans = data.get("plans") if isinstance(data, dict) else None
    if not isinstance(plans, list) or len(plans) != len(depths):
        raise AssertionError(f"no prefetch plan came back for depths {depths}")
    for d, plan in zip(depths, plans):
        if not (isinstance(plan, (list, tuple)) and len(plan) == 2 and all(_index_lists(x, L) for x in plan)):
            raise AssertionError(f"depth={d}: the run read no forward and backward list for each of the {L} blocks")
        fwd, bwd = plan
        want_f = [list(range(i + 1, min(i + 1 + d, L))) for i in range(L)]
        want_b = [list(range(i - 1, max(i - 1 - d, -1), -1)) for i in range(L)]
        for i in range(L):
            if fwd[i] != want_f[i]:
                raise AssertionError(f"depth={d}: block {i} prefetches {fwd[i]} in forward, expected blocks "
                                     f"{want_f[i]}\n   likely mistake: "
                                     f"{_plan_mistake(i, fwd[i], want_f[i], d, L, False)}")
            if bwd[i] != want_b[i]:
                raise AssertionError(f"depth={d}: block {i} prefetches {bwd[i]} in backward, expected blocks "
                                     f"{want_b[i]}\n   likely mistake: "
                                     f"{_plan_mistake(i, bwd[i], want_b[i], d, L, True)}")
    want_f = [list(range(i + 1, min(i + 1 + depth, L))) for i in range(L)]
    want_b = [list(range(i - 1, max(i - 1 - depth, -1), -1)) for i in range(L)]
    return f"{L} blocks: forward prefetch {want_f[0]} from block 0, backward {want_b[-1]} from block {L - 1}"


@exercise("04", 'set_prefetch', cell='def set_prefetch(', hints=HINTS['set_prefetch'], tests=TESTS['set_prefetch'],
          mistakes={'backward in forward order': 'backward runs the blocks in reverse',
                    'depth ignored': 'use `depth`, not a fixed number', 'prefetches itself': 'prefetches itself',
                    'wraps around': 'wraps around past the last block', 'far first': 'nearest first',
                    'every block': 'prefetching every block holds them all',
                    'negative start': 'clip the start at 0', 'last block left out': 'the last block is left out'},
          guards=("argument", "boundary"), judge=judge_prefetch_plan,
          references=("course_lib.strategies.fsdp.torch.prefetch_ahead",))
def check_prefetch_plan(fn, depth: int = 2, world_size: int = 4, name: str = "set_prefetch") -> bool:
    """``fn(model, depth)``: block i prefetches blocks i+1..i+depth in forward, i-1..i-depth in backward;
    tried with ``depth`` and with ``depth + 1`` (the argument must matter)."""
    from course_lib.launch import run
    fn = _guard(fn, "04", "set_prefetch")
    return decide(name, lab="04", tests=TESTS["set_prefetch"],
                  run=lambda: {"plans": run(_plan_on_rank, fn, _plan_cfg(), (depth, depth + 1),
                                            world_size=world_size)[0]},
                  judge=judge_prefetch_plan, params={"depth": depth, "name": name})
