"""One registry of the course's exercises: each check declared once, and everything else reads it from there.

A lab's check module declares each exercise where its check is defined::

    @exercise("03", "flat_shard", cell="def flat_shard(", hints=HINTS["flat_shard"], tests=TESTS["flat_shard"],
              mistakes={"no padding": "pad the flat buffer with zeros", ...})
    def check_flat_shard(fn, name="flat_shard") -> bool: ...

and the registry hands the same :class:`Exercise` to every reader:

* the notebooks -- ``checks.hint(name)`` knows the hints (registered here, once);
* the wrong-answer tests -- ``cell`` finds the exercise's cell in the lab, ``mistakes`` says what the ❌ line
  must name for each classic mistake (``tests/test_labs_wrong_answers.py``, one parametrised test);
* the kill-rate table -- :func:`kill_table`: per exercise, wrong answers tried and rejected, by kind;
* grading -- :func:`verdict` reads a run's output for one exercise: solved, wrong (with the mistake's tag),
  or not attempted.

``name`` is the name the check prints (``✅ flat_shard: ...``), ``lab`` the two digits of the notebook.
"""
from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from course_lib.checks.core import CRASH_PHRASE, register_hints

__all__ = ["Exercise", "KINDS", "exercise", "exercises", "find", "verdict", "kill_table"]

#: The kinds of classic mistake a check must catch. Every check guards "value" and "crash"; an exercise
#: declares (``guards=``) the other kinds that apply to it, and the wrong-answer catalogue
#: (``tests/wrong_answers/``) holds at least one wrong answer of each kind each exercise guards.
KINDS = {
    "value": "a wrong value: the formula, the reduction or the order is wrong",
    "boundary": "a boundary the text states, read the other way: 'at most' as strict, > for >=, GB for GiB",
    "argument": "an argument, dim or mesh axis the answer ignores, or a shape cut along one dim only",
    "cost": "right values at the wrong cost: op kinds, bytes moved, the memory peak or aliasing",
    "feasible": "an optimisation answer that is merely feasible, not the best one",
    "restore": "a restore that looks right when checked but differs once the run continues",
    "crash": "the answer raises: the check names the call, the rank and the line, never a raw traceback",
}
ALWAYS = ("value", "crash")

_REGISTRY: dict[tuple[str, str], "Exercise"] = {}


@dataclass(frozen=True)
class Exercise:
    """One exercise of one lab, as its check module declares it."""

    lab: str                      #: the notebook's two digits, "03"
    name: str                     #: what the check prints after ✅ / ❌ / ⏳
    cell: str                     #: text that the exercise's code cell contains, once (its def / class line)
    hints: tuple[str, ...]        #: general to specific; the first states the idea, never the code
    check: Callable = field(repr=False, compare=False)   #: the check function (learner's answer -> bool)
    tests: str = ""               #: what the check verifies, as the ⏳ line says it
    mistakes: Mapping[str, str] = field(default_factory=dict)   #: tag -> phrase the ❌ line holds for it
    guards: tuple[str, ...] = ALWAYS   #: the :data:`KINDS` of mistake this check must catch
    #: the judge half (:mod:`course_lib.checks.judge`): plain run data -> ✅ detail, or AssertionError(diagnosis)
    judge: Callable | None = field(default=None, repr=False, compare=False)
    #: the library functions that solve this exercise (dotted paths): unavailable while it is graded
    references: tuple[str, ...] = ()

    def __post_init__(self):
        if not re.fullmatch(r"\d\d", self.lab):
            raise ValueError(f"lab={self.lab!r}: two digits, as in the notebook's name (e.g. '03')")
        if not self.name or not self.cell.strip():
            raise ValueError(f"exercise {self.lab}/{self.name!r}: name and cell must be non-empty")
        if not self.hints or any(not isinstance(h, str) or not h.strip() for h in self.hints):
            raise ValueError(f"exercise {self.lab}/{self.name}: hints must be non-empty strings, most general first")
        unknown = [k for k in self.guards if k not in KINDS]
        if unknown:
            raise ValueError(f"exercise {self.lab}/{self.name}: guards={unknown} are not kinds of mistake; "
                             f"use some of {sorted(KINDS)}")

    def diagnosis(self, feedback: str) -> str | None:
        """The tag of the first declared mistake whose phrase the ❌ text holds, or None."""
        return next((tag for tag, phrase in self.mistakes.items() if phrase in feedback), None)


def exercise(lab: str, name: str, *, cell: str, hints: Sequence[str], tests: str = "",
             mistakes: Mapping[str, str] | None = None, guards: Sequence[str] = (), judge: Callable | None = None,
             references: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Declare the check below as exercise ``name`` of lab ``lab`` (see the module docstring).
    ``guards``: the kinds of mistake (:data:`KINDS`) it catches beyond "value" and "crash"; ``judge``: its judge half
    (the check's run half hands it plain data; :mod:`course_lib.checks.judge`); ``references``: the library functions
    that solve it (dotted paths), unavailable while it is graded."""
    def register(check: Callable) -> Callable:
        key = (lab, name)
        kinds = ALWAYS + tuple(k for k in guards if k not in ALWAYS)
        said = dict(mistakes or {})
        if CRASH_PHRASE not in said.values():
            said["crash"] = CRASH_PHRASE      # every check turns a crash in the answer into this ❌ line
        ex = Exercise(lab, name, cell, tuple(hints), check, tests, said, kinds, judge, tuple(references))
        old = _REGISTRY.get(key)
        if old is not None and old.check.__qualname__ != check.__qualname__:
            raise ValueError(f"exercise {lab}/{name} declared twice: {old.check.__qualname__} and {check.__qualname__}")
        _REGISTRY[key] = ex
        register_hints({name: ex.hints})
        check.exercise = ex
        return check
    return register


def _load_all() -> None:
    """Import every ``checks.labNN`` module, so that every exercise is declared."""
    for m in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if re.fullmatch(r"lab\d\d(_\w+)?", m.name):
            importlib.import_module(f"course_lib.checks.{m.name}")


def exercises(lab: str | None = None) -> list[Exercise]:
    """Every declared exercise (of one lab), in lab order, then in the order the module declares them."""
    _load_all()
    found = [e for e in _REGISTRY.values() if lab is None or e.lab == lab]
    return sorted(found, key=lambda e: e.lab)          # stable: declaration order within a lab


def find(lab: str, name: str) -> Exercise:
    _load_all()
    if (lab, name) not in _REGISTRY:
        known = ", ".join(e.name for e in exercises(lab)) or "none"
        raise KeyError(f"no exercise {name!r} in lab {lab}; its exercises: {known}")
    return _REGISTRY[(lab, name)]


def verdict(ex: Exercise, output: str) -> tuple[str, str | None]:
    """What a run's printed output says of ``ex``: ``("solved", None)``, ``("wrong", tag or None)``,
    ``("not attempted", None)`` or ``("not run", None)`` when its check printed nothing. The last line wins
    (a learner may re-run a check)."""
    state, tag = "not run", None
    for i, line in enumerate(output.splitlines()):
        for mark, what in (("✅", "solved"), ("❌", "wrong"), ("⏳", "not attempted")):
            if line.startswith(f"{mark} {ex.name}:"):
                state = what
                tag = ex.diagnosis("\n".join(output.splitlines()[i:i + 6])) if what == "wrong" else None
    return state, tag


def kill_table(rows: Iterable[tuple[Exercise, str, bool]]) -> str:
    """A table of wrong answers tried and rejected per exercise: ``rows`` are (exercise, kind, rejected)."""
    per: dict[tuple[str, str], list] = {}
    for ex, kind, rejected in rows:
        per.setdefault((ex.lab, ex.name), []).append((kind, rejected))
    lines = [f"{'lab':<4} {'exercise':<22} {'tried':>5} {'rejected':>8}  kinds (✗ = accepted)", "-" * 72]
    for (lab, name), got in sorted(per.items()):
        kinds = ", ".join(sorted({k if ok else f"{k} ✗" for k, ok in got}))
        lines.append(f"{lab:<4} {name:<22} {len(got):>5} {sum(ok for _, ok in got):>8}  {kinds}")
    return "\n".join(lines)
