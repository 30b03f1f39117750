"""Ownership of real sharded models: FSDP2 DTensor parameters (torch) and ``jax.Array`` shardings.

Both return the plain :class:`~course_lib.maths.ownership.OwnershipSpec` that :func:`~course_lib.maths.ownership.what_if`
predicts, so a lab can put the real layout beside the prediction. They read real framework objects, so
they live with the strategies, above the pure maths; torch and JAX are imported inside the functions,
never at import time.
"""
from __future__ import annotations

import math

from course_lib.maths.ownership import Bar, OwnershipSpec, Slice, grid_bar

__all__ = ["describe_torch", "describe_jax"]


def describe_torch(model, *, precision: str = "fp32") -> OwnershipSpec:
    """Call ON A RANK (inside ``course_lib.run``): every parameter's sharding, from its DTensor.

    Reads ``placements`` and ``device_mesh`` (global ranks, axis names) and computes every rank's slice
    with torch.chunk semantics, then checks this rank's own slice against ``to_local()``'s shape and the
    global offset DTensor reports. A plain (non-DTensor) parameter is replicated on every rank.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    bars, notes, mesh_shape, axes = [], [], None, None
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as _local
    except ImportError:  # private helper; only used for the self-check
        _local = None
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            ranks = mesh.mesh.tolist()
            mesh_shape, axes = tuple(mesh.mesh.shape), tuple(mesh.mesh_dim_names or ())
            pls = []
            for pl in p.placements:
                if isinstance(pl, Shard):  # _StridedShard is a Shard too; its order is not modelled
                    pls.append(("shard", pl.dim))
                elif isinstance(pl, Replicate):
                    pls.append(("replicate",))
                else:
                    pls.append(("replicate",))
                    notes.append(f"{name}: placement {pl} drawn as replicated")
            bar = grid_bar(name, tuple(p.shape), ranks, pls, p.element_size())
            mine = [s for s in bar.slices if rank in s.owners]
            local = tuple(p.to_local().shape)
            if mine and tuple(hi - lo for lo, hi in mine[0].where) != local:
                notes.append(f"{name}: rank {rank} computed {mine[0].where} but to_local() has shape {local}")
            if _local is not None and mine and mine[0].real:
                _, off = _local(p.shape, mesh, p.placements)
                if tuple(off) != tuple(lo for lo, _ in mine[0].where):
                    notes.append(f"{name}: rank {rank} global offset {tuple(off)} differs from the computed one")
        else:
            bar = grid_bar(name, tuple(p.shape) or (1,), [list(range(world))], [("replicate",)], p.element_size())
        bars.append(bar)
    strategy = "hsdp" if mesh_shape and len(mesh_shape) == 2 else ("fsdp" if mesh_shape else "dp")
    all_ranks = tuple(sorted({o for b in bars for s in b.slices for o in s.owners})) or tuple(range(world))
    # the slices' owners already say what is replicated, so every state follows the layout
    return OwnershipSpec("torch", strategy, world, tuple(bars), all_ranks, mesh_shape, axes or None, "dim0",
                         precision, (True, True, True), None, tuple(notes) + (f"described on rank {rank}",))


def _path_name(path) -> str:
    """``blocks.0.attn.kernel`` from a pytree path (an nnx Variable's trailing ``.value`` dropped)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if len(parts) > 1 and parts[-1] == "value":
        parts.pop()
    return ".".join(parts) or "array"


def describe_jax(tree, *, precision: str = "fp32") -> OwnershipSpec:
    """Every ``jax.Array`` leaf of ``tree`` (e.g. ``nnx.state(model)``): which device holds which block.

    From ``array.sharding.devices_indices_map(shape)``; devices holding the same block are co-owners
    (replicated along some mesh axis). Owners are device ids. NamedSharding refuses uneven splits, so
    there is no padding; blocks are ordered by their index, and a block split on several dims is drawn
    as one stretch of its numel (the exact ranges are in ``Slice.where``).
    """
    import jax
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    bars, mesh_shape, axes, devices = [], None, None, set()
    for path, x in leaves:
        if not isinstance(x, jax.Array):
            continue
        shape = tuple(x.shape)
        sh = x.sharding
        mesh = getattr(sh, "mesh", None)
        if mesh is not None and getattr(mesh, "shape", None):
            mesh_shape, axes = tuple(mesh.shape.values()), tuple(mesh.axis_names)
        blocks: dict = {}
        for dev, idx in sh.devices_indices_map(shape).items():
            ranges = tuple(sl.indices(d)[:2] for sl, d in zip(idx, shape)) if shape else ((0, 1),)
            blocks.setdefault(ranges, []).append(dev.id)
            devices.add(dev.id)
        slices, pos = [], 0
        for ranges in sorted(blocks):
            size = math.prod(hi - lo for lo, hi in ranges)
            slices.append(Slice(tuple(sorted(blocks[ranges])), pos, pos + size, size, 0, ranges))
            pos += size
        bars.append(Bar(_path_name(path), shape or (1,), max(1, math.prod(shape)), pos, tuple(slices),
                        itemsize=x.dtype.itemsize))
    ranks = tuple(sorted(devices))
    return OwnershipSpec("jax", "jax", len(ranks), tuple(bars), ranks, mesh_shape, axes, "block", precision,
                         (True, True, True), None, ("grads and optimizer state assumed sharded like the params",))
