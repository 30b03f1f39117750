"""Communication cost: what a collective sends, and what one training step should send, from the model.

Two kinds of number, kept apart on purpose:

* **analytic** -- :func:`step_cost` works from the model description (parameter shapes, ``N``, dtypes,
  padding) and the strategy's algorithm. It never looks at a ledger.
* **measured** -- :func:`ledger_wire_bytes` applies the same ring formulas to the collectives a run
  actually issued (a :class:`~course_lib.comm.ledger.Ledger`). ``ratio(measured, analytic) == 1`` says the
  implementation sends what the algorithm says; an extra all-gather, or an all-reduce where a
  reduce-scatter belongs, shows up as a ratio above 1.

**Wire bytes** are the bytes a rank *sends* for one collective of payload ``V`` (see
:mod:`course_lib.comm.ledger` for ``V``) on ``N`` ranks, with ring algorithms (Thakur, Rabenseifner & Gropp,
"Optimization of collective communication operations in MPICH", 2005; Patarasuk & Yuan 2009 for the
all-reduce bound). A formula is the algorithm's floor: an implementation may sit above it (gloo's
reduce-scatter moves about twice the ring bound on CPU; NCCL reaches it).
Words (sharded parameter, padding, all-gather output) are those of :mod:`course_lib.maths.sharding`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.comm.ledger import OPS, CollectiveRecord, Ledger
from course_lib.maths import strategy as strategies
from course_lib.maths.sharding import dim0_layout, padded_size

__all__ = [
    "wire_bytes", "record_wire_bytes", "ledger_wire_bytes", "ratio",
    "padded_numel", "step_cost", "StepCost", "OpCost", "PADDINGS",
    "AlphaBeta", "fit_alpha_beta",
]

PADDINGS = ("flat", "dim0", "none")


def wire_bytes(op: str, nbytes: float, n: int) -> float:
    """Bytes one rank sends for a collective ``op`` of payload ``nbytes`` (``V``) over ``n`` ranks.

    ============================  ==================  ==============================================
    op                            wire bytes          algorithm
    ============================  ==================  ==============================================
    all_gather, reduce_scatter    (N-1)/N * V         ring: N-1 steps of V/N
    all_reduce                    2(N-1)/N * V        ring reduce-scatter + ring all-gather
    all_to_all                    (N-1)/N * V         every rank keeps 1/N of its input
    broadcast, reduce             (N-1)/N * V         pipelined ring; the root sends V and the last
                                                      rank nothing: (N-1)V in all, averaged per rank
    gather, scatter               (N-1)/N^2 * V       direct to/from the root, averaged per rank
    collective_permute, send      V                   each sender sends its whole buffer
    recv, barrier                 0                   no payload leaves the rank
    ============================  ==================  ==============================================

    Rooted ops are averaged over the group so that summing one record per rank gives the total sent.
    ``n == 1`` is always 0: nothing leaves the device.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a known collective; expected one of {OPS}")
    if nbytes < 0 or not isinstance(n, int) or n < 1:
        raise ValueError(f"nbytes={nbytes!r} must be >= 0 and n={n!r} an int >= 1")
    if n == 1 or op in ("recv", "barrier"):
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("gather", "scatter"):
        return (n - 1) / (n * n) * nbytes
    if op in ("collective_permute", "send"):
        return float(nbytes)
    return (n - 1) / n * nbytes  # all_gather, reduce_scatter, all_to_all, broadcast, reduce


def record_wire_bytes(record: CollectiveRecord) -> float:
    """:func:`wire_bytes` of one ledger record (its ``op``, payload and group size)."""
    return wire_bytes(record.op, record.nbytes, record.group_size)


def ledger_wire_bytes(ledger: Ledger | list) -> float:
    """The *measured* wire bytes: the sum of :func:`record_wire_bytes` over the records given.

    A torch ledger holds one record per op per rank, so this is the total over ranks: filter it to one
    rank (``ledger.filter(rank=0)``) to compare with the per-rank :func:`step_cost`. A JAX-HLO ledger
    holds one record per op for the whole SPMD program, which already is per device.
    """
    return sum(record_wire_bytes(r) for r in ledger)


