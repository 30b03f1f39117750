"""A ledger as the traffic widget shows it: rows to draw, totals per step and phase, bytes per mesh axis or
group, and measured against analytic wire bytes. Plain Python (tested without a browser).

Bytes: **payload** ``V`` is the ledger's (see :mod:`course_lib.comm.ledger`); **wire** bytes are
``costs.wire_bytes`` of it (ring formulas, what one rank sends). Measured-vs-analytic is per rank per
step, as :func:`course_lib.maths.costs.step_cost` counts.
"""
from __future__ import annotations

from collections import defaultdict

from course_lib.maths.costs import StepCost, ratio, record_wire_bytes
from course_lib.comm.ledger import Ledger

__all__ = ["as_ledger", "group_label", "clock_offsets", "traffic_rows", "traffic_totals", "traffic_by_group", "traffic_compare"]


def as_ledger(ledger) -> Ledger:
    """A ``Ledger`` from a ``Ledger``, a ``RunResult`` (its ``.ledger``), records, or ``to_dicts()`` rows."""
    if isinstance(ledger, Ledger):
        return ledger
    if hasattr(ledger, "ledger"):        # a RunResult
        return ledger.ledger
    return Ledger.from_dicts(ledger) if ledger and isinstance(next(iter(ledger)), dict) else Ledger(ledger)


def group_label(rec, world: int | None = None) -> str:
    """The mesh axis of a collective, else its group: ``"shard"``, ``"world"``, ``"ranks 0,2"``."""
    if rec.axis:
        return rec.axis
    if rec.group_ranks is None or (world is not None and rec.group_size == world):
        return "world" if rec.rank >= 0 or rec.group_ranks is None else f"groups of {rec.group_size}"
    return "ranks " + ",".join(map(str, rec.group_ranks))


