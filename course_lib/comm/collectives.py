"""All-reduce built from its two halves (the checks of Lab 00's exercises are :mod:`course_lib.checks.lab00`).

The identity every later lab leans on (ZeRO, FSDP): a ring all-reduce *is* a reduce-scatter followed
by an all-gather (Patarasuk & Yuan 2009) -- each rank first ends up with the sum of one ``1/N`` chunk,
then everyone collects everyone's chunk. :func:`all_reduce_by_parts` is that identity in torch (run it
on a rank).

Words as in :mod:`course_lib.comm.ledger` (payload ``V``) and :mod:`course_lib.maths.costs` (wire bytes).
"""
from __future__ import annotations




__all__ = ["all_reduce_by_parts", "RING_OPS"]

#: The ops of Lab 00's ring-cost exercise.
RING_OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def all_reduce_by_parts(x, mean: bool = False):
    """On a rank: reduce-scatter ``x`` (1-D, ``numel`` a multiple of N), then all-gather the shards.

    Returns a new tensor equal to ``dist.all_reduce(x)`` (or its mean over ranks); ``x`` is untouched.
    """
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    if x.dim() != 1 or x.numel() % n:
        raise ValueError(f"x must be 1-D with numel a multiple of N={n}; got shape {tuple(x.shape)} "
                         "(pad it first: course_lib.maths.sharding.padded_size)")
    shard = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(shard, x)         # rank r: sum over ranks of chunk r
    if mean:
        shard /= n
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)      # everyone: every rank's reduced chunk, in rank order
    return out