def ratio(measured: float, analytic: float) -> float:
    """``measured / analytic`` (1.0 when both are 0, ``inf`` when only the analytic one is)."""
    return 1.0 if measured == analytic == 0 else (math.inf if analytic == 0 else measured / analytic)


# -- the model description -------------------------------------------------------------------------
def _is_shape(x) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in x)


def _as_units(units) -> list[list[tuple[int, ...]]]:
    """``units`` is a list of units, each a list of shapes; a bare list of shapes is one unit."""
    units = list(units)
    if units and all(_is_shape(u) for u in units) and any(len(u) for u in units):
        units = [units]  # a list of shapes: the whole model is one unit (only the root is wrapped)
    out = []
    for i, unit in enumerate(units):
        if not isinstance(unit, (tuple, list)) or not all(_is_shape(s) for s in unit):
            raise ValueError(f"units[{i}]={unit!r} is not a list of shapes; pass units as "
                             "[[(rows, cols), (cols,)], ...] (one list of parameter shapes per FSDP unit) "
                             "or one flat list of shapes for a single unit")
        for s in unit:
            if any(d < 0 for d in s):
                raise ValueError(f"units[{i}] has shape {tuple(s)} with a negative dimension")
        out.append([tuple(s) for s in unit])
    return out


def padded_numel(units, n: int, padding: str = "flat") -> int:
    """Elements of all units' all-gather outputs, i.e. ``Ψ`` padded as the implementation pads it.

    ``"flat"``: per unit ``ceil(Σ numel / n) * n`` (FSDP1's FlatParameter, our from-scratch FSDP);
    ``"dim0"``: per parameter ``ceil(d0 / n) * n * prod(rest)`` (FSDP2); ``"none"``: ``Ψ`` itself.
    """
    if padding not in PADDINGS:
        raise ValueError(f"padding={padding!r} must be one of {PADDINGS}")
    units = _as_units(units)
    if padding == "none":
        return sum(math.prod(s) for u in units for s in u)
    if padding == "flat":
        return sum(padded_size(sum(math.prod(s) for s in u), n) for u in units)
    return sum(dim0_layout(s, n).padded_numel for u in units for s in u)


# -- the per-step analytic cost --------------------------------------------------------------------
@dataclass(frozen=True)
class OpCost:
    """One kind of collective in a training step, per rank."""

    op: str             #: canonical op name (see :data:`course_lib.comm.ledger.OPS`)
    phase: str          #: ``"forward"``, ``"backward"`` or ``"optimizer"``
    group_size: int     #: ranks in the group it runs over
    count: int          #: calls per step (one per unit; DP's bucketing is not modelled)
    payload_bytes: float  #: ``V`` summed over the calls
    wire_bytes: float   #: ring wire bytes summed over the calls


@dataclass(frozen=True)
class StepCost:
    """Analytic communication of one training step on one rank."""

    strategy: str
    n: int
    psi: int            #: real parameter elements ``Ψ``
    psi_padded: int     #: elements as gathered (``Ψ`` padded to the sharding factor)
    ops: tuple[OpCost, ...]

    @property
    def payload_bytes(self) -> float:
        return sum(o.payload_bytes for o in self.ops)

    @property
    def wire_bytes(self) -> float:
        return sum(o.wire_bytes for o in self.ops)

    def by_op(self) -> dict[str, float]:
        """Wire bytes per op name (a ledger's ``counts()`` has the same keys)."""
        out: dict[str, float] = {}
        for o in self.ops:
            out[o.op] = out.get(o.op, 0.0) + o.wire_bytes
        return out


def _op(op, phase, group, count, payload) -> OpCost:
    return OpCost(op, phase, group, count, payload, wire_bytes(op, payload, group))


