"""The ledger: every collective a run issued, one record per op per rank.

Vocabulary (used the same way in torch code, JAX code, labs and prose):

* **payload** ``V`` -- the size in bytes of the *full* buffer a collective works on, per rank:
  all-reduce: the tensor; all-gather: the gathered *output*; reduce-scatter: the full *input*
  (before it is scattered); broadcast: the tensor; all-to-all: the input. This is the ``V`` of the
  ring formulas in :mod:`course_lib.maths.costs`, so ``costs.wire_bytes(record)`` needs nothing else.
* **group size** ``N`` -- how many ranks (or devices) took part.
* **wire bytes** -- what the algorithm sends per rank, e.g. ring all-gather ``(N-1)/N * V``. The ledger
  never computes it; :mod:`course_lib.maths.costs` does, from the record or from the model.

Records come from two sources: ``ledger_torch`` (captured at the c10d process-group level while ranks
run, so DDP's and FSDP2's internal collectives are seen) and ``ledger_jax`` (read from compiled HLO,
one program for all devices, so ``rank`` is ``-1``). This module imports neither torch nor JAX.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

#: Canonical op names. Sources map their own spelling onto these.
OPS = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
    "collective_permute", "reduce", "gather", "scatter", "send", "recv", "barrier",
)


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as one rank (or one compiled program) issued it."""

    op: str                 #: one of :data:`OPS`
    nbytes: int             #: payload ``V`` in bytes (see module docstring)
    dtype: str              #: element type, e.g. ``"float32"``, ``"bfloat16"``
    group_size: int         #: ``N``, ranks/devices in the group
    rank: int = -1          #: global rank that issued it; -1 for a compiled (SPMD) program
    group_ranks: tuple[int, ...] | None = None  #: global ranks of the group, when known
    axis: str | None = None     #: mesh axis name(s), e.g. ``"shard"`` or ``"replicate"``
    start: float | None = None  #: seconds since the ledger started (None where not measurable)
    end: float | None = None    #: seconds since the ledger started, when the op completed
    phase: str | None = None    #: ``"forward"`` / ``"backward"`` / ``"optimizer"`` / user label
    step: int | None = None     #: training step index, when the run marks steps
    source: str = "torch"       #: ``"torch"`` or ``"jax-hlo"``
    name: str | None = None     #: the source's own name (c10d method, HLO instruction)

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r} is not a known collective; expected one of {OPS}")
        if self.nbytes < 0 or self.group_size < 1:
            raise ValueError(f"nbytes={self.nbytes} and group_size={self.group_size} must be >= 0 and >= 1")

    @property
    def duration(self) -> float | None:
        if self.start is None or self.end is None:
            return None
        return self.end - self.start

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Ledger:
    """An ordered list of :class:`CollectiveRecord` with a few ways to slice and sum it.

    Plain Python data: it pickles, so ranks send theirs back to the notebook and ``Ledger.merge``
    puts them together.
    """

    def __init__(self, records: Iterable[CollectiveRecord] = ()):
        self.records: list[CollectiveRecord] = list(records)

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def merge(cls, ledgers: Iterable["Ledger"]) -> "Ledger":
        out = cls()
        for ledger in ledgers:
            out.records.extend(ledger.records)
        return out

    @classmethod
    def from_dicts(cls, rows: Iterable[dict]) -> "Ledger":
        return cls(CollectiveRecord(**{**r, "group_ranks": tuple(r["group_ranks"]) if r.get("group_ranks") is not None else None}) for r in rows)

    def to_dicts(self) -> list[dict]:
        return [r.to_dict() for r in self.records]

    # -- container protocol --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[CollectiveRecord]:
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __repr__(self) -> str:
        counts = ", ".join(f"{op}×{n}" for op, n in self.counts().items())
        return f"Ledger({len(self)} records: {counts or 'empty'})"

    # -- slicing and sums ---------------------------------------------------------------------
    def filter(self, *, op=None, rank=None, phase=None, step=None, axis=None, exclude_ops=("barrier",)) -> "Ledger":
        """Records matching every given field (a field left None matches anything).

        Barriers are excluded by default: they move no payload and are bookkeeping, not training.
        """
        def ok(value, want):
            if want is None:
                return True
            if isinstance(want, (tuple, list, set, frozenset)):
                return value in want
            return value == want
        return Ledger(
            r for r in self.records
            if ok(r.op, op) and ok(r.rank, rank) and ok(r.phase, phase) and ok(r.step, step)
            and ok(r.axis, axis) and r.op not in (exclude_ops or ())
        )

    def ranks(self) -> list[int]:
        return sorted({r.rank for r in self.records})

    def counts(self) -> Counter:
        return Counter(r.op for r in self.records)

    def total_bytes(self) -> int:
        """Sum of payloads ``V`` (not wire bytes: see ``costs.wire_bytes``)."""
        return sum(r.nbytes for r in self.records)

    def table(self) -> str:
        """A plain-text summary: op, count, total payload, per rank."""
        rows = Counter()
        n = Counter()
        for r in self.records:
            rows[(r.rank, r.op, r.dtype, r.group_size)] += r.nbytes
            n[(r.rank, r.op, r.dtype, r.group_size)] += 1
        lines = [f"{'rank':>4}  {'op':<18}{'dtype':<10}{'N':>3}{'count':>7}{'payload bytes':>16}"]
        for key in sorted(rows):
            rank, op, dtype, size = key
            lines.append(f"{rank:>4}  {op:<18}{dtype:<10}{size:>3}{n[key]:>7}{rows[key]:>16,}")
        return "\n".join(lines)
