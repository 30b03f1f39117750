"""What a call of :func:`course_lib.run` gives back: per-rank results, or an error that names the ranks."""
from __future__ import annotations

from course_lib.comm.ledger import Ledger

__all__ = ["RankError", "LaunchTimeout", "RunResult"]


class RankError(RuntimeError):
    """A rank raised (or died). ``rank``, ``exc_type`` and ``traceback_text`` say which and why."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback_text: str, others: dict | None = None):
        self.rank, self.exc_type, self.traceback_text = rank, exc_type, traceback_text
        self.others = others or {}
        text = message if exc_type in ("LaunchTimeout", "RankDied") else f"rank {rank} raised {exc_type}: {message}"
        if self.others:
            text += "\nalso failed: " + ", ".join(f"rank {r} ({t})" for r, t in sorted(self.others.items()))
        if traceback_text:
            text += f"\n\n--- traceback on rank {rank} ---\n{traceback_text}"
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
                 frames: dict | None = None, finished=()):
        from course_lib.launch import stacks as _stacks
        self.frames = dict(sorted((frames or {}).items()))
        self.stacks = {r: _stacks.format_stack(f) for r, f in self.frames.items()}
        self.waiting_on = {r: _stacks.waiting_on(f, r in finished) for r, f in self.frames.items()}
        if self.waiting_on:
            message += "\n\n" + self.report()
        super().__init__(rank, exc_type, message, traceback_text, others)

    def report(self) -> str:
        """Which line each rank was waiting on when the call timed out (full stacks in ``err.stacks``)."""
        if not self.waiting_on:
            return "no stacks were captured"
        lines = ["where each rank was when the call timed out (full stacks: err.stacks[rank]):"]
        lines += [f"  rank {r}: {w}" for r, w in self.waiting_on.items()]
        return "\n".join(lines)


class RunResult(list):
    """Per-rank return values (``result[r]``), plus the ledger and wall time of the call."""

    ledger: Ledger
    seconds: float
    backend: str
    #: wall-clock milestones of the rank processes' start when this call started them, else None
    startup: dict | None = None
