"""Model-state memory per rank: parameters, gradients and Adam's optimizer state, by strategy.

Pure arithmetic from the ZeRO paper (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC 2020, sec. 3.1 and fig. 1). ``Ψ`` is the number of parameter elements,
``N`` the number of ranks the states are sharded over (for HSDP pass the shard size ``F``).

================  ===================  ==========================
strategy          fp32 + Adam          mixed precision + Adam (K=12)
================  ===================  ==========================
dp                16Ψ                  16Ψ
zero1             8Ψ + 8Ψ/N            4Ψ + 12Ψ/N
zero2             4Ψ + 12Ψ/N           2Ψ + 14Ψ/N
zero3 / fsdp      16Ψ/N                16Ψ/N
================  ===================  ==========================

Bytes per element: ``"fp32"`` -- parameters 4, gradients 4, Adam ``m`` and ``v`` 4 + 4.
``"mixed"`` -- bf16/fp16 parameters 2 and gradients 2; the optimizer keeps an fp32 master copy and
``m``, ``v``: ``K = 12``. Activations, temporary all-gather buffers and allocator slack are not model
state and are not counted here (lab 02 measures them).

Sharding pads (see :mod:`course_lib.maths.sharding`): pass ``pad=True`` to count a sharded state as
``padded_size(Ψ, N) / N`` elements per rank, or pass an already padded ``Ψ`` (``costs.padded_numel``).
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.maths import strategy as strategies
from course_lib.maths.sharding import padded_size

__all__ = ["state_bytes", "StateBytes", "PRECISIONS"]

#: precision -> (parameter, gradient, optimizer) bytes per element, Adam
PRECISIONS = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


@dataclass(frozen=True)
class StateBytes:
    """Model-state bytes on one rank."""

    strategy: str
    psi: int
    n: int
    precision: str
    params: float       #: parameter bytes held between steps
    grads: float        #: gradient bytes held after backward
    optimizer: float    #: optimizer state bytes (Adam m, v; plus fp32 master weights when mixed)

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def per_psi(self) -> float:
        """Total bytes per parameter element: 16 for DP, 16/N for ZeRO-3."""
        return self.total / self.psi if self.psi else 0.0


def state_bytes(strategy: str, psi: int, n: int, *, precision: str = "fp32", pad: bool = False,
                replicate: int = 1) -> StateBytes:
    """Per-rank bytes of parameters, gradients and Adam state under ``strategy``.

    >>> state_bytes("zero2", 1000, 4).total    # 4Ψ + 12Ψ/N = 4000 + 3000
    7000.0

    A sharded state costs ``Ψ/N`` elements per rank (a fraction when ``N`` does not divide ``Ψ``:
    the paper's formula); with ``pad=True`` it costs ``ceil(Ψ/N)`` elements, as an implementation that
    pads to a multiple of ``N`` allocates. ``"hsdp"`` shards over ``F = n / replicate`` ranks: ``16Ψ/F``.
    """
    row = strategies.get(strategy)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {tuple(PRECISIONS)}")
    if not isinstance(psi, int) or psi < 0:
        raise ValueError(f"psi={psi!r} must be an int >= 0 (parameter elements)")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1 (ranks sharing the states)")
    f = strategies.sharding_factor(strategy, n, replicate)   # ranks that share one copy of the states
    shard = padded_size(psi, f) // f if pad else psi / f
    sizes = [shard if sharded else psi for sharded in row.sharded]
    p, g, o = (float(elems * b) for elems, b in zip(sizes, PRECISIONS[precision]))
    return StateBytes(strategy=strategy, psi=psi, n=n, precision=precision, params=p, grads=g, optimizer=o)