def step_cost(strategy: str, units, n: int, *, param_bytes: int = 4, reduce_bytes: int = 4,
              padding: str = "flat", reshard_after_forward: bool = True, replicate: int = 1,
              root_unit: int | None = None, regather=None) -> StepCost:
    """Bytes one rank communicates in one training step, from the model description.

    ``units``: per-unit lists of parameter shapes (``[[(64, 32), (32,)], [(32, 10)]]``), or one list of
    shapes for a single unit. ``param_bytes``: element size of the gathered parameters (the FSDP2
    ``param_dtype``); ``reduce_bytes``: of the reduced gradients (``reduce_dtype``).
    ``Ψpad = padded_numel(units, F, padding)`` with ``F`` the sharding factor (``n``, or ``n/replicate``).

    * ``"dp"`` -- all-reduce every gradient, no padding: ``2(N-1)/N · Ψ · b`` (DDP; Li et al. 2020).
    * ``"zero1"``, ``"zero2"`` -- reduce-scatter gradients, each rank updates its optimizer shard,
      all-gather parameters: ``2(N-1)/N · Ψpad · b``, the same as DP (ZeRO paper, Rajbhandari et al.
      2020, sec. 7, "communication analysis of ZeRO-DP").
    * ``"zero3"``/``"fsdp"`` -- all-gather in forward, all-gather again in backward, reduce-scatter
      gradients: ``3(N-1)/N · Ψpad · b``, 1.5x DP (ZeRO sec. 7; FSDP paper, Zhao et al., VLDB 2023,
      "full sharding"). ``reshard_after_forward=False`` keeps parameters unsharded until backward:
      ``2(N-1)/N`` (FSDP's SHARD_GRAD_OP, i.e. ZeRO-2-like traffic). ``root_unit=i``: unit ``i`` is not resharded
      after forward even so -- FSDP2 does this to the root when ``reshard_after_forward`` is left at its
      default, since its parameters would be all-gathered again at once. ``regather``: per unit, whether
      the backward gathers it again at all (None: every unit). A from-scratch FSDP re-gathers a unit only
      when autograd saved one of its parameters; ``FlatFSDP.regathers()`` records which did.
    * ``"hsdp"`` -- ``replicate`` (R) x shard (F = N/R) mesh: all-gathers and reduce-scatter over F on
      ``Ψ`` padded to F, then an all-reduce over R of the gradient shard ``Ψpad/F`` (FSDP paper,
      "hybrid sharding", sharding factor F).
    """
    f = strategies.sharding_factor(strategy, n, replicate)
    if param_bytes <= 0 or reduce_bytes <= 0:
        raise ValueError(f"param_bytes={param_bytes} and reduce_bytes={reduce_bytes} must be > 0 "
                         "(4 for float32, 2 for bfloat16)")
    if padding not in PADDINGS:
        raise ValueError(f"padding={padding!r} must be one of {PADDINGS}")
    units = _as_units(units)
    if root_unit is not None and not (isinstance(root_unit, int) and 0 <= root_unit < len(units)):
        raise ValueError(f"root_unit={root_unit!r} must index units (0..{len(units) - 1}) or be None")
    k = len(units)
    psi = padded_numel(units, n, "none")
    pad = padded_numel(units, f, padding)
    if strategy == "dp":
        ops = (_op("all_reduce", "backward", n, k, psi * reduce_bytes),)
        return StepCost(strategy, n, psi, psi, ops)
    if strategy in ("zero1", "zero2"):
        ops = (_op("reduce_scatter", "backward", n, k, pad * reduce_bytes),
               _op("all_gather", "optimizer", n, k, pad * param_bytes))
        return StepCost(strategy, n, psi, pad, ops)
    # zero3 / fsdp / hsdp: which units must be gathered again in backward
    if regather is not None and len(regather) != k:
        raise ValueError(f"regather has {len(regather)} flags for {k} units: give one True/False per unit")
    regather = [i for i in range(k) if reshard_after_forward and i != root_unit
                and (regather is None or regather[i])]
    regather_elems = sum(padded_numel([units[i]], f, padding) for i in regather)
    ops = [_op("all_gather", "forward", f, k, pad * param_bytes)]
    if regather:
        ops.append(_op("all_gather", "backward", f, len(regather), regather_elems * param_bytes))
    ops.append(_op("reduce_scatter", "backward", f, k, pad * reduce_bytes))
    if strategy == "hsdp" and replicate > 1:
        ops.append(_op("all_reduce", "backward", replicate, k, pad / f * reduce_bytes))
    return StepCost(strategy, n, psi, pad, tuple(ops))


