"""Which strategy shards what: the one table every other module reads.

The ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020) names the stages by what stops being replicated; the FSDP paper (Zhao et al.,
"PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023) adds hybrid sharding,
where the states are sharded over ``F`` ranks (the sharding factor) and replicated over ``N/F``.

=========  ==========  =========  ===============  ==========================================
strategy   parameters  gradients  optimizer state  sharded over
=========  ==========  =========  ===============  ==========================================
dp         replicated  replicated replicated       --
zero1      replicated  replicated sharded          all N ranks
zero2      replicated  sharded    sharded          all N ranks
zero3      sharded     sharded    sharded          all N ranks
fsdp       sharded     sharded    sharded          all N ranks (ZeRO-3, FSDP's FULL_SHARD)
hsdp       sharded     sharded    sharded          F ranks of one replica group (HYBRID_SHARD)
=========  ==========  =========  ===============  ==========================================
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Strategy", "STRATEGIES", "STATES", "get", "sharding_factor"]

#: The three model states, in the order every table uses.
STATES = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class Strategy:
    """One row of the table: which of :data:`STATES` are sharded, and whether a replicate dim exists."""

    name: str
    params: bool        #: parameters kept sharded between uses
    grads: bool         #: gradients kept sharded after backward
    optimizer: bool     #: optimizer state (Adam m, v; fp32 master weights) sharded
    hybrid: bool = False  #: sharded over F ranks, replicated over N/F (a 2-D mesh)

    @property
    def sharded(self) -> tuple[bool, bool, bool]:
        """``(params, grads, optimizer)``: True where the state is sharded."""
        return (self.params, self.grads, self.optimizer)


STRATEGIES: dict[str, Strategy] = {s.name: s for s in (
    Strategy("dp", False, False, False),
    Strategy("zero1", False, False, True),
    Strategy("zero2", False, True, True),
    Strategy("zero3", True, True, True),
    Strategy("fsdp", True, True, True),
    Strategy("hsdp", True, True, True, hybrid=True),
)}


def get(name: str) -> Strategy:
    """The row for ``name``; a clear error naming the choices otherwise."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy={name!r} must be one of {tuple(STRATEGIES)}") from None


def sharding_factor(name: str, n: int, replicate: int = 1) -> int:
    """``F``, the ranks that share one copy of the sharded states: ``n`` for every strategy but HSDP,
    ``n / replicate`` for HSDP. Errors name every factor and the fix."""
    row = get(name)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1 (ranks in the data-parallel world)")
    if row.hybrid:
        if not isinstance(replicate, int) or replicate < 1 or n % replicate:
            raise ValueError(f"replicate({replicate}) must be an int >= 1 that divides n({n}); the sharding "
                             f"factor F = n / replicate must be whole, e.g. replicate=2 for n=8")
        return n // replicate
    if replicate != 1:
        raise ValueError(f"replicate={replicate} only applies to strategy='hsdp' (got {name!r}); "
                         "leave it at 1 or use strategy='hsdp'")
    return n
