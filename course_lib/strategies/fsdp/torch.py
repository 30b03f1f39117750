"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on the course GPT, and the three implementations the
labs compare, each built on a rank the same way.

:func:`shard_gpt` is Lab 04's first exercise done: ``fully_shard`` bottom-up (every block, then the root),
the order "Train Your Large Model on Multiple GPUs with Fully Sharded Data Parallelism" shows and FSDP2
requires (a parent's ``fully_shard`` leaves out the parameters its children already manage).
:func:`prefetch_ahead` is its second exercise done: an explicit prefetch plan ``depth`` blocks ahead.
:func:`build` wraps the lab GPT as ours (:class:`~course_lib.strategies.fsdp.scratch.FlatFSDP`), FSDP2 or DDP.
"""
from __future__ import annotations

from course_lib.models import GPTConfig

__all__ = ["IMPLEMENTATIONS", "shard_gpt", "prefetch_ahead", "build"]

#: What :func:`build` can wrap the GPT with.
IMPLEMENTATIONS = ("ours", "fsdp2", "ddp")


def shard_gpt(model, mesh=None, *, root_kwargs=None, **kwargs):
    """FSDP2 on the course GPT, bottom-up: ``fully_shard`` each block, then the root (the reference
    answer of Lab 04's first exercise). ``kwargs`` go to every call, ``root_kwargs`` to the root's."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **{**kwargs, **(root_kwargs or {})})
    return model


def prefetch_ahead(model, depth: int):
    """Explicit prefetch on an FSDP2-sharded GPT (the reference answer of Lab 04's second exercise):
    block i starts gathering blocks i+1..i+depth when its forward starts, and i-1..i-depth (nearest
    first, as the backward reaches them) when its backward starts. ``depth=0`` clears both lists."""
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])
    return model


def build(strategy: str, cfg: GPTConfig, device="cpu", prefetch: bool = False, dtype=None,
          reshard_root: bool = True):
    """On a rank: the lab GPT (``init_weights(cfg, 0)``) wrapped for ``strategy`` ("ours", "fsdp2",
    "ddp"), and its units' shapes (what ``costs.step_cost`` needs). ``reshard_root=False`` leaves
    FSDP2's root at its default (kept unsharded after forward)."""
    import torch
    from course_lib.strategies.fsdp.scratch import FlatFSDP
    from course_lib.models import TorchGPT, torch_gpt, torch_init_
    if strategy == "ours":
        model = torch_gpt(cfg, seed=0).to(device, dtype)
        m = FlatFSDP(model, list(model.blocks), prefetch=prefetch)
        return m, m.unit_shapes()
    if strategy == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        with torch.device("meta"):
            model = TorchGPT(cfg).to(dtype)
        mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        shard_gpt(model, mesh, reshard_after_forward=True,
                  root_kwargs={"reshard_after_forward": True if reshard_root else None})
        model.to_empty(device=device)
        torch_init_(model, cfg, seed=0)   # every rank computes the same numbers and keeps its shard
        if not prefetch:   # FSDP2 prefetches by default; ours does not unless asked
            for block in model.blocks:
                block.set_modules_to_forward_prefetch([])
                block.set_modules_to_backward_prefetch([])
        blocks = {id(p) for b in model.blocks for p in b.parameters()}
        root = [tuple(p.shape) for p in model.parameters() if id(p) not in blocks]
        return model, [root] + [[tuple(p.shape) for p in b.parameters()] for b in model.blocks]
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = torch_gpt(cfg, seed=0).to(device, dtype)
        return DDP(model), [[tuple(p.shape) for p in model.parameters()]]
    raise ValueError(f"strategy={strategy!r} must be one of {IMPLEMENTATIONS}")
