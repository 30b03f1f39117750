"""Lab 04's exercise checks (FSDP2): ``fully_shard`` bottom-up, and an explicit prefetch plan.

Each runs the learner's function on real gloo ranks and reads what FSDP2 itself built: which modules
became units, the ledger of its collectives in one training step (forward and backward), and the
prefetch lists it will follow. Values alone would pass a model sharded as one unit (it trains the
same numbers), so the checks count units and collectives.
"""
from __future__ import annotations

from course_lib import checks
from course_lib.maths import costs
from course_lib.models import LAB_CONFIG, GPTConfig
from course_lib.checks.registry import exercise

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
                   "units, every parameter a DTensor; the ledger shows 4 all-gathers in forward (one per "
                   "unit), 3 in backward (the blocks again; the root stays gathered) and 4 reduce-scatters",
    "set_prefetch": "a 5-block GPT with depth 2: the forward and backward prefetch lists FSDP2 holds for "
                    "every block (which blocks, in which order)",
}


# -- exercise 1: fully_shard bottom-up ------------------------------------------------------
def _fsdp2_on_rank(fn, cfg):
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
            "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}),
            "shapes": [[tuple(p.shape) for n_, p in model.named_parameters() if not n_.startswith("blocks.")]]
            + [[tuple(p.shape) for p in b.parameters()] for b in model.blocks]}
    x, y = (torch.from_numpy(a).to(device) for a in
            TokenTask(cfg.vocab_size, cfg.seq_len).rank_batch(0, 8, dist.get_rank(), dist.get_world_size()))
    lt.recorder().reset()
    with lt.phase("forward"):
        loss = loss_fn(model(x), y)
    loss.backward()
    return info


def _run_shard(fn, world_size):
    from course_lib.launch import run
    try:
        return run(_fsdp2_on_rank, fn, LAB_CONFIG, world_size=world_size)
    except Exception as e:  # noqa: BLE001 - FSDP2's own error for the wrong order becomes a diagnosis
        if getattr(e, "exc_type", "") == "TypeError" and "Invariant encountered" in str(e):
            raise AssertionError(f"on rank {e.rank}: FSDP2 raised TypeError at the first forward (\"Invariant "
                                 "encountered: value was None\")\n   likely mistake: the root was sharded before "
                                 "the blocks; shard bottom-up: every block first, the model last") from None
        raise


@exercise("04", 'shard_model', cell='def shard_model(', hints=HINTS['shard_model'], tests=TESTS['shard_model'],
          mistakes={'root only': 'call fully_shard(block) on every block'})
def check_shard_model(fn, world_size: int = 4, name: str = "shard_model") -> bool:
    """``fn(model, mesh)`` applies ``fully_shard`` over ``mesh`` to every block, then to the root."""
    with checks.check(name, tests=TESTS[name]) as c:
        out = _run_shard(fn, world_size)
        o = out[0]
        k = 1 + len(o["blocks"])
        if not all(o["blocks"]):
            raise AssertionError(f"blocks that are units: {o['blocks']}\n   likely mistake: call fully_shard(block) "
                                 "on every block of model.blocks, so that each one is gathered and freed on its own")
        if not o["root"] or o["plain"]:
            raise AssertionError(f"parameters left unsharded: {o['plain']}\n   likely mistake: call "
                                 "fully_shard(model) last: the root unit takes every parameter no block took")
        if len(o["units"]) != k:
            inner = [u for u in o["units"] if u != "root" and u.count(".") > 1]
            raise AssertionError(f"{len(o['units'])} units, expected {k} (root + {k - 1} blocks); extra units: "
                                 f"{inner[:4]}{' ...' if len(inner) > 4 else ''}\n   likely mistake: only the "
                                 "blocks and the root are units; sharding each layer inside a block multiplies "
                                 "the collectives (each too small to hide behind compute)")
        led = out.ledger.filter(rank=0)
        fwd = len(led.filter(phase="forward", op="all_gather"))
        bwd = len(led.filter(phase="backward", op="all_gather"))
        rs = len(led.filter(op="reduce_scatter"))
        if (fwd, bwd, rs) != (k, k - 1, k):
            why = ("no all-gather in backward: reshard_after_forward=False keeps every block gathered from its "
                   "forward to its backward (ZeRO-2's traffic, and the memory FSDP exists to save); leave the "
                   "default" if bwd == 0 else "one all-gather per unit in forward, the blocks again in backward")
            raise AssertionError(f"rank 0 issued {fwd} all-gathers in forward, {bwd} in backward, {rs} "
                                 f"reduce-scatters; expected {k}, {k - 1}, {k}\n   likely mistake: {why}")
        formula = costs.step_cost("fsdp", o["shapes"], world_size, padding="dim0", root_unit=0).wire_bytes
        wire = costs.ledger_wire_bytes(led)
        if abs(costs.ratio(wire, formula) - 1) > 1e-9:
            dtypes = sorted({r.dtype for r in led})
            raise AssertionError(f"the right collectives, but rank 0 sent {wire:,.0f} wire bytes, the fp32 formula says "
                                 f"{formula:,.0f} (dtypes on the wire: {dtypes})\n   likely mistake: a knob changed "
                                 "what is sent (mp_policy, a bf16 model): shard with the defaults here")
        MEASURED.update({"forward all-gathers": fwd, "backward all-gathers": bwd})
        c.ok(f"{k} units (root + {k - 1} blocks), every parameter a DTensor {o['placements'][0]}; one step: "
             f"{fwd} all-gathers in forward, {bwd} in backward, {rs} reduce-scatters, {wire:,.0f} wire bytes (the formula)")
    return bool(c.passed)


