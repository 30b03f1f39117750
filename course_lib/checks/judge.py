"""Every exercise check in two halves: *run* executes the learner's code, *judge* decides, from plain data only.

Vocabulary (the verdicts issue's words, used the same way in every lab's checks and in grading):

* **run half** -- calls the learner's function(s) on inputs the check chooses (in the kernel, and on gloo ranks for
  multi-rank exercises) and returns what came out as :mod:`plain data <course_lib.checks.plain>`: numbers, strings,
  lists, NumPy arrays, collective records as rows. It computes no expected value and holds no reference output:
  nothing the learner's code can read (a frame, a rank's locals) knows the answer.
* **judge half** -- a function ``judge(data, **params) -> str`` of that plain data alone (and the check's own
  parameters): it builds the inputs again, computes the expected values itself (a single-process reference or the
  formula), compares, and raises ``AssertionError`` with the named diagnosis, or returns the ✅ line's detail.
* **verdict** -- :class:`Verdict`: the judge's return value as data (state, text, mistake tag). A grader reads it,
  never the printed ✅/❌ text.

Where each half runs:

* **in a lab** (:func:`decide`): both in the kernel, one after the other -- run, ``loads(dumps(data))`` (so the judge
  sees exactly what a grader would), judge -- and the outcome is printed as today (✅ ⏳ ❌);
* **in grading** (``COURSE_LIB_OUTBOX`` set, inside the box): only the run half runs; its data goes to a file in the
  outbox folder (``📤`` is printed, the lab falls back to the reference), and the grader, outside the box, reads the
  file and calls :func:`verdict_of` -- the judge, in a process where no learner code ever ran. A stub or a crash in
  the box travels as ``{"raised": {"state": ..., "text": ...}}``: a box can only report its own failure that way.
* **references** (``exercise(..., references=[...])`` in the registry): the library functions that solve an
  exercise. While a graded run half executes, each raises :class:`ReferenceUnavailable` (the learner's functions are
  wrapped in :class:`Guarded`, which blocks them in the kernel and on every rank), and a learner cell that names one
  is flagged by the grader.
* **bounded call** (:func:`bounded`): a run half may call the learner's function under a budget of Python lines, so
  a loop that never ends is stopped and named instead of filling the kernel's memory.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from course_lib.checks import plain as _plain
from course_lib.checks.core import check

__all__ = ["OUTBOX_VAR", "Verdict", "ReferenceUnavailable", "Guarded", "guard", "decide", "verdict_of", "outbox_file",
           "read_outbox", "unavailable", "STATES", "Endless", "bounded", "LINE_BUDGET"]

OUTBOX_VAR = "COURSE_LIB_OUTBOX"
STATES = ("solved", "wrong", "not attempted", "crashed")


@dataclass(frozen=True)
class Verdict:
    """One exercise's verdict, as data."""
    state: str                    #: one of :data:`STATES`
    text: str                     #: the ✅ / ❌ / ⏳ line(s)
    mistake: str | None = None    #: the declared mistake the ❌ text names (registry), wrong answers only


class ReferenceUnavailable(RuntimeError):
    """The library's own solution of an exercise, called while that exercise is graded."""


def _resolve(path: str):
    """(owner, attribute name, object) for ``"course_lib.measure.memory.storage_bytes"`` or ``"mod.Class.method"``."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:-1]:
            owner = getattr(owner, attr)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ValueError(f"reference {path!r}: not an importable module attribute")


@contextlib.contextmanager
def unavailable(references: Sequence[str], exercise: str):
    """While inside: each reference (dotted path) raises :class:`ReferenceUnavailable`, through every name that holds
    it (its code is swapped, so ``from ... import`` copies are blocked too); restored on exit."""
    saved = []
    try:
        for path in references:
            owner, attr, fn = _resolve(path)
            fn = getattr(fn, "__func__", fn)
            msg = (f"{path} is the library's own solution of exercise {exercise!r}: it is not available while the "
                   "exercise is graded; write your own")

            def blocked(*a, _msg=msg, _exc=ReferenceUnavailable, **k):   # no globals: it runs as `fn`'s code
                raise _exc(_msg)
            code = getattr(fn, "__code__", None)
            if code is not None and not code.co_freevars:
                fn.__code__ = blocked.__code__.replace(co_name=code.co_name)
                defaults = fn.__defaults__, fn.__kwdefaults__
                fn.__defaults__, fn.__kwdefaults__ = None, {"_msg": msg, "_exc": ReferenceUnavailable}
                saved.append(("code", fn, (code, defaults)))
            else:
                setattr(owner, attr, blocked)
                saved.append(("attr", owner, (attr, fn)))
        yield
    finally:
        for kind, obj, old in reversed(saved):
            if kind == "code":
                obj.__code__, (obj.__defaults__, obj.__kwdefaults__) = old[0], old[1]
            else:
                setattr(obj, old[0], old[1])


class Guarded:
    """A learner's function that, when called (in the kernel or on a rank), runs with ``references`` blocked.
    Picklable by cloudpickle (the learner's function travels by value), so ranks block them too."""

    def __init__(self, fn: Callable, references: Sequence[str], exercise: str):
        self.fn, self.references, self.exercise = fn, tuple(references), exercise
        self.__name__ = getattr(fn, "__name__", "answer")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args, **kwargs):
        with unavailable(self.references, self.exercise):
            return self.fn(*args, **kwargs)

    def __getattr__(self, name):          # class answers (MyFSDP): attributes read through
        if name in ("fn", "references", "exercise"):
            raise AttributeError(name)
        return getattr(self.fn, name)


