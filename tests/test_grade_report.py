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
