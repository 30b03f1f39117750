"""Reading a learner's executed lab: one result per exercise, one per prediction (``python -m course_lib grade``).

Words, as the grade report uses them:

* **solved** -- the check printed ✅;
* **wrong** -- it printed ❌ with a diagnosis; ``mistake`` is the tag of the declared mistake the ❌ text
  names (:meth:`~course_lib.checks.registry.Exercise.diagnosis`), or None for an undeclared one;
* **not attempted** -- it printed ⏳ (the stub still raises ``NotImplementedError``);
* **crashed** -- the learner's code raised (the check's "your code raised ..." line), the exercise's cell
  or its check cell ended in an error (a cell time limit included), or the notebook stopped before the
  check ran (kernel died, notebook time limit); ``detail`` is one line saying which;
* a **prediction** is a ``checks.prediction`` line (🎯): ``score`` is ``exact``, ``close``, ``far off`` or
  ``none`` (no number written), ``detail`` the line itself.

Everything here reads text: it never runs the learner's code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from course_lib.checks.core import CRASH_PHRASE
from course_lib.checks.registry import Exercise, verdict

__all__ = ["VERDICTS", "ExerciseResult", "Prediction", "exercise_result", "predictions", "first_line"]

#: Every verdict, in the order reports list them.
VERDICTS = ("solved", "wrong", "not attempted", "crashed")


@dataclass(frozen=True)
class ExerciseResult:
    lab: str
    name: str
    verdict: str                  #: one of :data:`VERDICTS`
    mistake: str | None = None    #: declared mistake tag (wrong answers only)
    detail: str = ""              #: one line: the ✅/❌ text, or what crashed


@dataclass(frozen=True)
class Prediction:
    name: str
    score: str                    #: "exact", "close", "far off", "none" or "made" (no verdict printed)
    detail: str


def first_line(text: str, width: int = 200) -> str:
    line = next((l.strip() for l in str(text).splitlines() if l.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"


def _block(text: str, start: int) -> list[str]:
    """The ❌ line at ``start`` and its indented continuation lines."""
    lines = text.splitlines()
    out = [lines[start]]
    for line in lines[start + 1:]:
        if not line.startswith("   "):
            break
        out.append(line)
    return out


def exercise_result(ex: Exercise, check_text: str, *, error: str | None = None,
                    stopped: str | None = None) -> ExerciseResult:
    """One exercise's result from its check cell's printed text.

    ``error``: the first error (``"Name: message"``) in the exercise's cell or its check cell, if any;
    ``stopped``: why the notebook ended before the check cell ran, if it did.
    """
    state, tag = verdict(ex, check_text)
    lines = check_text.splitlines()
    mark = {"solved": "✅", "wrong": "❌", "not attempted": "⏳"}.get(state)
    at = max((i for i, l in enumerate(lines) if mark and l.startswith(f"{mark} {ex.name}:")), default=None)
    if state == "solved":
        return ExerciseResult(ex.lab, ex.name, "solved", None, first_line(lines[at]))
    if state == "not attempted":
        return ExerciseResult(ex.lab, ex.name, "not attempted", None, "")
    if state == "wrong":
        block = _block(check_text, at)
        head = block[0].split(":", 1)[1].strip()
        if head.startswith(CRASH_PHRASE):
            return ExerciseResult(ex.lab, ex.name, "crashed", None, first_line(head))
        likely = next((l.strip() for l in block if l.strip().startswith("likely mistake:")), "")
        return ExerciseResult(ex.lab, ex.name, "wrong", tag, first_line(" ".join(p for p in (head, likely) if p), 300))
    why = error or (f"not reached: {stopped}" if stopped else "its check printed nothing")
    return ExerciseResult(ex.lab, ex.name, "crashed", None, first_line(why))


_PRED = re.compile(r"^🎯 (?P<name>.+?): (?P<rest>.*)$")


def predictions(text: str) -> list[Prediction]:
    """Every 🎯 line of ``text`` (the last one wins for a name printed twice), in order of first appearance."""
    found: dict[str, Prediction] = {}
    for line in text.splitlines():
        m = _PRED.match(line.strip())
        if not m:
            continue
        rest = m.group("rest")
        if rest.startswith("no prediction written"):
            score = "none"
        elif rest.endswith(": exact."):
            score = "exact"
        elif "— close" in rest:
            score = "close"
        elif "— far off" in rest:
            score = "far off"
        else:
            score = "made"
        found[m.group("name")] = Prediction(m.group("name"), score, first_line(line, 300))
    return list(found.values())
