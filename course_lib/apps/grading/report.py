"""The grader's three outputs: a summary table on the terminal, ``grades.csv`` and a self-contained ``report.html``.

``grades.csv`` is long-form, one row per learner × item, so a spreadsheet pivots it any way::

    learner,lab,kind,item,verdict,mistake,detail,seconds,processes
    alice,02,exercise,storage_bytes,solved,,"✅ storage_bytes: ...",14.2,6
    bob,02,exercise,storage_bytes,wrong,views counted twice,"counted 1,024 B, ...",15.0,6
    bob,02,prediction,model state after one Adam step,close,,"🎯 ...",15.0,6
    erin,,error,,refused,,"broken JSON: Unterminated string starting at (line 104, column 5)",,

``report.html`` holds the learners × exercises grid (hover a cell for its detail), then, per exercise, how
many solved it and its most common mistakes (what to re-teach), the predictions, the runs (seconds, processes
ended, why a run stopped), the submissions flagged for review (and the rule each broke) and the refused files.
No script, no external file, no emoji (words instead): it opens anywhere.
"""
from __future__ import annotations

import csv
import html
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.apps.grading.verdicts import VERDICTS, ExerciseResult, Prediction

__all__ = ["Graded", "SYMBOL", "summary_table", "write_csv", "write_html"]

SYMBOL = {"solved": "✅", "wrong": "❌", "not attempted": "⏳", "crashed": "💥", "flagged": "🚩", None: "·"}
_COLOUR = {"solved": "#d9f2d9", "wrong": "#f9d6d5", "not attempted": "#eeeeee", "crashed": "#f5c27a",
           "flagged": "#e3c8f2", None: "#ffffff"}
#: The report's HTML shows words, not emoji: headless Chromium (and many a mail client) has no emoji font.
_WORDS = {"✅": "[ok]", "❌": "[wrong]", "⏳": "[not done]", "💥": "[crashed]", "🎯": "[prediction]", "💡": "[hint]",
          "🚩": "[flagged]", "⚠️": "[warning]", "⚠": "[warning]"}


@dataclass
class Graded:
    """One graded submission, or one refused file (``error`` set, no results)."""

    learner: str
    lab: str
    path: str
    results: list[ExerciseResult] = field(default_factory=list)
    predictions: list[Prediction] = field(default_factory=list)
    seconds: float | None = None
    processes: int | None = None       #: processes of the submission ended at the end (kernel, ranks, ...)
    stopped: str | None = None         #: why the run stopped early, if it did
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    flags: list[str] = field(default_factory=list)    #: why it is flagged for review ("rule: detail"), if it is


def _columns(rows: list[Graded]) -> list[tuple[str, str]]:
    cols: list[tuple[str, str]] = []
    for g in rows:
        for r in g.results:
            if (r.lab, r.name) not in cols:
                cols.append((r.lab, r.name))
    return sorted(cols, key=lambda c: c[0])        # stable: lab order, then the lab's own order


def _cell(g: Graded, col) -> ExerciseResult | None:
    return next((r for r in g.results if (r.lab, r.name) == col), None)


def summary_table(rows: list[Graded]) -> str:
    """One line per learner: a symbol per exercise, solved count, seconds; refusals listed after."""
    graded = [g for g in rows if g.error is None]
    cols = _columns(graded)
    names = [f"{lab}/{name}" for lab, name in cols]
    width = max([len("learner")] + [len(g.learner) for g in graded])
    lines = [] if not graded else ["exercises: " + ", ".join(f"{i + 1}={n}" for i, n in enumerate(names)),
             f"{'learner':<{width}}  lab  " + " ".join(f"{i + 1:>2}" for i in range(len(cols))) + "  solved  seconds  note"]
    for g in graded:
        marks = " ".join(SYMBOL[r.verdict] if (r := _cell(g, c)) else "  " for c in cols)
        solved = sum(r.verdict == "solved" for r in g.results)
        note = "; ".join(filter(None, [f"FLAGGED ({g.flags[0]})" if g.flags else "", g.stopped or "; ".join(g.notes)]))
        lines.append(f"{g.learner:<{width}}  {g.lab:<3}  {marks}  {solved:>2}/{len(g.results):<3} "
                     f"{g.seconds or 0:>7.1f}  {note}".rstrip())
    if graded:
        lines.append("  ".join(f"{SYMBOL[v]} {v}" for v in VERDICTS))
    for g in rows:
        if g.error is not None:
            lines.append(f"ERROR {g.path}: {g.error}")
    return "\n".join(lines)


