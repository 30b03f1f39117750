"""Pipeline schedules as data: each stage's op order, a simulated timeline, the bubble and the activations held.

An op is ``("F", i)`` or ``("B", i)``: the forward or backward of micro-batch ``i`` on one stage. A schedule gives
every stage its ops in order; :func:`simulate` starts each op as soon as its stage is free and its input exists
(``F`` of stage s needs ``F`` of stage s-1; ``B`` of stage s needs ``B`` of stage s+1, the last stage's ``B`` its own
``F``), in schedule units (a forward takes ``f`` units, a backward ``b``). Pure Python: no process group.

* GPipe: all m forwards, then the m backwards -- every stage holds the
  activations of all m micro-batches at its peak.
* 1F1B (PipeDream-Flush, Megatron-LM): ``p - s - 1`` warm-up forwards, then one forward and one backward in
  turn, then the remaining backwards -- stage s holds at most ``p - s`` micro-batches.

Both take ``(m + p - 1)(f + b)`` units, of which each stage is busy ``m(f + b)``: idle ``(p-1)/(m+p-1)`` of the step,
the bubble. 1F1B buys memory, not time; interleaving (v model chunks per rank) shrinks the bubble v-fold.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Op", "gpipe_order", "one_f_one_b_order", "orders", "Slot", "simulate", "bubble_fraction",
           "idle_units", "peak_activations", "SCHEDULES"]

Op = tuple  # ("F" | "B", micro-batch)
SCHEDULES = ("gpipe", "1f1b")


def _check(stage: int, p: int, m: int) -> None:
    if not (isinstance(p, int) and isinstance(m, int) and p >= 1 and m >= 1):
        raise ValueError(f"stages p={p!r} and micro-batches m={m!r} must be integers >= 1")
    if not (isinstance(stage, int) and 0 <= stage < p):
        raise ValueError(f"stage={stage!r} must be an integer in 0..{p - 1} (p={p} stages)")


def gpipe_order(stage: int, p: int, m: int) -> list[Op]:
    """GPipe: every forward, then every backward, in micro-batch order (as torch's ``ScheduleGPipe``)."""
    _check(stage, p, m)
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b_order(stage: int, p: int, m: int) -> list[Op]:
    """1F1B: ``w = min(p - stage - 1, m)`` warm-up forwards, then (F, B) pairs, then the last ``w`` backwards.
    The same order as torch's ``Schedule1F1B`` (``torch.distributed.pipelining``), which refuses m < p where this
    one caps the warm-up at m."""
    _check(stage, p, m)
    w = min(p - stage - 1, m)
    ops: list[Op] = [("F", i) for i in range(w)]
    for i in range(m - w):
        ops += [("F", w + i), ("B", i)]
    return ops + [("B", i) for i in range(m - w, m)]


def orders(kind: str, p: int, m: int) -> list[list[Op]]:
    """Every stage's op order for schedule ``kind`` (one of :data:`SCHEDULES`)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule {kind!r}: use one of {SCHEDULES}")
    fn = gpipe_order if kind == "gpipe" else one_f_one_b_order
    return [fn(s, p, m) for s in range(p)]


@dataclass(frozen=True)
class Slot:
    """One op on the timeline: stage, "F"/"B", micro-batch, start and end (schedule units or seconds)."""
    stage: int
    kind: str
    mb: int
    start: float
    end: float


def simulate(stage_orders: list[list[Op]], f: int = 1, b: int = 2) -> list[Slot]:
    """Run the stages' orders on an ideal machine (no communication time): each op starts when its stage is free
    and its input is ready. Raises ``ValueError`` naming the stuck ops when the orders deadlock or are incomplete."""
    p = len(stage_orders)
    done: dict[tuple[int, str, int], float] = {}
    pos, free = [0] * p, [0] * p
    slots: list[Slot] = []
    while any(pos[s] < len(stage_orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] >= len(stage_orders[s]):
                continue
            kind, i = stage_orders[s][pos[s]]
            if kind == "F":
                need = [(s - 1, "F", i)] if s > 0 else []
            elif kind == "B":
                need = [(s + 1, "B", i)] if s < p - 1 else [(s, "F", i)]
            else:
                raise ValueError(f"stage {s}: op {(kind, i)!r} is neither ('F', i) nor ('B', i)")
            if all(n in done for n in need):
                start = max([free[s]] + [done[n] for n in need])
                end = start + (f if kind == "F" else b)
                done[(s, kind, i)] = free[s] = end
                slots.append(Slot(s, kind, i, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: stage_orders[s][pos[s]] for s in range(p) if pos[s] < len(stage_orders[s])}
            raise ValueError(f"the schedule deadlocks: each stage waits on an op no stage will run: {stuck}")
    return slots


def idle_units(slots: list[Slot], p: int) -> tuple[list[float], float]:
    """(idle units per stage, step length): a stage is idle whenever it runs nothing between 0 and the step's end."""
    span = max(sl.end for sl in slots)
    busy = [sum(sl.end - sl.start for sl in slots if sl.stage == s) for s in range(p)]
    return [span - b for b in busy], span


def bubble_fraction(p: int, m: int) -> float:
    """The fraction of a step each stage is idle in GPipe or 1F1B: ``(p - 1) / (m + p - 1)``."""
    _check(0, p, m)
    return (p - 1) / (m + p - 1)


def peak_activations(order: list[Op]) -> int:
    """The most micro-batches whose forward ran and whose backward has not: the activations a stage holds."""
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak
