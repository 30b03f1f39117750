"""Reading a learner's executed lab: one result per exercise, one per prediction (``python -m course_lib grade``).

Words, as the grade report uses them:

* **solved** -- the exercise's judge, run by the grader outside the box on the plain data the check's run half wrote
  (:mod:`course_lib.checks.judge`), said ✅, and nothing flagged the submission;
* **flagged** -- it would be solved, but the submission is flagged for review (:func:`flags`: a rule it broke);
* **wrong** -- it printed ❌ with a diagnosis; ``mistake`` is the tag of the declared mistake the ❌ text
  names (:meth:`~course_lib.checks.registry.Exercise.diagnosis`), or None for an undeclared one;
* **not attempted** -- it printed ⏳ (the stub still raises ``NotImplementedError``);
* **crashed** -- the learner's code raised (the check's "your code raised ..." line), the exercise's cell
  or its check cell ended in an error (a cell time limit included), or the notebook stopped before the
  check ran (kernel died, notebook time limit); ``detail`` is one line saying which;
* a **prediction** is a ``checks.prediction`` line (🎯): ``score`` is ``exact``, ``close``, ``far off`` or
  ``none`` (no number written), ``detail`` the line itself.

Everything here reads text, records and judges' verdicts: it never runs the learner's code.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from course_lib.checks.core import CRASH_PHRASE
from course_lib.checks.registry import Exercise, verdict

__all__ = ["VERDICTS", "ExerciseResult", "Prediction", "exercise_result", "judged_result", "predictions", "first_line",
           "flags", "STATIC_RULES", "reference_flags"]

#: Every verdict, in the order reports list them.
VERDICTS = ("solved", "wrong", "not attempted", "crashed", "flagged")


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


def judged_result(ex: Exercise, verdict, *, error: str | None = None, stopped: str | None = None) -> ExerciseResult:
    """One exercise's result from its judge's :class:`~course_lib.checks.judge.Verdict` (a graded run).

    ``error`` / ``stopped``: as for :func:`exercise_result`; they explain an exercise whose check sent nothing."""
    if verdict.state == "solved":
        return ExerciseResult(ex.lab, ex.name, "solved", None, first_line(verdict.text))
    if verdict.state == "wrong":
        lines = verdict.text.splitlines()
        head = lines[0].split(":", 1)[1].strip() if lines and ":" in lines[0] else first_line(verdict.text)
        likely = next((l.strip() for l in lines if l.strip().startswith("likely mistake:")), "")
        return ExerciseResult(ex.lab, ex.name, "wrong", verdict.mistake,
                              first_line(" ".join(p for p in (head, likely) if p), 300))
    if verdict.state == "not attempted":
        return ExerciseResult(ex.lab, ex.name, "not attempted", None, "")
    if verdict.text.startswith("💥") and (error or stopped):      # sent nothing: say why the notebook did not get there
        return ExerciseResult(ex.lab, ex.name, "crashed", None,
                              first_line(error or f"not reached: {stopped}"))
    head = verdict.text.split(":", 1)[1].strip() if ":" in verdict.text else verdict.text
    return ExerciseResult(ex.lab, ex.name, "crashed", None, first_line(head or "crashed"))


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


#: (rule, pattern) looked for in the cells a learner changed or added: what no lab asks a learner to write.
STATIC_RULES: list[tuple[str, str]] = [
    ("sys.modules", r"\bsys\.modules\b"),
    ("library files", r"__file__|\bsite-packages\b|/course_lib/"),
    ("the grader's modules", r"\bcourse_lib\.apps\b|\bgrading\.guard\b|\bOBSERVERS\b"),
    ("library internals", r"(?<![\w.])(?:lab\d\d\w*|checks|core|registry|course_lib(?:\.\w+)*)"
                          r"\.[A-Za-z_]\w*(?:\.\w+)*\s*=(?!=)"),
    ("library internals", r"\b(?:setattr|delattr)\(\s*(?:lab\d\d|checks|core|registry|course_lib|torch|np|numpy|jax|builtins)\b"),
    ("library internals", r"\bimportlib\.reload\b|\bbuiltins\.\w+\s*=(?!=)|__builtins__|\.__code__\s*="),
    ("introspection", r"\bctypes\b|\bgc\.get_(?:objects|referrers|referents)\b|\bsys\.addaudithook\b|/proc/self"),
]


def static_flags(changed_sources: list[str]) -> list[tuple[str, str]]:
    """(rule, the line) for each line of the learner's own cells that matches :data:`STATIC_RULES`."""
    found = []
    for src in changed_sources:
        for line in src.splitlines():
            code = line.split("#", 1)[0]
            for rule in dict.fromkeys(rule for rule, pattern in STATIC_RULES if re.search(pattern, code)):
                found.append((rule, f"the notebook's code: {first_line(line, 120)}"))
    return found


def reference_flags(changed_sources: list[str], exercises) -> list[tuple[str, str]]:
    """("reference use", the line) for each line of the learner's own cells that names a library function declared
    as solving one of ``exercises`` (the registry's ``references``): its module path, or ``Owner.attr``, or an
    import of it."""
    found = []
    for ex in exercises:
        for ref in getattr(ex, "references", ()):
            parts = ref.split(".")
            owner, attr = parts[-2], parts[-1]
            pats = [re.escape(ref), rf"\b{re.escape(owner)}\s*\.\s*{re.escape(attr)}\b",
                    rf"\bimport\b[^#\n]*\b{re.escape(attr)}\b" if len(parts) > 2 else r"(?!)"]
            mods = [".".join(parts[:k]) for k in range(2, len(parts))]
            for src in changed_sources:
                for line in src.splitlines():
                    code = line.split("#", 1)[0]
                    if any(re.search(p, code) for p in pats[:2]) or (
                            re.search(pats[2], code) and any(m in code for m in mods)):
                        found.append(("reference use", f"{ex.name}: the notebook's code calls the library's own "
                                                       f"solution {ref}: {first_line(line, 120)}"))
    return found


def flags(records: list[dict], nonce: str, stopped: str | None, printed: dict[str, str],
          recorded: dict[str, str], changed_sources: list[str], exercises=()) -> list[tuple[str, str]]:
    """Why a submission is flagged for review, as (rule, detail) pairs; empty when nothing is wrong.

    ``records``: what the guard wrote; ``nonce``: what its integrity record must echo; ``stopped``: why the run
    ended early (then no report is expected); ``printed`` / ``recorded``: exercise -> the state its check cell
    printed / the guard recorded; ``changed_sources``: the learner's edited and added cells."""
    out = [(r.get("rule", "?"), str(r.get("detail", ""))) for r in records if r.get("kind") == "flag"]
    out += [("garbled channel", r.get("text", "")) for r in records if r.get("kind") == "garbled"]
    booted = any(r.get("kind") == "boot" for r in records)
    report = [r for r in records if r.get("kind") == "integrity" and r.get("nonce") == nonce]
    if booted and not report and stopped is None:
        out.append(("guard disabled", "the guard's integrity report never came back: the notebook changed the "
                                      "kernel, the import system or the guard"))
    for r in report[-1:]:
        out += [("library internals", change) for change in r.get("changes", [])]
    for name, state in printed.items():
        if state == "solved" and recorded.get(name) != "solved":
            out.append(("forged output", f"{name}: the notebook printed ✅ but its check recorded "
                                         f"{recorded.get(name, 'nothing')}"))
    out += static_flags(changed_sources)
    out += reference_flags(changed_sources, exercises)
    seen, unique = set(), []
    for item in out:
        if item not in seen:
            seen.add(item)
            unique.append(item)
    return unique