def write_csv(rows: list[Graded], path: Path) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["learner", "lab", "kind", "item", "verdict", "mistake", "detail", "seconds", "processes"])
        for g in rows:
            run = [f"{g.seconds:.1f}" if g.seconds is not None else "", g.processes if g.processes is not None else ""]
            if g.error is not None:
                w.writerow([g.learner, g.lab, "error", "", "refused", "", g.error, *run])
                continue
            for r in g.results:
                w.writerow([g.learner, g.lab, "exercise", r.name, r.verdict, r.mistake or "", r.detail, *run])
            for p in g.predictions:
                w.writerow([g.learner, g.lab, "prediction", p.name, p.score, "", p.detail, *run])
            for f in g.flags:
                w.writerow([g.learner, g.lab, "flag", f.split(":", 1)[0], "flagged", "", f, *run])
    return Path(path)


_CSS = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f4f4f4}
td.v{text-align:center}.err{color:#a40000}small{color:#666}"""


def _e(x) -> str:
    text = str(x)
    for emoji, word in _WORDS.items():
        text = text.replace(emoji, word)
    return html.escape(text, quote=True)


def write_html(rows: list[Graded], path: Path, title: str = "Grades") -> Path:
    graded = [g for g in rows if g.error is None]
    cols = _columns(graded)
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>",
           f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>",
           f"<p>{len(graded)} submission(s) graded, {len(rows) - len(graded)} refused. Hover a cell for its detail. "
           + " ".join(f"<span style='background:{_COLOUR[v]};padding:0 .4em'>{v}</span>" for v in VERDICTS) + "</p>", "<h2>Learners × exercises</h2><table><tr><th>learner</th>"]
    out += [f"<th>{_e(lab)}<br>{_e(name)}</th>" for lab, name in cols] + ["<th>solved</th></tr>"]
    for g in graded:
        out.append(f"<tr><th>{_e(g.learner)}</th>")
        for c in cols:
            r = _cell(g, c)
            v = r.verdict if r else None
            tip = f"{v}" + (f" ({r.mistake})" if r and r.mistake else "") + (f": {r.detail}" if r and r.detail else "")
            label = {"solved": "solved", "wrong": f"wrong{': ' + r.mistake if r and r.mistake else ''}",
                     "not attempted": "—", "crashed": "crashed", "flagged": "flagged", None: ""}[v]   # words, no emoji
            out.append(f"<td class='v' style='background:{_COLOUR[v]}' title='{_e(tip)}'>{_e(label)}</td>")
        out.append(f"<td>{sum(r.verdict == 'solved' for r in g.results)}/{len(g.results)}</td></tr>")
    out.append("</table><h2>Per exercise: what to re-teach</h2><table><tr><th>exercise</th><th>solved</th>"
               "<th>wrong</th><th>not attempted</th><th>crashed</th><th>most common mistakes</th></tr>")
    for c in cols:
        res = [r for g in graded if (r := _cell(g, c))]
        counts = Counter(r.verdict for r in res)
        tags = Counter(r.mistake or "undeclared mistake" for r in res if r.verdict == "wrong")
        crashes = Counter(r.detail.split(":")[0] for r in res if r.verdict == "crashed")
        common = [f"{_e(t)} × {n}" for t, n in tags.most_common(3)] + [f"crash: {_e(t)} × {n}" for t, n in crashes.most_common(2)]
        out.append(f"<tr><th>{_e(c[0])}/{_e(c[1])}</th>" + "".join(f"<td>{counts.get(v, 0)}</td>" for v in VERDICTS)
                   + f"<td>{'<br>'.join(common) or '—'}</td></tr>")
    out.append("</table><h2>Predictions</h2><table><tr><th>learner</th><th>prediction</th><th>score</th><th>line</th></tr>")
    for g in graded:
        out += [f"<tr><td>{_e(g.learner)}</td><td>{_e(p.name)}</td><td>{_e(p.score)}</td><td><small>{_e(p.detail)}</small></td></tr>"
                for p in g.predictions]
    out.append("</table><h2>Runs</h2><table><tr><th>learner</th><th>lab</th><th>seconds</th><th>processes ended</th>"
               "<th>notes</th></tr>")
    for g in graded:
        note = "; ".join(filter(None, [g.stopped, *g.notes]))
        out.append(f"<tr><td>{_e(g.learner)}</td><td>{_e(g.lab)}</td><td>{g.seconds or 0:.1f}</td>"
                   f"<td>{g.processes if g.processes is not None else ''}</td><td>{_e(note)}</td></tr>")
    out.append("</table><h2>Flagged for review</h2><p>A flagged submission touched the library, the checks or the "
               "grader; none of its exercises is graded solved until someone reads it.</p><ul>")
    out += [f"<li><b>{_e(g.learner)}</b> (lab {_e(g.lab)}): " + "; ".join(_e(f) for f in g.flags) + "</li>"
            for g in graded if g.flags] or ["<li>none</li>"]
    out.append("</ul><h2>Refused</h2><ul>")
    out += [f"<li class='err'><code>{_e(g.path)}</code>: {_e(g.error)}</li>" for g in rows if g.error is not None] or ["<li>none</li>"]
    out.append("</ul></body></html>")
    Path(path).write_text("\n".join(out), encoding="utf-8")
    return Path(path)