def clock_offsets(ledger) -> dict[int, float]:
    """Seconds to subtract from each rank's times so that the ranks' clocks line up.

    Every rank's recorder starts its clock at its own reset, a few ms apart. A collective *ends* at about
    the same moment on every rank of its group (no one finishes before the last one has sent), so the
    offset of rank ``r`` is the median, over the ops rank ``r`` and the lowest rank issued in the same
    position of their sequences, of the difference of their end times. 0 where nothing matches.
    """
    led = as_ledger(ledger).filter()
    seqs: dict = defaultdict(list)
    for r in led:
        if r.rank >= 0:
            seqs[r.rank].append(r)
    if not seqs:
        return {}
    ref = seqs[min(seqs)]
    out = {}
    for rank, seq in seqs.items():
        diffs = sorted(a.end - b.end for a, b in zip(seq, ref)
                       if a.op == b.op and a.end is not None and b.end is not None)
        out[rank] = diffs[len(diffs) // 2] if diffs else 0.0
    return out


def traffic_rows(ledger, *, step=None, rank=None, align: bool = True) -> list[dict]:
    """One dict per collective (barriers left out), in ledger order: what the timeline and tables show.

    Keys: ``i`` (the record's index in the ledger, barriers left out), ``rank``, ``op``, ``phase``,
    ``step``, ``group`` (:func:`group_label`), ``group_size``, ``payload``, ``wire``, ``dtype``,
    ``start``/``end`` (seconds as recorded, None when unknown), ``x0``/``x1`` (where the box is drawn:
    times shifted by :func:`clock_offsets` when ``align``, or program order for a JAX ledger).
    """
    full = as_ledger(ledger).filter()
    world = len([r for r in full.ranks() if r >= 0]) or None
    shift = clock_offsets(full) if align else {}
    rows, order = [], defaultdict(int)
    for i, r in enumerate(full):
        if r.start is None:
            x0 = float(order[r.rank])
            x1 = x0 + 0.8
            order[r.rank] += 1
        else:
            d = shift.get(r.rank, 0.0)
            x0, x1 = r.start - d, (r.end - d if r.end is not None and r.end > r.start else None)
        if (step is None or r.step == step) and (rank is None or r.rank == rank):
            rows.append(dict(i=i, rank=r.rank, op=r.op, phase=r.phase, step=r.step, group=group_label(r, world), axis=r.axis,
                             group_size=r.group_size, payload=r.nbytes, wire=record_wire_bytes(r), dtype=r.dtype,
                             start=r.start, end=r.end, x0=x0, x1=x1, name=r.name))
    # a torch op whose completion time was not recorded: draw it up to the next op on its rank (at most 1 ms)
    for rk in {r["rank"] for r in rows}:
        mine = sorted((r for r in rows if r["rank"] == rk), key=lambda r: r["x0"])
        for a, b in zip(mine, mine[1:] + [None]):
            if a["x1"] is None:
                a["x1"] = min(b["x0"], a["x0"] + 1e-3) if b else a["x0"] + 1e-4
    return rows


def traffic_totals(ledger, *, rank=None) -> dict:
    """``{(step, phase): {"count", "payload", "wire"}}`` summed over the records of ``rank`` (all if None)."""
    out: dict = {}
    for r in traffic_rows(ledger, rank=rank):
        t = out.setdefault((r["step"], r["phase"]), {"count": 0, "payload": 0, "wire": 0.0})
        t["count"] += 1
        t["payload"] += r["payload"]
        t["wire"] += r["wire"]
    return out


def traffic_by_group(ledger, *, rank=None, step=None) -> dict:
    """``{group: {"count", "payload", "wire", "ops"}}``: which mesh axis or process group carried what."""
    out: dict = {}
    for r in traffic_rows(ledger, rank=rank, step=step):
        t = out.setdefault(r["group"], {"count": 0, "payload": 0, "wire": 0.0, "ops": set()})
        t["count"] += 1
        t["payload"] += r["payload"]
        t["wire"] += r["wire"]
        t["ops"].add(r["op"])
    return out


def _analytic_table(analytic) -> dict:
    """Normalise the analytic cost to ``{(phase, op): wire bytes}`` (phase None: any phase)."""
    if analytic is None:
        return {}
    if isinstance(analytic, StepCost):
        out: dict = {}
        for o in analytic.ops:
            out[(o.phase, o.op)] = out.get((o.phase, o.op), 0.0) + o.wire_bytes
        return out
    if isinstance(analytic, dict):
        return {(k if isinstance(k, tuple) else (None, k)): float(v) for k, v in analytic.items()}
    raise TypeError(f"analytic must be a costs.StepCost or a dict op -> wire bytes, got {type(analytic).__name__}")


def traffic_compare(ledger, analytic=None, *, rank=None, step=None) -> list[dict]:
    """Measured wire bytes per rank per step against the analytic ones, one row per op (or phase, op).

    Measured: the records of ``rank`` (default: the lowest rank; a JAX ledger's single program) in
    ``step`` (default: all steps, divided by their number). Rows: ``phase``, ``op``, ``count``,
    ``payload``, ``measured`` (wire), ``analytic`` (None if not given), ``ratio``.
    """
    led = as_ledger(ledger)
    ranks = led.ranks()
    rank = rank if rank is not None else (min(ranks) if ranks else -1)
    rows = traffic_rows(led, rank=rank, step=step)
    steps = {r["step"] for r in rows if r["step"] is not None}
    k = 1 if step is not None else max(1, len(steps))
    ana = _analytic_table(analytic)
    by_phase = bool(ana) and all(p is not None for p, _ in ana) and any(r["phase"] for r in rows)
    meas: dict = {}
    for r in rows:
        key = (r["phase"] if by_phase else None, r["op"])
        m = meas.setdefault(key, {"count": 0, "payload": 0.0, "wire": 0.0})
        m["count"] += 1
        m["payload"] += r["payload"]
        m["wire"] += r["wire"]
    if by_phase:  # an unlabelled op (FSDP2's forward gathers carry no phase) takes the one analytic phase it lacks
        for _, op in [key for key in meas if key[0] is None]:
            lacking = [p for p, o in ana if o == op and (p, op) not in meas]
            if len(lacking) == 1:
                meas[(lacking[0], op)] = meas.pop((None, op))
    if not by_phase:  # fold the analytic phases: compare per op only
        folded: dict = {}
        for (_, op), v in ana.items():
            folded[(None, op)] = folded.get((None, op), 0.0) + v
        ana = folded
    out = []
    for key in sorted(set(meas) | set(ana), key=lambda k: (str(k[0]), k[1])):
        m = meas.get(key, {"count": 0, "payload": 0.0, "wire": 0.0})
        a = ana.get(key) if ana else None
        out.append(dict(phase=key[0], op=key[1], count=m["count"] / k, payload=m["payload"] / k,
                        measured=m["wire"] / k, analytic=a, ratio=None if a is None else ratio(m["wire"] / k, a)))
    return out