def guard(fn: Callable, lab: str, name: str) -> Callable:
    """``fn`` as the run half should call it: in grading, :class:`Guarded` with exercise ``name``'s references
    blocked; in a lab, ``fn`` itself (a learner may compare with the library there)."""
    if not os.environ.get(OUTBOX_VAR):
        return fn
    from course_lib.checks import registry
    refs = registry.find(lab, name).references
    return Guarded(fn, refs, name) if refs else fn


#: Python lines one bounded call of a learner's function may run: past it, the call is stopped as an endless loop
#: before its data fills the memory (a ``while`` whose counter never moves appends ~3 million items a second, and
#: once took a kernel down at 24 GB)
LINE_BUDGET = 1_000_000


class Endless(BaseException):
    """Raised into the learner's code when a :func:`bounded` call runs past its line budget (a BaseException, so an
    ``except Exception`` in the loop does not swallow it)."""


def bounded(fn: Callable, *args, budget: int = LINE_BUDGET):
    """Run half: ``fn(*args)``, stopped with :class:`Endless` after ``budget`` traced lines. The line count is
    :func:`sys.settrace`'s, this thread's only (no signal, no memory limit that other threads of the kernel could
    hit); the trace function already set (a debugger's, coverage's) is restored afterwards."""
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
            if lines > budget:
                raise Endless
        return local

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: local)
    try:
        return fn(*args)
    finally:
        sys.settrace(previous)


def outbox_file(outbox: str | Path, lab: str, name: str) -> Path:
    """Where a graded run half writes exercise ``name`` of lab ``lab``."""
    return Path(outbox) / f"{lab}-{re.sub(r'[^A-Za-z0-9_]+', '_', name)}.plain"


def _wrong_text(name: str, msg: str) -> str:
    msg = msg.strip() or "assertion failed"
    return msg if msg.startswith(f"❌ {name}:") else f"❌ {name}: {msg.removeprefix('❌ ')}"


def _judged(judge: Callable, data: Any, params: dict) -> str:
    """The judge's ✅ detail; an error of the judge's own on odd data becomes a wrong answer, not a crash."""
    try:
        return judge(data, **params)
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"the answer could not be judged ({type(exc).__name__}: {exc}): return the kind of "
                             "value the exercise asks for") from None


def decide(name: str, *, lab: str, tests: str, run: Callable[[], Any], judge: Callable[..., str],
           params: dict | None = None, todo: str | None = None) -> bool:
    """A check function's body: the run half, then (in a lab) the judge half or (in grading) the outbox.
    Returns True only when the judge said ✅ in this process."""
    outbox = os.environ.get(OUTBOX_VAR)
    params = dict(params or {})
    with check(name, todo=todo, tests=tests) as c:
        data = _plain.loads(_plain.dumps(run()))       # plain data from here on, in a lab as in grading
        if outbox:
            outbox_file(outbox, lab, name).write_bytes(_plain.dumps({"data": data}))
            c.submitted = True
        else:
            c.ok(_judged(judge, data, params) or "matches the reference")
    if outbox and c.state != "submitted":          # a stub or a crash in the box: it can only report its own failure
        state = "not attempted" if c.state == "not attempted" else "crashed"
        outbox_file(outbox, lab, name).write_bytes(_plain.dumps({"raised": {"state": state, "text": c.line or ""}}))
    return bool(c.passed) and not outbox


def verdict_of(ex, blob: bytes | None) -> Verdict:
    """Exercise ``ex``'s verdict from the bytes its graded run half wrote (None: it wrote nothing), decided here,
    by the exercise's judge (:attr:`~course_lib.checks.registry.Exercise.judge`), with its default parameters."""
    if blob is None:
        return Verdict("crashed", f"💥 {ex.name}: its check never sent a result (not reached, or the cell was changed)")
    try:
        doc = _plain.loads(blob)
    except ValueError as exc:
        return Verdict("crashed", f"💥 {ex.name}: unreadable run data: {exc}")
    if not isinstance(doc, dict) or not ({"data"} == set(doc) or {"raised"} == set(doc)):
        return Verdict("crashed", f"💥 {ex.name}: run data of the wrong shape")
    if "raised" in doc:
        raised = doc["raised"] if isinstance(doc["raised"], dict) else {}
        state = raised.get("state") if raised.get("state") in ("not attempted", "crashed") else "crashed"
        return Verdict(state, str(raised.get("text", ""))[:2000])
    try:
        with contextlib.redirect_stdout(io.StringIO()):       # assert_close's progress lines: not the grader's output
            detail = _judged(ex.judge, doc["data"], {})
    except AssertionError as exc:
        text = _wrong_text(ex.name, str(exc))
        return Verdict("wrong", text, ex.diagnosis(text))
    return Verdict("solved", f"✅ {ex.name}: {detail or 'matches the reference'}")


def read_outbox(outbox: Path, exercises) -> dict[str, Verdict]:
    """Every exercise's verdict from an outbox folder (the grader's side)."""
    out = {}
    for ex in exercises:
        path = outbox_file(outbox, ex.lab, ex.name)
        blob = None
        if path.is_file() and not path.is_symlink() and path.stat().st_size <= _plain.MAX_BYTES:
            blob = path.read_bytes()
        out[ex.name] = verdict_of(ex, blob)
    return out
