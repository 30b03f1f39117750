"""``python -m course_lib grade`` on a class folder: every kind of submission gets its verdict, in time, and
nothing is left running.

The reports stay in ``test-artifacts/grade/``. The class (Lab 02, the quickest lab): bob solved
``sharded_step``, counts views twice in ``storage_bytes`` (a wrong answer of tests/test_labs_wrong_answers.py) and
left ``gather / free`` as shipped; dave's ``storage_bytes`` raises and his notebook kills its kernel further down;
ann's ``storage_bytes`` never returns, and she left the rest as shipped; erin's file is broken JSON. Run through the
real command line, two at a time, as an instructor would. (Three notebooks run: each one executes the whole lab,
and the suite's time is the course's budget; every verdict is still met at least once. The grader takes the class
in name order, so ann's, the longest, waits out its cell limit beside bob's and dave's, not alone at the end.)
"""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from test_labs_wrong_answers import WRONG

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "02_memory.ipynb"
SOLUTION = ROOT / "solutions" / "02_memory.ipynb"
CELL_S, NOTEBOOK_S = 20, 240     # generous: the machine may be busy (a lab cell takes < 2 s when idle)
ARTIFACTS = ROOT / "test-artifacts" / "grade"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _lab() -> nbformat.NotebookNode:
    return nbformat.read(LAB, as_version=4)


def _solved() -> nbformat.NotebookNode:
    """The lab with every stub filled in by the solution's code, as a learner would hand it in."""
    nb, sol = _lab(), nbformat.read(SOLUTION, as_version=4)
    for cell, ref in zip(nb.cells, sol.cells, strict=True):
        if "NotImplementedError(\"Exercise not done yet" in cell.source:
            cell.source = ref.source
    return nb


def _with(nb, marker: str, source: str) -> nbformat.NotebookNode:
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    cell.source = source
    return nb


MARK = f"COURSE_LIB_TEST_GRADE_{os.getpid()}"     # in the grader's environment, so in every kernel's


def _ours() -> list[int]:
    """Processes started by this test's grader (they inherit MARK), except the test process itself."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and MARK in p.environ():
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    cls = tmp_path_factory.mktemp("class")
    wrong = next(src for lab, name, *_, src in WRONG if (lab, name) == ("02", "storage_bytes"))
    untouched_gather = next(c.source for c in _lab().cells if c.cell_type == "code" and "def gather(" in c.source)
    notebooks = {
        "bob": _with(_with(_solved(), "def storage_bytes(", wrong), "def gather(", untouched_gather),
        "dave": _with(_with(_lab(), "def storage_bytes(", "def storage_bytes(tensors):\n    return 1 // 0\n"),
                      "def gather(", "import os\nos._exit(3)   # the kernel dies here\n"),
        "ann": _with(_lab(), "def storage_bytes(", "def storage_bytes(tensors):\n    import time\n    while True:\n        time.sleep(0.05)\n"),
    }
    for learner, nb in notebooks.items():
        (cls / learner).mkdir()
        nbformat.write(nb, cls / learner / LAB.name)
    (cls / "erin").mkdir()
    (cls / "erin" / LAB.name).write_text(LAB.read_text()[:5000])            # cut short: broken JSON
    out = ARTIFACTS                                                     # kept: the reports to look at
    shutil.rmtree(out, ignore_errors=True)
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(cls), "--out", str(out), "--jobs", "2",
                             "--cell-timeout", str(CELL_S), "--timeout", str(NOTEBOOK_S)],
                            cwd=ROOT, capture_output=True, text=True, timeout=850,
                            env={**os.environ, "PYTHONPATH": str(ROOT), MARK: "1"})
    seconds = time.monotonic() - start
    rows = list(csv.DictReader(open(out / "grades.csv", encoding="utf-8")))
    return result, seconds, rows, out


def _verdicts(rows, learner):
    return {r["item"]: (r["verdict"], r["mistake"]) for r in rows if r["learner"] == learner and r["kind"] == "exercise"}


def test_each_submission_gets_its_verdicts(graded):
    result, _, rows, _ = graded
    assert result.returncode == 1, result.stdout + result.stderr          # 1: a file was refused (erin)
    assert _verdicts(rows, "bob") == {"storage_bytes": ("wrong", "views counted twice"),
                                      "sharded_step": ("solved", ""), "gather / free": ("not attempted", "")}
    dave = {r["item"]: r for r in rows if r["learner"] == "dave" and r["kind"] == "exercise"}
    assert dave["storage_bytes"]["verdict"] == "crashed" and "ZeroDivisionError" in dave["storage_bytes"]["detail"]
    assert dave["gather / free"]["verdict"] == "crashed" and "kernel died" in dave["gather / free"]["detail"]
    ann = {r["item"]: r for r in rows if r["learner"] == "ann" and r["kind"] == "exercise"}
    assert ann["storage_bytes"]["verdict"] == "crashed"
    # her own cell's timeout, or (on a loaded machine) the set-up cell's before it: either way a cell limit, named
    assert "CellTimeout" in ann["storage_bytes"]["detail"] or "cell limit" in ann["storage_bytes"]["detail"]
    assert ann["sharded_step"]["verdict"] == "not attempted"           # the lab went on after the interrupt
    (erin,) = [r for r in rows if r["learner"] == "erin"]
    assert erin["kind"] == "error" and erin["detail"].startswith("broken JSON")
    assert "ERROR" in result.stdout and "broken JSON" in result.stdout and "💥" in result.stdout


def test_predictions_are_reported(graded):
    _, _, rows, _ = graded
    preds = [r for r in rows if r["learner"] == "bob" and r["kind"] == "prediction"]
    assert [(r["item"], r["verdict"]) for r in preds] == [("model state after one Adam step", "none")]


def test_within_the_limits_and_nothing_left_running(graded):
    _, seconds, rows, _ = graded
    assert seconds < 2 * NOTEBOOK_S + 60, seconds
    ann = next(r for r in rows if r["learner"] == "ann")
    assert float(ann["seconds"]) < NOTEBOOK_S
    alive = [r for r in rows if r["kind"] == "exercise" and r["learner"] != "dave"]    # dave's kernel died
    assert all(int(r["processes"]) >= 2 for r in alive)      # counted: the kernel and at least its fork server
    assert _ours() == []


def test_both_reports_are_written(graded):
    _, _, _, out = graded
    html = (out / "report.html").read_text(encoding="utf-8")
    for needle in ("bob", "ann", "views counted twice", "broken JSON", "storage_bytes", "what to re-teach"):
        assert needle in html
    assert "<script" not in html and "http" not in html                    # self-contained
    assert sorted(p.name for p in (out / "notebooks").iterdir()) == [f"{n}_{LAB.name}" for n in
                                                                     ("ann", "bob", "dave")]
