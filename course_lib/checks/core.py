"""Exercise checks: one line of specific, friendly feedback per exercise.

Three outcomes, each one line (plus details for a wrong answer)::

    ✅ <name>: <short detail>                      right answer       check() returns True
    ⏳ <name>: not implemented yet — <the idea>    stub still raises  check() returns False
    ❌ <name>: <which rank, which element, expected vs got, likely mistake>   check() returns False

A lab keeps running top to bottom whatever the learner wrote: a stub says ⏳, a wrong answer or a
crash in the learner's code says ❌ (naming the rank and the line; the traceback is folded away in
:func:`last_error`), and the check returns False so the lab falls back to the reference. Under the
test suite (:func:`strict`) a wrong answer raises :class:`CheckFailed` instead, so tests can assert
the diagnosis. Hints come on request, in layers (:func:`hint`): the ⏳ line states the idea and what
the check will test, never the code.

The stub's
``NotImplementedError`` (raised directly, or on a rank and reported by the launcher as a
``RankError`` whose ``exc_type == "NotImplementedError"``) is caught by :class:`check`. RankError is
duck-typed (``exc_type``, ``rank``, ``traceback_text``), so this module needs nothing from launch.

Vocabulary: *got* is the learner's value, *expected* (or *reference*) the single-device answer.
Comparing them (tolerances, detectors of likely mistakes) is :mod:`course_lib.checks.compare`.

Longer than ~300 lines: the three outcomes, the hints, the folded traceback and the observers all meet in
:class:`check`'s exit; split, each part would reach into the others' state.
"""
from __future__ import annotations

import os
import re
import traceback
from typing import Any, Callable, Sequence

from course_lib.runtime.errors import inner_errors

__all__ = ["CheckFailed", "check", "current", "not_implemented_todo", "Detector", "hint", "register_hints",
           "last_error", "keep_error", "likely_cause", "learner_line", "crash_text", "strict"]

DEFAULT_TODO = ("fill in the code marked `# YOUR CODE HERE` above, run that cell, then re-run this one")
_STUB_PREFIX = "Exercise not done yet:"
Detector = Callable[[Any, Any], "str | None"]   #: (got, expected) numpy arrays -> likely mistake or None
_ACTIVE: list["check"] = []          # checks whose block is running (innermost last)
#: Called as ``observer(check, state, text)`` after each outcome is printed (state: "solved", "wrong" or
#: "not attempted"; text: the printed line(s)). Empty in a lab; the grader's guard
#: (:mod:`course_lib.apps.grading.guard`) adds one in a graded kernel, so a verdict is recorded where it is decided.
OBSERVERS: list[Callable[["check", str, str], None]] = []
CRASH_PHRASE = "your code raised"    #: how every check's ❌ line for a crash in the learner's code begins


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
    # Explicit causes and grouped errors only: an error raised while *handling* a NotImplementedError (its
    # __context__) is a real error, not an unfinished exercise.
    for e in inner_errors(exc, context=False, failures=False):
        rank_type = getattr(e, "exc_type", None)
        rank_type = getattr(rank_type, "__name__", rank_type)
        if isinstance(e, NotImplementedError) or rank_type == "NotImplementedError":
            msg = _rank_message(e) if rank_type else str(e).strip()
            where = f" (on rank {e.rank})" if getattr(e, "rank", None) is not None and rank_type else ""
            if msg.startswith(_STUB_PREFIX):
                return msg[len(_STUB_PREFIX):].strip() + where
            return DEFAULT_TODO + where + (f" [NotImplementedError: {msg}]" if msg else "")
    return None


#: Hints by exercise name: ``[idea, more specific, near-code]``, most general first (see :func:`hint`).
_HINTS: dict[str, list[str]] = {}
#: The last wrong answer's full traceback, folded away from the ❌ line (see :func:`last_error`).
_LAST_ERROR: list[str] = [""]


