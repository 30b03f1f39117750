"""The grader's three outputs: a summary table on the terminal, ``grades.csv`` and a self-contained ``report.html``.

``grades.csv`` is long-form, one row per learner × item, so a spreadsheet pivots it any way::

    learner,lab,kind,item,verdict,mistake,detail,seconds,processes
    alice,02,exercise,storage_bytes,solved,,"✅ storage_bytes: ...",14.2,6
    bob,02,exercise,storage_bytes,wrong,views counted twice,"counted 1,024 B, ...",15.0,6
    bob,02,prediction,model state after one Adam step,close,,"🎯 ...",15.0,6
    erin,,error,,refused,,"broken JSON: Unterminated string starting at (line 104, column 5)",,

The summary table and ``report.html`` have one row per learner, whatever the number of labs: each lab is a
group of columns (its exercises, then how many of them were solved), and the last column is the solved total over
the labs the learner handed in. ``report.html`` then holds, per exercise, how many solved it and its most common
mistakes (what to re-teach), the predictions, the runs (one per learner and lab: seconds, processes ended, why a
run stopped), the submissions flagged for review (and the rule each broke) and the refused files. Hover a grid
cell for its detail. No script, no external file, no emoji (words instead): it opens anywhere.
"""
from __future__ import annotations

import csv
import html
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.apps.grading.verdicts import VERDICTS, ExerciseResult, Prediction

__all__ = ["Graded", "Learner", "learners", "SYMBOL", "summary_table", "write_csv", "write_html"]

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


@dataclass
class Learner:
    """One learner's row: each lab they handed in (one :class:`Graded` per lab), in lab order."""

    name: str
    labs: dict[str, Graded] = field(default_factory=dict)

    def result(self, col: tuple[str, str]) -> ExerciseResult | None:
        g = self.labs.get(col[0])
        return _cell(g, col) if g is not None else None

    def solved(self, lab: str | None = None) -> tuple[int, int]:
        """(solved, exercises) in ``lab``, or in every lab handed in."""
        runs = [self.labs[lab]] if lab is not None else list(self.labs.values())
        results = [r for g in runs for r in g.results]
        return sum(r.verdict == "solved" for r in results), len(results)

    @property
    def seconds(self) -> float:
        return sum(g.seconds or 0 for g in self.labs.values())

    def note(self) -> str:
        """Each lab's flag, stop or notes, prefixed with its lab when the learner handed in several."""
        parts = []
        for lab, g in self.labs.items():
            text = "; ".join(filter(None, [f"FLAGGED ({g.flags[0]})" if g.flags else "",
                                           g.stopped or "; ".join(g.notes)]))
            if text:
                parts.append(f"{lab}: {text}" if len(self.labs) > 1 else text)
        return "; ".join(parts)


def learners(rows: list[Graded]) -> list[Learner]:
    """The graded rows (one per learner and lab) gathered into one :class:`Learner` per learner, in first-seen
    order; refused files are left out."""
    out: dict[str, Learner] = {}
    for g in rows:
        if g.error is None:
            out.setdefault(g.learner, Learner(g.learner)).labs[g.lab] = g
    for person in out.values():
        person.labs = dict(sorted(person.labs.items()))
    return list(out.values())


