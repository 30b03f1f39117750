"""Exercise checks: one line of specific, friendly feedback per exercise.

Three outcomes, each one line (plus details for a wrong answer)::

    ✅ <name>: <short detail>                      right answer       check() returns True
    ⏳ <name>: not implemented yet — <what to do>  stub still raises  check() returns False, no raise
    ❌ <name>: <which rank, which element, expected vs got, likely mistake>   raises CheckFailed

"Not implemented yet" keeps a lab, as learners receive it, running top to bottom: the stub's
``NotImplementedError`` (raised directly, or on a rank and reported by the launcher as a
``RankError`` whose ``exc_type == "NotImplementedError"``) is caught by :class:`check`. RankError is
duck-typed (``exc_type``, ``rank``, ``traceback_text``), so this module needs nothing from launch.

Vocabulary: *got* is the learner's value, *expected* (or *reference*) the single-device answer.
Comparing them (tolerances, detectors of likely mistakes) is :mod:`course_lib.checks.compare`.
"""
from __future__ import annotations

import re
from typing import Any, Callable

__all__ = ["CheckFailed", "check", "current", "not_implemented_todo", "Detector"]

DEFAULT_TODO = ("fill in the code marked `# YOUR CODE HERE` above, run that cell, then re-run this one")
_STUB_PREFIX = "Exercise not done yet:"
Detector = Callable[[Any, Any], "str | None"]   #: (got, expected) numpy arrays -> likely mistake or None
_ACTIVE: list["check"] = []          # checks whose block is running (innermost last)


class CheckFailed(AssertionError):
    """A wrong answer. The message is the feedback, starting with ``❌ <name>:``."""


# ------------------------------------------------------------------------------- not implemented
def _rank_message(exc) -> str:
    """The exception message a RankError carries, from its traceback text (or its own text)."""
    name = str(getattr(exc, "exc_type", ""))
    text = getattr(exc, "traceback_text", "") or ""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(rf"(?:[\w.]+\.)?{re.escape(name)}:\s?(.*)", lines[i])
        if m:
            return "\n".join([m.group(1)] + lines[i + 1:]).strip()
    m = re.search(rf"raised {re.escape(name)}: (.*)", str(exc))
    return m.group(1).strip() if m else ""


def not_implemented_todo(exc: BaseException) -> str | None:
    """What to do, if ``exc`` means "the exercise is still a stub"; None for any other error."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        rank_type = getattr(e, "exc_type", None)
        rank_type = getattr(rank_type, "__name__", rank_type)
        if isinstance(e, NotImplementedError) or rank_type == "NotImplementedError":
            msg = _rank_message(e) if rank_type else str(e).strip()
            where = f" (on rank {e.rank})" if getattr(e, "rank", None) is not None and rank_type else ""
            if msg.startswith(_STUB_PREFIX):
                return msg[len(_STUB_PREFIX):].strip() + where
            return DEFAULT_TODO + where + (f" [NotImplementedError: {msg}]" if msg else "")
        # Explicit causes and grouped errors only: an error raised while *handling* a
        # NotImplementedError (its __context__) is a real error, not an unfinished exercise.
        todo += [e.__cause__, *getattr(e, "exceptions", ())]
    return None


class check:
    """Run one exercise check, as a context manager or as a decorator that runs the function now.

    >>> with check("all-reduce by hand") as c:        # doctest: +SKIP
    ...     got = launch.run(my_all_reduce, world_size=4)
    ...     assert_close("sum on every rank", got, [expected] * 4, rtol=0, atol=0)
    >>> c.passed                                       # True, False (not implemented yet)

    >>> @check("ring cost", todo="write ring_bytes() above")   # doctest: +SKIP
    ... def _():
    ...     assert ring_bytes(4, 1024) == 768
    ...     return "768 bytes per rank"               # a returned string is the ✅ detail
    """

    def __init__(self, name: str, todo: str | None = None):
        self.name, self.todo = name, todo
        self.passed: bool | None = None
        self.detail: str | None = None

    def ok(self, detail: str) -> None:
        """Set the ✅ line's detail (default: the last assert_close summary)."""
        self.detail = detail

    def __enter__(self) -> "check":
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _ACTIVE.remove(self)
        if exc is None:
            self.passed = True
            print(f"✅ {self.name}: {self.detail or 'matches the reference'}")
            return False
        todo = not_implemented_todo(exc)
        if todo is not None:
            self.passed = False
            print(f"⏳ {self.name}: not implemented yet — {self.todo or todo}")
            return True                                   # swallowed: the lab keeps running
        self.passed = False
        rank_type = getattr(exc, "exc_type", None)
        if isinstance(exc, AssertionError):
            raise CheckFailed(self._feedback(str(exc))) from None
        if rank_type in ("AssertionError", "CheckFailed"):
            inner = _rank_message(exc).removeprefix("❌ ")
            raise CheckFailed(self._feedback(f"on rank {exc.rank}: {inner}")) from None
        return False                                      # a real error: its traceback helps most

    def _feedback(self, msg: str) -> str:
        msg = msg.strip() or "assertion failed"
        if msg.startswith(f"❌ {self.name}:"):
            return msg
        return f"❌ {self.name}: {msg.removeprefix('❌ ')}"

    def __call__(self, fn: Callable[[], Any]) -> bool:
        with self:
            result = fn()
            if isinstance(result, str):
                self.ok(result)
        return bool(self.passed)


def current() -> "check | None":
    """The innermost :class:`check` whose block is running, or None (assert_close reports to it)."""
    return _ACTIVE[-1] if _ACTIVE else None