def strict() -> bool:
    """True under the test suite (``COURSE_LIB_STRICT_CHECKS=1``): a wrong answer raises
    :class:`CheckFailed` and a crash propagates, so tests can assert them. In a lab (the default) a
    wrong answer prints ❌ and the check returns False, so the lab falls back to the reference."""
    return os.environ.get("COURSE_LIB_STRICT_CHECKS", "") not in ("", "0")


def register_hints(hints: dict[str, Sequence[str]]) -> None:
    """Make ``hint(name, level)`` know an exercise's hints, general to specific (a lab's check module
    calls this once). Each level says more; the last may show code, the first never does."""
    for name, levels in hints.items():
        if not levels or any(not isinstance(h, str) or not h.strip() for h in levels):
            raise ValueError(f"hints for {name!r} must be non-empty strings, most general first")
        _HINTS[name] = list(levels)


def hint(name: str, level: int = 1) -> None:
    """Show hint ``level`` for exercise ``name`` (1 is the idea, higher levels say more), once.

    The one way to ask for help, the same in every lab: ``checks.hint("name")``, then ``checks.hint("name", 2)``.
    It prints and returns None, so a notebook cell shows the text once (a returned string would be shown a
    second time as the cell's value).

    >>> register_hints({"demo": ["think of halves", "reduce-scatter, then all-gather"]})
    >>> hint("demo")
    💡 demo, hint 1 of 2: think of halves
       (more: checks.hint("demo", 2))
    """
    print(hint_text(name, level))


def hint_text(name: str, level: int = 1) -> str:
    """The text :func:`hint` shows (for code that words a hint itself, e.g. a grader's report)."""
    if name not in _HINTS:
        known = ", ".join(sorted(_HINTS)) or "none registered yet (import the lab's checks module)"
        raise ValueError(f"no hints for {name!r}; exercises with hints: {known}")
    levels = _HINTS[name]
    if not isinstance(level, int) or not 1 <= level <= len(levels):
        raise ValueError(f"level={level!r}: {name!r} has hints 1..{len(levels)}")
    text = f"💡 {name}, hint {level} of {len(levels)}: {levels[level - 1]}"
    if level < len(levels):
        text += f'\n   (more: checks.hint("{name}", {level + 1}))'
    return text


def keep_error(text: str) -> None:
    """Keep ``text`` (a traceback) behind the next ❌ line, for :func:`last_error` -- for a check that words a
    crash itself (e.g. unwrapping DCP's CheckpointException to the rank's own error)."""
    _LAST_ERROR[0] = text


def last_error() -> None:
    """Show the full traceback behind the last ❌ that came from an exception, once (prints, returns None,
    like :func:`hint`); :func:`last_error_text` returns it instead."""
    print(last_error_text() or "no error recorded")


def last_error_text() -> str:
    """The full traceback behind the last ❌ that came from an exception ("" when there was none)."""
    return _LAST_ERROR[0]


