"""The grade reports from made-up results: the table, grades.csv (long form) and a self-contained report.html."""
from __future__ import annotations

import csv
import re

from course_lib.apps.grading.report import Graded, summary_table, write_csv, write_html
from course_lib.apps.grading.verdicts import ExerciseResult, Prediction


def _rows() -> list[Graded]:
    def res(name, verdict, mistake=None, detail=""):
        return ExerciseResult("02", name, verdict, mistake, detail)
    return [
        Graded("alice", "02", "c/alice/02_memory.ipynb", [res("a", "solved"), res("b", "wrong", "no padding", "got 3")],
               [Prediction("bytes", "close", "🎯 bytes: ...")], 12.5, 7),
        Graded("bob", "02", "c/bob/02_memory.ipynb", [res("a", "wrong", "no padding", "got <4>"), res("b", "crashed", None,
               "ZeroDivisionError: division by zero")], [], 30.0, 9, "stopped at the notebook's time limit (30 s)"),
        Graded("carol", "02", "c/carol/02_memory.ipynb", [res("a", "not attempted"), res("b", "wrong", "no padding")], [], 11.0, 7),
        Graded("erin", "", "c/erin/02_memory.ipynb", error="broken JSON: Expecting value at line 1 column 2"),
    ]


def test_summary_table():
    text = summary_table(_rows())
    assert "1=02/a, 2=02/b" in text
    assert re.search(r"alice\s+02\s+✅ ❌\s+1/2", text) and re.search(r"bob\s+02\s+❌ 💥\s+0/2", text)
    assert "stopped at the notebook's time limit" in text
    assert "ERROR c/erin/02_memory.ipynb: broken JSON" in text


def test_csv_is_long_form(tmp_path):
    rows = list(csv.DictReader(open(write_csv(_rows(), tmp_path / "grades.csv"), encoding="utf-8")))
    assert len(rows) == 2 + 1 + 2 + 2 + 1
    assert rows[1] == {"learner": "alice", "lab": "02", "kind": "exercise", "item": "b", "verdict": "wrong",
                       "mistake": "no padding", "detail": "got 3", "seconds": "12.5", "processes": "7"}
    assert rows[2]["kind"] == "prediction" and rows[2]["verdict"] == "close"
    assert rows[-1]["kind"] == "error" and rows[-1]["detail"].startswith("broken JSON")


def test_html_grid_and_what_to_reteach(tmp_path):
    html = write_html(_rows(), tmp_path / "report.html").read_text(encoding="utf-8")
    assert html.count("<tr><th>alice</th>") == 1 and "got &lt;4&gt;" in html         # escaped
    reteach = html.split("what to re-teach")[1].split("</table>")[0]
    assert "no padding × 2" in reteach and "crash: ZeroDivisionError × 1" in reteach
    assert "<script" not in html and "http" not in html and "broken JSON" in html


def _course() -> list[Graded]:
    """Three learners, three labs with 2, 3 and 4 exercises; carol handed in one lab only."""
    labs = {"00": ["a", "b"], "03": ["c", "d", "e"], "07": ["f", "g", "h", "i"]}

    def lab(learner, number, solved, seconds=10.0, **kw):
        names = labs[number]
        res = [ExerciseResult(number, n, "solved" if i < solved else "wrong", None if i < solved else "off by one")
               for i, n in enumerate(names)]
        return Graded(learner, number, f"c/{learner}/{number}_x.ipynb", res, [], seconds, 3, **kw)
    return [lab("alice", "00", 2), lab("alice", "03", 3), lab("alice", "07", 1),
            lab("bob", "00", 1), lab("bob", "03", 0, stopped="memory limit 4 GiB reached: the kernel was killed"),
            lab("bob", "07", 4), lab("carol", "03", 2)]


def test_one_row_per_learner_with_a_total_per_lab():
    text = summary_table(_course())
    lines = text.splitlines()
    assert lines[0] == "exercises: " + ", ".join(f"{i}={lab}/{n}" for i, (lab, n) in enumerate(
        [("00", "a"), ("00", "b"), ("03", "c"), ("03", "d"), ("03", "e"), ("07", "f"), ("07", "g"), ("07", "h"),
         ("07", "i")], start=1))
    rows = [l for l in lines if l.split(" ", 1)[0] in ("alice", "bob", "carol")]
    assert len(rows) == 3                                                   # not one per (learner, lab)
    assert re.search(r"alice\s+00 ✅ ✅\s+2/2\s+03 ✅ ✅ ✅\s+3/3\s+07 ✅ ❌ ❌ ❌\s+1/4\s+6/9\s+30\.0", rows[0]), rows[0]
    assert re.search(r"bob\s+00 ✅ ❌\s+1/2\s+03 ❌ ❌ ❌\s+0/3\s+07 ✅ ✅ ✅ ✅\s+4/4\s+5/9", rows[1]), rows[1]
    assert "03: memory limit 4 GiB reached" in rows[1]
    assert re.search(r"carol\s+00 ·\s+·\s+-\s+03 ✅ ✅ ❌\s+2/3\s+07 ·\s+·\s+·\s+·\s+-\s+2/3", rows[2]), rows[2]
    header = next(l for l in lines if l.startswith("learner"))
    assert header.split() == ["learner", "00", "1", "2", "solved", "03", "3", "4", "5", "solved", "07", "6", "7", "8",
                              "9", "solved", "total", "seconds", "note"]


def test_html_one_row_per_learner_and_a_reteach_row_as_wide_as_its_header(tmp_path):
    html = write_html(_course(), tmp_path / "report.html").read_text(encoding="utf-8")
    grid = html.split("<h2>Learners × exercises</h2>")[1].split("</table>")[0]
    body = grid.split("</tr>", 2)[2]                                       # after the two header rows
    assert [m for m in re.findall(r"<tr><th>(\w+)</th>", body)] == ["alice", "bob", "carol"]
    assert grid.count("colspan='3' class='lab'>lab 00") == 1 and grid.count("colspan='5' class='lab'>lab 07") == 1
    alice = body.split("<tr><th>alice</th>")[1].split("</tr>")[0]
    assert alice.count("<td") == 9 + 3 + 1 and "<b>6/9</b>" in alice and ">1/4</td>" in alice
    carol = body.split("<tr><th>carol</th>")[1].split("</tr>")[0]
    assert carol.count("lab not handed in") == 6 and ">/2</td>" in carol and "<b>2/3</b>" in carol
    reteach = html.split("what to re-teach")[1].split("</table>")[0]
    header, *rows = [r for r in reteach.split("</tr>") if "<t" in r]
    width = header.count("<th>")
    assert width == 1 + 5 + 1 and all(r.count("<td>") + r.count("<th>") == width for r in rows), reteach
    assert len(rows) == 9