# -- the alpha-beta model --------------------------------------------------------------------------
@dataclass(frozen=True)
class AlphaBeta:
    """``t = alpha + beta * wire_bytes``: a per-call latency and a per-byte time (1 / bandwidth).

    ``alpha`` lumps the ring's ``N-1`` (or ``2(N-1)``) latency steps into one per-call constant, so a
    fit holds for the op kind and ``N`` it was measured at; fit again for another.
    """

    alpha_s: float          #: seconds per call
    beta_s_per_byte: float  #: seconds per wire byte

    def predict(self, op: str, nbytes: float, n: int) -> float:
        """Seconds for one ``op`` of payload ``nbytes`` over ``n`` ranks."""
        return self.alpha_s + self.beta_s_per_byte * wire_bytes(op, nbytes, n)

    def step_seconds(self, cost: StepCost) -> float:
        """Communication seconds of one step if nothing overlaps: ``Σ count·α + β·wire``."""
        return sum(o.count * self.alpha_s + self.beta_s_per_byte * o.wire_bytes for o in cost.ops)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1.0 / self.beta_s_per_byte


def fit_alpha_beta(sizes_bytes, seconds) -> AlphaBeta:
    """Least squares of ``seconds ≈ α + β · sizes_bytes`` in *relative* error, with ``α, β >= 0``.

    ``sizes_bytes`` are *wire* bytes per measurement (convert payloads with :func:`wire_bytes`).
    Each point is weighted by ``1/t²`` so a 4 KiB point (milliseconds) counts as much as a 4 MiB
    one: an unweighted fit lets the largest sizes dominate and can put α above the measured time
    of the smallest message. A negative ``α`` (noise at small sizes) refits through the origin, a
    negative ``β`` (timings dominated by noise) keeps the weighted mean time as ``α`` -- the exact
    non-negative least-squares answer for two unknowns.
    """
    x, t = [float(v) for v in sizes_bytes], [float(v) for v in seconds]
    if len(x) != len(t):
        raise ValueError(f"sizes_bytes has {len(x)} values but seconds has {len(t)}; pass one time per size")
    if len(set(x)) < 2:
        raise ValueError(f"need at least 2 distinct sizes to separate alpha from beta, got {sorted(set(x))}")
    if min(x) < 0 or min(t) < 0:
        raise ValueError("sizes_bytes and seconds must be >= 0")
    w = [1.0 / max(ti, 1e-12) ** 2 for ti in t]        # relative error: weight 1/t^2
    sw = sum(w)
    mx = sum(wi * xi for wi, xi in zip(w, x)) / sw
    mt = sum(wi * ti for wi, ti in zip(w, t)) / sw
    sxx = sum(wi * (xi - mx) ** 2 for wi, xi in zip(w, x))
    beta = sum(wi * (xi - mx) * (ti - mt) for wi, xi, ti in zip(w, x, t)) / sxx
    alpha = mt - beta * mx
    if beta < 0:
        return AlphaBeta(mt, 0.0)
    if alpha < 0:
        return AlphaBeta(0.0, sum(wi * xi * ti for wi, xi, ti in zip(w, x, t)) / sum(wi * xi * xi for wi, xi in zip(w, x)))
    return AlphaBeta(alpha, beta)
