"""What a call of :func:`course_lib.run` gives back: per-rank results, or an error that names the ranks (and how the
ranks are named in any text: :func:`ranks_text`, :func:`describe_deaths`)."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from course_lib.comm.ledger import Ledger

__all__ = ["RankError", "LaunchTimeout", "RunResult", "Spelling", "RUN_SPELLING", "MAGIC_SPELLING"]


@dataclass(frozen=True)
class Spelling:
    """How a message names what happened and what to do, in the words of the caller: ``run()``'s keyword
    arguments, or a ``%%ranks`` cell's options."""
    died: str      #: after "rank 2 was killed by SIGKILL during the call; "
    ended: str     #: after a hang: what became of the ranks
    longer: str    #: how to allow a longer call
    wait: str      #: how to allow a longer wait in a collective
    stacks: str    #: where the full stacks of a hang are


RUN_SPELLING = Spelling(died="the pool was shut down, the next call starts afresh",
                        ended="The pool was shut down; the next call starts afresh",
                        longer="pass timeout=... to allow longer runs", wait="pass timeout=... to allow longer runs",
                        stacks="err.stacks[rank]")
MAGIC_SPELLING = Spelling(died="the ranks were restarted: the variables of earlier %%ranks cells are gone",
                          ended="The ranks were restarted: the variables of earlier %%ranks cells are gone",
                          longer="%%ranks --timeout SECONDS allows a longer cell",
                          wait="if a rank was computing, not stuck: %%ranks --wait SECONDS allows a longer wait",
                          stacks="sys.last_value.stacks[rank]")


class RankError(RuntimeError):
    """A rank raised (or died). ``rank``, ``exc_type`` and ``traceback_text`` say which and why.

    ``str(err)`` shows the rank's own frames only (from the function it ran, or the ``%%ranks`` cell's lines, on);
    ``traceback_text`` keeps the rank's whole traceback, the launcher's frames included."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback_text: str, others: dict | None = None,
                 own_traceback: str | None = None):
        self.rank, self.exc_type, self.traceback_text = rank, exc_type, traceback_text
        self.others = others or {}
        text = message if exc_type in ("LaunchTimeout", "RankDied") else f"rank {rank} raised {exc_type}: {message}"
        if self.others:
            text += "\nalso failed: " + ", ".join(f"rank {r} ({t})" for r, t in sorted(self.others.items()))
        shown = own_traceback or traceback_text
        if shown:
            text += f"\n\n--- traceback on rank {rank} ---\n{shown.rstrip()}"
        super().__init__(text)


class LaunchTimeout(RankError, TimeoutError):
    """Some ranks did not return in time (typically: one rank skipped a collective the others wait in).

    When the call itself hung (not the ranks' start), every live rank's Python stack was captured at the moment of
    the timeout, before the ranks were killed (:mod:`course_lib.launch.stacks`):

    * ``stacks: dict[int, str]`` -- rank -> its main thread's stack, formatted like a traceback (outermost first);
    * ``frames: dict[int, list[Frame]]`` -- the same as data (``file``, ``line``, ``name``, ``code``);
    * ``waiting_on: dict[int, str]`` -- rank -> one line: the innermost line of the learner's code it waits in,
      e.g. ``Cell In[4]:6 in step: dist.all_reduce(t)``, or ``finished the call (idle)``.

    ``str(err)`` ends with the per-rank picture (:meth:`report`). All three are empty when nothing was captured.
    """

    def __init__(self, rank: int, exc_type: str, message: str, traceback_text: str = "", others: dict | None = None,
                 frames: dict | None = None, finished=(), stacks_hint: str = RUN_SPELLING.stacks):
        from course_lib.launch import stacks as _stacks
        self.frames = dict(sorted((frames or {}).items()))
        self.stacks = {r: _stacks.format_stack(f) for r, f in self.frames.items()}
        self.waiting_on = {r: _stacks.waiting_on(f, r in finished) for r, f in self.frames.items()}
        self.stacks_hint = stacks_hint
        if self.waiting_on:
            message += "\n\n" + self.report()
        super().__init__(rank, exc_type, message, traceback_text, others)

    def report(self) -> str:
        """Which line each rank was waiting on when the call timed out (full stacks in ``err.stacks``)."""
        if not self.waiting_on:
            return "no stacks were captured"
        lines = [f"where each rank was when the call timed out (full stacks: {self.stacks_hint}):"]
        lines += [f"  rank {r}: {w}" for r, w in self.waiting_on.items()]
        return "\n".join(lines)


class RunResult(list):
    """Per-rank return values (``result[r]``), plus the ledger and wall time of the call."""

    ledger: Ledger
    seconds: float
    backend: str
    #: wall-clock milestones of the rank processes' start when this call started them, else None
    startup: dict | None = None


def ranks_text(ranks, bare: bool = False) -> str:
    """``[0..999] minus 7`` -> "ranks 0–6, 8–999": never more than a handful of numbers."""
    ranks = sorted(set(ranks))
    if not ranks:
        return ""
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append((start, a))
            start = b
    parts = [f"{a}" if a == b else (f"{a},{b}" if b == a + 1 else f"{a}–{b}") for a, b in runs]
    if len(parts) > 4:
        parts = parts[:3] + [f"… ({len(ranks)} ranks in all)"]
    body = ",".join(parts)
    if bare:
        return body
    return f"rank {body}" if len(ranks) == 1 else f"ranks {body}"


def describe_deaths(dead: dict) -> str:
    by_code: dict = {}
    for r, c in dead.items():
        by_code.setdefault(c, []).append(r)
    return "; ".join(f"{ranks_text(rs)} {describe_exit(c)}" for c, rs in sorted(by_code.items(), key=lambda x: min(x[1])))


def describe_exit(code) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
