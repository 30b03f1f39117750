"""Lab 04's exercise checks (FSDP2): ``fully_shard`` bottom-up, and an explicit prefetch plan.

Each runs the learner's function on real gloo ranks and reads the ledger of FSDP2's own collectives.
"""
from __future__ import annotations

from course_lib import checks
from course_lib.models import LAB_CONFIG, GPTConfig

__all__ = ["check_shard_model", "check_prefetch_plan"]


# -- exercise 1: fully_shard bottom-up ------------------------------------------------------
def _fsdp2_on_rank(fn, cfg):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from course_lib.comm import torch_ledger as lt
    from course_lib.models.data import TokenTask
    from course_lib.launch import rank_info
    from course_lib.models import TorchGPT, loss_fn, torch_init_
    device = torch.device(rank_info().device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    with torch.device("meta"):
        model = TorchGPT(cfg)
    fn(model, mesh)
    model.to_empty(device=device)
    torch_init_(model, cfg, seed=0)
    info = {"plain": [n_ for n_, p in model.named_parameters() if not isinstance(p, DTensor)],
            "root": isinstance(model, FSDPModule), "blocks": [isinstance(b, FSDPModule) for b in model.blocks],
            "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})}
    x, y = (torch.from_numpy(a).to(device) for a in
            TokenTask(cfg.vocab_size, cfg.seq_len).rank_batch(0, 8, dist.get_rank(), dist.get_world_size()))
    lt.recorder().reset()
    with lt.phase("forward"):
        loss = loss_fn(model(x), y)
    loss.backward()
    info["loss"] = loss.item()
    return info


def check_shard_model(fn, world_size: int = 4, name: str = "shard_model") -> bool:
    """``fn(model, mesh)`` applies ``fully_shard`` over ``mesh`` to every block, then to the root."""
    from course_lib.launch import run
    with checks.check(name) as c:
        out = run(_fsdp2_on_rank, fn, LAB_CONFIG, world_size=world_size)
        o = out[0]
        if not all(o["blocks"]):
            raise AssertionError(f"blocks sharded: {o['blocks']} → call fully_shard(block) on every block of "
                                 "model.blocks, so each one is its own unit")
        if not o["root"] or o["plain"]:
            raise AssertionError(f"parameters left unsharded: {o['plain']} → call fully_shard(model) last: "
                                 "the root unit takes every parameter no block took")
        fwd = out.ledger.filter(rank=0, phase="forward", op="all_gather")
        k = 1 + len(o["blocks"])
        if len(fwd) != k:
            raise AssertionError(f"{len(fwd)} all-gathers in forward, expected {k} (one per unit)")
        c.ok(f"{k} units (root + {k - 1} blocks), every parameter a DTensor {o['placements'][0]}; "
             f"{k} all-gathers in forward")
    return bool(c.passed)


# -- exercise 2: explicit prefetch, two units ahead (the example of "Train Your Large Model on Multiple GPUs with Fully Sharded Data Parallelism") ---------------------
def _plan_on_rank(fn, cfg, depth):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_lib.launch import rank_info

    from course_lib.models import TorchGPT
    with torch.device("meta"):
        model = TorchGPT(cfg)
    mesh = init_device_mesh(rank_info().device.split(":")[0], (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fn(model, depth)
    idx = {id(b._get_fsdp_state()): i for i, b in enumerate(model.blocks)}
    fwd = [[idx.get(id(s), -1) for s in (b._get_fsdp_state()._states_to_forward_prefetch or [])] for b in model.blocks]
    bwd = [[idx.get(id(s), -1) for s in (b._get_fsdp_state()._states_to_backward_prefetch or [])] for b in model.blocks]
    return fwd, bwd


def check_prefetch_plan(fn, depth: int = 2, world_size: int = 4, name: str = "set_prefetch") -> bool:
    """``fn(model, depth)``: block i prefetches blocks i+1..i+depth in forward, i-1..i-depth in backward."""
    from course_lib.launch import run
    cfg = GPTConfig(seq_len=31, d_ff=199, n_layers=5)
    with checks.check(name) as c:
        fwd, bwd = run(_plan_on_rank, fn, cfg, depth, world_size=world_size)[0]
        L = cfg.n_layers
        want_f = [list(range(i + 1, min(i + 1 + depth, L))) for i in range(L)]
        want_b = [list(range(i - 1, max(i - 1 - depth, -1), -1)) for i in range(L)]
        for i in range(L):
            if fwd[i] != want_f[i]:
                raise AssertionError(f"block {i} prefetches {fwd[i]} in forward, expected blocks {want_f[i]} "
                                     "(the next `depth` blocks, in execution order; none past the last)")
            if bwd[i] != want_b[i]:
                raise AssertionError(f"block {i} prefetches {bwd[i]} in backward, expected blocks {want_b[i]} "
                                     "(backward runs the blocks in reverse: the previous `depth`, nearest first)")
        c.ok(f"{L} blocks: forward prefetch {want_f[0]} from block 0, backward {want_b[-1]} from block {L - 1}")
    return bool(c.passed)
