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
    """Some ranks did not return in time (typically: one rank skipped a collective the others wait in)."""


class RunResult(list):
    """Per-rank return values (``result[r]``), plus the ledger and wall time of the call."""

    ledger: Ledger
    seconds: float
    backend: str
    #: wall-clock milestones of the rank processes' start when this call started them, else None
    startup: dict | None = None