def _groups(cols: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Lab -> its exercise columns, in lab order (the column groups of both tables)."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for c in cols:
        groups.setdefault(c[0], []).append(c)
    return groups


def summary_table(rows: list[Graded]) -> str:
    """One line per learner: per lab (a column group) a symbol per exercise and its solved count, then the solved
    total, seconds and notes; refusals listed after."""
    people = learners(rows)
    cols = _columns([g for p in people for g in p.labs.values()])
    groups = _groups(cols)
    number = {c: i + 1 for i, c in enumerate(cols)}
    width = max([len("learner")] + [len(p.name) for p in people])
    lines = []
    if people:
        lines.append("exercises: " + ", ".join(f"{number[c]}={c[0]}/{c[1]}" for c in cols))
        head = [f"{'learner':<{width}}"]
        for lab, group in groups.items():
            head.append(f"{lab} " + " ".join(f"{number[c]:>2}" for c in group) + f" {'solved':>6}")
        lines.append("  ".join(head) + "   total  seconds  note")
    for p in people:
        cells = [f"{p.name:<{width}}"]
        for lab, group in groups.items():
            if lab in p.labs:
                marks = " ".join(SYMBOL[r.verdict] if (r := p.result(c)) else "  " for c in group)
                done, total = p.solved(lab)
                cells.append(f"{lab} {marks} {f'{done}/{total}':>6}")
            else:                                 # not handed in
                cells.append(f"{lab} " + " ".join(f"{SYMBOL[None]} " for _ in group) + f" {'-':>6}")
        done, total = p.solved()
        lines.append("  ".join(cells) + f"  {f'{done}/{total}':>6}  {p.seconds:>7.1f}  {p.note()}".rstrip())
    if people:
        lines.append("  ".join(f"{SYMBOL[v]} {v}" for v in VERDICTS) + f"  {SYMBOL[None]} lab not handed in")
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
td.v{text-align:center}.err{color:#a40000}small{color:#666}.lab{border-right:2px solid #888}
th.ex{font-size:11px;font-weight:normal;max-width:8em;overflow-wrap:anywhere}td.v{font-size:12px}"""


def _e(x) -> str:
    text = str(x)
    for emoji, word in _WORDS.items():
        text = text.replace(emoji, word)
    return html.escape(text, quote=True)


def write_html(rows: list[Graded], path: Path, title: str = "Grades") -> Path:
    graded = [g for g in rows if g.error is None]
    people = learners(rows)
    cols = _columns(graded)
    groups = _groups(cols)
    out = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{_e(title)}</title>",
           f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>",
           f"<p>{len(people)} learner(s), {len(graded)} submission(s) graded, {len(rows) - len(graded)} refused. "
           "Hover a cell for its detail. "
           + " ".join(f"<span style='background:{_COLOUR[v]};padding:0 .4em'>{v}</span>" for v in VERDICTS) + "</p>",
           "<h2>Learners × exercises</h2><table>",
           "<tr><th rowspan='2'>learner</th>" + "".join(f"<th colspan='{len(g) + 1}' class='lab'>lab {_e(lab)}</th>"
                                                      for lab, g in groups.items())
           + "<th rowspan='2'>solved</th></tr>",
           "<tr>" + "".join("".join(f"<th class='ex'>{_e(name)}</th>" for _, name in g) + "<th class='lab'>solved</th>"
                            for g in groups.values()) + "</tr>"]
    for p in people:
        out.append(f"<tr><th>{_e(p.name)}</th>")
        for lab, group in groups.items():
            for c in group:
                r = p.result(c)
                v = r.verdict if r else None
                tip = (f"{v}" + (f" ({r.mistake})" if r and r.mistake else "") + (f": {r.detail}" if r and r.detail else "")
                       if lab in p.labs else "lab not handed in")
                label = {"solved": "solved", "wrong": f"wrong{': ' + r.mistake if r and r.mistake else ''}",
                         "not attempted": "—", "crashed": "crashed", "flagged": "flagged", None: ""}[v]   # words, no emoji
                out.append(f"<td class='v' style='background:{_COLOUR[v]}' title='{_e(tip)}'>{_e(label)}</td>")
            done, total = p.solved(lab) if lab in p.labs else (None, len(group))
            out.append(f"<td class='lab'>{'' if done is None else done}/{total}</td>")
        done, total = p.solved()
        out.append(f"<td><b>{done}/{total}</b></td></tr>")
    head = "".join(f"<th>{_e(v)}</th>" for v in VERDICTS)
    out.append(f"</table><h2>Per exercise: what to re-teach</h2><table><tr><th>exercise</th>{head}"
               "<th>most common mistakes</th></tr>")
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
