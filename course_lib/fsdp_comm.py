"""The raw collectives of our from-scratch FSDP (:mod:`course_lib.fsdp`), apart from the wrapper.

Two calls, nothing else (picotron keeps communication in its own file the same way):

* :func:`all_gather_flat` -- every rank's shard of a flat parameter -> the padded unsharded buffer,
  the **all-gather output** (``world * shard`` elements, padding included).
* :func:`reduce_scatter_mean` -- every rank's full padded gradient (the **reduce-scatter input**) ->
  this rank's shard of the gradient *averaged* over ranks.

Why ``SUM`` and then ``÷N`` rather than ``ReduceOp.AVG``: ``AVG`` is one op on NCCL and on gloo in
torch >= 2.9, but gloo's reduce-scatter ``AVG`` silently returned the ``SUM`` in torch 2.7-2.8
(pytorch#162338). Dividing ourselves is correct on every backend and costs one elementwise op on the
shard -- the JAX pattern ``psum_scatter(g) / N`` exactly.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names warn); GPU machines carry torch 2.11. We take whichever the
installed torch offers, so neither version prints a warning.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_gather_flat", "reduce_scatter_mean"]

# same signatures: (output, input, [op,] group=None, async_op=False)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(shard: torch.Tensor, group=None, async_op: bool = False):
    """All-gather 1-D shards into one new flat buffer: ``(buffer, work)``.

    ``shard`` [S] on every rank -> ``buffer`` [N*S], rank r's shard at ``[r*S, (r+1)*S)``.
    With ``async_op=True`` the call returns at once and ``work.wait()`` completes it (prefetch);
    otherwise ``work`` is None and the buffer is ready.
    """
    world = dist.get_world_size(group)
    buffer = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)  # [N*S]
    work = _ALL_GATHER(buffer, shard.detach().contiguous(), group=group, async_op=async_op)
    return buffer, work


def reduce_scatter_mean(full: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's shard of ``mean over ranks of full``: reduce-scatter (``SUM``) then ``÷N``.

    ``full`` [N*S] (padded, same size on every rank) -> [S]. It equals
    ``(all_reduce(full) / N)[r*S:(r+1)*S]`` and moves half the bytes of that all-reduce.
    """
    world = dist.get_world_size(group)
    if full.numel() % world:
        raise ValueError(f"full has {full.numel()} elements, not a multiple of the group size "
                         f"N({world}): pad it to sharding.padded_size(n, N) first")
    shard = torch.empty(full.numel() // world, dtype=full.dtype, device=full.device)  # [S]
    _REDUCE_SCATTER(shard, full.contiguous(), op=dist.ReduceOp.SUM, group=group)
    return shard.div_(world)
