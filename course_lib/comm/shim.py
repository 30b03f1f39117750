"""The flat collectives every sharded strategy is built from, and the one torch-version shim under them.

Two calls (picotron keeps raw communication apart from the wrappers the same way):

* :func:`all_gather_flat` -- every rank's 1-D shard -> the padded unsharded buffer, the **all-gather
  output** (``N * S`` elements, padding included, rank r's shard at ``[r*S, (r+1)*S)``).
* :func:`reduce_scatter_flat` -- every rank's full padded buffer (the **reduce-scatter input**) ->
  this rank's shard of the SUM over ranks, or of the mean with ``mean=True``.

Why ``SUM`` and then ``÷N`` rather than ``ReduceOp.AVG``: ``AVG`` is one op on NCCL and on gloo in
torch >= 2.9, but gloo's reduce-scatter ``AVG`` silently returned the ``SUM`` in torch 2.7-2.8
(pytorch#162338). Dividing ourselves is correct on every backend and costs one elementwise op on the
shard -- the JAX pattern ``psum_scatter(g) / N`` exactly.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``all_gather_single`` /
``reduce_scatter_single`` (the old names warn); GPU machines carry torch 2.11. :data:`ALL_GATHER` and
:data:`REDUCE_SCATTER` are whichever the installed torch offers, so neither version prints a warning.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ALL_GATHER", "REDUCE_SCATTER", "all_gather_flat", "reduce_scatter_flat"]

#: ``(output, input, group=None, async_op=False)``, on every supported torch.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
#: ``(output, input, op=SUM, group=None, async_op=False)``, on every supported torch.
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(shard: torch.Tensor, group=None, *, out: torch.Tensor | None = None, async_op: bool = False):
    """All-gather 1-D shards into one flat buffer: ``(buffer, work)``.

    ``shard`` [S] on every rank -> ``buffer`` [N*S] (``out`` when given, else a new tensor).
    With ``async_op=True`` the call returns at once and ``work.wait()`` completes it (prefetch);
    otherwise ``work`` is None and the buffer is ready.
    """
    world = dist.get_world_size(group)
    if out is None:
        out = torch.empty(world * shard.numel(), dtype=shard.dtype, device=shard.device)  # [N*S]
    elif out.numel() != world * shard.numel():
        raise ValueError(f"out has {out.numel()} elements; it must hold N({world}) x shard({shard.numel()}) "
                         f"= {world * shard.numel()}")
    work = ALL_GATHER(out, shard.detach().contiguous(), group=group, async_op=async_op)
    return out, work


def reduce_scatter_flat(full: torch.Tensor, group=None, *, out: torch.Tensor | None = None,
                        mean: bool = False) -> torch.Tensor:
    """This rank's shard of the sum (``mean=True``: the mean) over ranks of ``full`` [N*S] -> [S].

    It equals ``(all_reduce(full) / N)[r*S:(r+1)*S]`` with ``mean=True`` and moves half the bytes of
    that all-reduce. Written into ``out`` when given (and returned).

    Received into a private buffer, then copied: gloo's reduce-scatter is an all-reduce whose result is
    copied into the output inside ``wait()``, and under the ledger that copy can run *again* later,
    overwriting an output the caller has since changed in place (e.g. divided by N).
    """
    world = dist.get_world_size(group)
    if full.numel() % world:
        raise ValueError(f"full has {full.numel()} elements, not a multiple of the group size "
                         f"N({world}): pad it to sharding.padded_size(n, N) first")
    received = torch.empty(full.numel() // world, dtype=full.dtype, device=full.device)  # [S], ours alone
    REDUCE_SCATTER(received, full.contiguous(), op=dist.ReduceOp.SUM, group=group)
    result = received / world if mean else received.clone()
    if out is None:
        return result
    return out.copy_(result)
