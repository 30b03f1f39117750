"""The labs as nbgrader source notebooks: their metadata (every lab, fast), and the real nbgrader round trip on
Lab 02 (slow): ``generate_assignment``, then ``autograde`` of two submissions -- the solution (full marks), and one
with a wrong answer, a solved exercise and an untouched one (one mark of three)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_lib.authoring import nbgrader_source, read_notebook, write_nbgrader_sources
from course_lib.checks import registry
from test_labs_wrong_answers import WRONG

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
KEYS = {"solution", "grade", "grade_id", "locked", "schema_version"}


def _graded(nb) -> list:
    return [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")]


def test_every_lab_becomes_a_source_notebook_with_one_graded_cell_per_exercise(tmp_path):
    written = write_nbgrader_sources(SOLUTIONS, tmp_path)
    assert [p.name for p in written] == [p.name for p in sorted(SOLUTIONS.glob("[0-9][0-9]_*.ipynb"))]
    for path in written:
        lab = path.name[:2]
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        ids = [c.metadata.nbgrader["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
        assert len(ids) == len(set(ids)), f"{path.name}: grade ids must be unique"
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader")
            if meta is None:
                continue
            assert KEYS <= set(meta) and meta["schema_version"] == 3
            if meta["solution"]:
                assert "### BEGIN SOLUTION" in cell.source and not meta["locked"]
            if meta["grade"]:
                assert meta["locked"] and meta["points"] == 1 and "\nassert ex" in cell.source
        checks = sorted(c.metadata.nbgrader["grade_id"] for c in _graded(nb))
        assert checks == sorted(f"lab{lab}_{ex.check.__name__}" for ex in registry.exercises(lab)), path.name
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")


def test_two_checks_in_one_cell_is_an_authoring_error():
    from course_lib.authoring import AuthoringError
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("a = lab02.check_x(f)\nb = lab02.check_y(g)")])
    with pytest.raises(AuthoringError, match="give each check its own cell"):
        nbgrader_source(nb, "02")


def _nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    bindir = str(Path(sys.executable).parent)                 # nbgrader runs `alembic` from PATH
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(ROOT),
           "COURSE_LIB_STRICT_CHECKS": "0"}                   # the learner's setting: a check returns False
    result = subprocess.run([sys.executable, "-m", "nbgrader", *args, "--force", "--ExecutePreprocessor.timeout=300"],
                            cwd=course, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_nbgrader_generate_and_autograde_lab02(tmp_path):
    pytest.importorskip("nbgrader")
    from nbgrader.api import Gradebook
    course = tmp_path / "course"
    (course / "source" / "lab02").mkdir(parents=True)
    (course / "nbgrader_config.py").write_text(          # as docs/instructors.md has instructors write it
        'c = get_config()\nc.CourseDirectory.course_id = "fsdp-course"\n'
        "from course_lib.authoring.nbgrader import mirror_no_output_widgets\nmirror_no_output_widgets()\n")
    solution = SOLUTIONS / "02_memory.ipynb"
    source = nbgrader_source(read_notebook(solution), "02")
    nbformat.write(source, course / "source" / "lab02" / solution.name)
    _nbgrader(course, "generate_assignment", "lab02")
    release = nbformat.read(course / "release" / "lab02" / solution.name, as_version=4)
    assert "### BEGIN SOLUTION" not in nbformat.writes(release)

    answers = {c.metadata.nbgrader["grade_id"]: c.source for c in source.cells
               if c.metadata.get("nbgrader", {}).get("solution")}
    wrong = next(src for lab, name, *_, src in WRONG if (lab, name) == ("02", "storage_bytes"))
    # ada hands in the solution; cy one wrong answer, one solved exercise and one left as released (two
    # submissions, not three: each executes the whole lab, and the suite's time is the course's budget)
    cy = {**answers, "lab02_solution_3": wrong}
    del cy[max(answers, key=lambda k: int(k.rsplit("_", 1)[1]))]          # the last exercise: untouched
    for student, replace in (("ada", answers), ("cy", cy)):
        nb = nbformat.read(course / "release" / "lab02" / solution.name, as_version=4)
        for cell in nb.cells:
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in replace:
                cell.source = replace[gid]
        (course / "submitted" / student / "lab02").mkdir(parents=True)
        nbformat.write(nb, course / "submitted" / student / "lab02" / solution.name)
    _nbgrader(course, "autograde", "lab02")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {s: (gb.find_submission("lab02", s).score, gb.find_submission("lab02", s).max_score)
                  for s in ("ada", "cy")}
    assert scores == {"ada": (3.0, 3.0), "cy": (1.0, 3.0)}
    # the config's mirror_no_output_widgets() took effect: the interact cell's picture is an ordinary output
    graded = nbformat.read(course / "autograded" / "ada" / "lab02" / solution.name, as_version=4)
    interact = next(c for c in graded.cells if c.cell_type == "code" and "widgets.interact(" in c.source)
    assert any("image/png" in o.get("data", {}) for o in interact.outputs), interact.outputs
    shutil.rmtree(course / "autograded", ignore_errors=True)