# -- exercise 2: explicit prefetch, two units ahead ("Train Your Large Model on Multiple GPUs with
#    Fully Sharded Data Parallelism", Machine Learning Mastery, shows it) --------------------------
def _plan_on_rank(fn, cfg, depth):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.launch import rank_info
    from course_lib.models import TorchGPT
    from course_lib.strategies.fsdp.torch import shard_gpt
    with torch.device("meta"):
        model = TorchGPT(cfg)
    shard_gpt(model, init_device_mesh(rank_info().device.split(":")[0], (dist.get_world_size(),)))
    fn(model, depth)
    idx = {id(b._get_fsdp_state()): i for i, b in enumerate(model.blocks)}
    fwd = [[idx.get(id(s), -1) for s in (b._get_fsdp_state()._states_to_forward_prefetch or [])] for b in model.blocks]
    bwd = [[idx.get(id(s), -1) for s in (b._get_fsdp_state()._states_to_backward_prefetch or [])] for b in model.blocks]
    return fwd, bwd


def _plan_mistake(i: int, got: list, want: list, depth: int, L: int, backward: bool) -> str:
    if i in got:
        return f"block {i} prefetches itself: it is already being gathered when its own hook runs"
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


@exercise("04", 'set_prefetch', cell='def set_prefetch(', hints=HINTS['set_prefetch'], tests=TESTS['set_prefetch'],
          mistakes={'backward in forward order': 'backward runs the blocks in reverse'})
def check_prefetch_plan(fn, depth: int = 2, world_size: int = 4, name: str = "set_prefetch") -> bool:
    """``fn(model, depth)``: block i prefetches blocks i+1..i+depth in forward, i-1..i-depth in backward."""
    from course_lib.launch import run
    cfg = GPTConfig(seq_len=31, d_ff=199, n_layers=5)
    with checks.check(name, tests=TESTS[name]) as c:
        fwd, bwd = run(_plan_on_rank, fn, cfg, depth, world_size=world_size)[0]
        L = cfg.n_layers
        want_f = [list(range(i + 1, min(i + 1 + depth, L))) for i in range(L)]
        want_b = [list(range(i - 1, max(i - 1 - depth, -1), -1)) for i in range(L)]
        for i in range(L):
            if fwd[i] != want_f[i]:
                raise AssertionError(f"block {i} prefetches {fwd[i]} in forward, expected blocks {want_f[i]}\n"
                                     f"   likely mistake: {_plan_mistake(i, fwd[i], want_f[i], depth, L, False)}")
            if bwd[i] != want_b[i]:
                raise AssertionError(f"block {i} prefetches {bwd[i]} in backward, expected blocks {want_b[i]}\n"
                                     f"   likely mistake: {_plan_mistake(i, bwd[i], want_b[i], depth, L, True)}")
        c.ok(f"{L} blocks: forward prefetch {want_f[0]} from block 0, backward {want_b[-1]} from block {L - 1}")
    return bool(c.passed)