def learner_line(text: str) -> str:
    """``line N: <code>`` of the last traceback frame in notebook code (a cell), or ''."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*(?:\^+\s*)?([^\n]*)', text)
    for path, line, code in reversed(frames):
        if "ipykernel" in path or path.startswith("<ipython") or path.startswith("<cell"):
            return f"line {line}: {code.strip()}"
    return ""


_DISTCP = "a .distcp file is one rank's slices in DCP's layout, not a torch.save of the model: read the directory with dcp.load"
#: (exception type or None for any, regex on its message, likely cause): the first match is named under the
#: ❌ line of a crash. Causes only -- never the fix's code.
_CAUSES: list[tuple[str | None, str, str]] = [
    (None, r"[Cc]onnection (closed|reset)|timed? ?out|Timeout|hung",
     "another rank stopped early or skipped a collective: every rank must call the same collectives, in the "
     "same order, with the same sizes"),
    (None, r"unbound axis name",
     "an axis name the mesh does not have: use the names of the mesh the check passes (mesh.axis_names)"),
    (None, r"'NoneType' object",
     "a value is None here: a function that returns nothing (list.reverse() and in-place ops do), or past "
     "the end of a chain (the last unit has no next)"),
    (None, r"Missing key in checkpoint|Size mismatch",
     "the state dict given to DCP has keys or shapes that differ from the saved ones: DCP loads into a "
     "template with the saved names and shapes (the same top-level keys at save and at load, the same "
     "keys on every rank and in every process)"),
    (None, r"mixed torch\.Tensor and DTensor|full_state_dict",
     "whole (full) tensors handed to a sharded model: a template and its hand-back must use the same "
     "StateDictOptions, and a sharded template is what reshards without gathering anything"),
    ("UnpicklingError", "", _DISTCP),
    (None, r"dict-like|distcp|zip archive|Weights only load failed", _DISTCP),
    (None, r"incorrect number of gradients",
     "an autograd Function's backward returns one gradient per input of forward (None for a non-tensor)"),
    (None, r"setStorage|storage of size 0|freed storage",
     "a tensor views a storage that was freed (resized to 0) and not refilled before it was used"),
    (None, r"dtype|expected scalar type|[Ff]loat but found|Double|BFloat16",
     "two tensors of different dtypes meet: an allocation without dtype=, or a cast lost on the way"),
    (None, r"size|shape|must match|mismatch|elements|dimension|divisible|out of bounds",
     "a tensor's shape or size is not what this call expects: print the shapes going into that line "
     "(padding? the dim you cut? numel // N?)"),
    (None, r"arg is an empty sequence|empty sequence|iterable argument is empty",
     "min() / max() of an empty list: a case where nothing qualifies (no fit, a healthy run) -- decide what to "
     "return then (None?) before taking the extreme"),
    (None, r"not enough values to unpack|too many values to unpack",
     "unpacking assumes a length the value does not have: a 1-D shape has one dim, a 3-D one three"),
    ("TypeError", r"not supported between instances of",
     "comparing values of different kinds (a None among strings or numbers): leave out the None entries, or give "
     "them a key that sorts"),
    ("AttributeError", "", "a misspelt name, or an object that is not the type you think it is"),
    ("NameError", "", "a name from an earlier cell is not defined here: run the lab's cells above, in order"),
    ("TypeError", r"operand|not callable|not subscriptable|builtin_function_or_method|method",
     "a value of another type than you think: a method used without calling it (numel vs numel())?"),
    ("TypeError", r"argument", "the call's arguments do not match what the function takes: compare with the lab's text"),
    ("ZeroDivisionError", "", "a division by a size that can be 0 (N - 1 with N = 1? an empty shard?)"),
    ("IndexError", "", "an index past the end: check the boundaries (the first and last block, rank N - 1)"),
    ("KeyError", "", "a key that is not there: compare the names you use with the ones the object holds"),
    ("CheckpointException", "",
     "DCP could not save or load: most often a state_dict whose keys or shapes differ from the checkpoint's"),
    ("RecursionError", "", "a function that calls itself without end (a hook that triggers itself?)"),
]


def crash_text(kind: str, msg: list[str], line: str = "", where: str = "") -> str:
    """The ❌ text of a crash in the learner's code (after ``❌ name: ``): the exception's type, the rank
    (``where``), the cell's line, the message's first line and its likely cause. Judges that word a crash their run
    half recorded as plain data use it too."""
    cause = likely_cause(kind, " ".join(msg))
    return (f"{CRASH_PHRASE} {kind}{where}" + (f" at {line}" if line else "") + (f": {msg[0]}" if msg else "")
            + (f"\n   likely cause: {cause}" if cause else "") + "\n   (full traceback: checks.last_error())")


def likely_cause(kind: str, message: str) -> str:
    """The likely cause of an exception of type ``kind`` with ``message``, or '' (see :data:`_CAUSES`)."""
    for name, pattern, cause in _CAUSES:
        if (name is None or name == kind) and (not pattern or re.search(pattern, message)):
            return cause
    return ""


class check:
    """Run one exercise check, as a context manager or as a decorator that runs the function now.

    >>> with check("all-reduce by hand") as c:        # doctest: +SKIP
    ...     got = launch.run(my_all_reduce, world_size=4)
    ...     assert_close("sum on every rank", got, [expected] * 4, rtol=0, atol=0)
    >>> c.passed                                       # True; False when not implemented yet or wrong

    >>> @check("ring cost", todo="write ring_bytes() above")   # doctest: +SKIP
    ... def _():
    ...     assert ring_bytes(4, 1024) == 768
    ...     return "768 bytes per rank"               # a returned string is the ✅ detail

    ``tests``: what the check verifies, said in the ⏳ line so the learner knows the target.
    """

    def __init__(self, name: str, todo: str | None = None, tests: str | None = None):
        self.name, self.todo, self.tests = name, todo, tests
        self.passed: bool | None = None
        self.detail: str | None = None
        self.feedback: str | None = None
        self.submitted = False          #: set by a graded run half: the answer went to the grader's judge
        self.state: str | None = None   #: "solved", "wrong", "not attempted" or "submitted", once decided
        self.line: str | None = None    #: the line(s) printed for that state

    def ok(self, detail: str) -> None:
        """Set the ✅ line's detail (default: the last assert_close summary)."""
        self.detail = detail

    def __enter__(self) -> "check":
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        _ACTIVE.remove(self)
        if exc is None and self.submitted:
            self.passed = False                           # not decided here: the lab falls back to the reference
            line = f"📤 {self.name}: answer recorded; the grader's judge decides it, outside this notebook"
            print(line)
            self._notify("submitted", line)
            return False
        if exc is None:
            self.passed = True
            line = f"✅ {self.name}: {self.detail or 'matches the reference'}"
            print(line)
            self._notify("solved", line)
            return False
        if isinstance(exc, KeyboardInterrupt):
            return False
        todo = not_implemented_todo(exc)
        self.passed = False
        if todo is not None:
            line = f"⏳ {self.name}: not implemented yet — {self.todo or todo}"
            if self.tests:
                line += f"\n   The check will test: {self.tests}"
            if self.name in _HINTS:
                line += f'\n   Stuck? checks.hint("{self.name}") gives a hint; checks.hint("{self.name}", 2) says more.'
            print(line)
            self._notify("not attempted", line)
            return True                                   # swallowed: the lab keeps running
        rank_type = getattr(exc, "exc_type", None)
        if isinstance(exc, AssertionError):
            return self._wrong(self._feedback(str(exc)))
        if rank_type in ("AssertionError", "CheckFailed"):
            inner = _rank_message(exc).removeprefix("❌ ")
            return self._wrong(self._feedback(f"on rank {exc.rank}: {inner}"))
        if strict():
            return False                                  # tests: a real error propagates
        # A crash in the learner's code: one line that names the rank and the line, traceback folded.
        text = getattr(exc, "traceback_text", "") or "".join(traceback.format_exception(exc))
        where = f" on rank {exc.rank}" if getattr(exc, "rank", None) is not None and rank_type else ""
        kind = rank_type or type(exc).__name__
        msg = (_rank_message(exc) if rank_type else str(exc)).strip().splitlines()
        line = learner_line(text)
        _LAST_ERROR[0] = text
        return self._wrong(f"❌ {self.name}: {crash_text(kind, msg, line, where)}")

    def _wrong(self, feedback: str) -> bool:
        """A wrong answer: raise under the tests, else print it and let the lab fall back."""
        self.feedback = feedback
        self._notify("wrong", feedback)
        if strict():
            raise CheckFailed(feedback) from None
        print(feedback + "\n   The rest of the lab uses the reference answer until this check passes.")
        return True

    def _notify(self, state: str, text: str) -> None:
        self.state, self.line = state, text
        for observer in list(OBSERVERS):
            observer(self, state, text)

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
