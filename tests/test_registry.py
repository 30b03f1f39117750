"""The exercise registry: every check declared once, and what notebooks, tests and grading read from it."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_lib import checks
from course_lib.checks import registry

ROOT = Path(__file__).resolve().parent.parent


def _notebook(folder: str, lab: str):
    (path,) = sorted((ROOT / folder).glob(f"{lab}_*.ipynb"))
    return nbformat.read(path, as_version=4)


def test_every_lab_declares_its_exercises():
    labs = sorted({p.name[:2] for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")})
    declared = sorted({e.lab for e in registry.exercises()})
    assert declared == labs, f"labs without declared exercises: {sorted(set(labs) - set(declared))}"


@pytest.mark.parametrize("folder", ["solutions", "labs"])
def test_every_exercise_has_exactly_one_cell_and_its_check_is_called(folder):
    problems = []
    for ex in registry.exercises():
        nb = _notebook(folder, ex.lab)
        code = [c.source for c in nb.cells if c.cell_type == "code"]
        cells = [s for s in code if ex.cell in s]
        if len(cells) != 1:
            problems.append(f"{folder}/{ex.lab} {ex.name}: {ex.cell!r} in {len(cells)} cells")
        elif folder == "labs" and "NotImplementedError" not in cells[0]:
            problems.append(f"labs/{ex.lab} {ex.name}: the cell is not a stub")
        if not any(f"{ex.check.__name__}(" in s for s in code):
            problems.append(f"{folder}/{ex.lab} {ex.name}: {ex.check.__name__} is never called")
    assert problems == []


def test_hints_come_from_the_declaration():
    ex = registry.find("03", "flat_shard")
    assert checks.core.hint_text("flat_shard").endswith(ex.hints[0] + '\n   (more: checks.hint("flat_shard", 2))')
    assert ex.check.exercise is ex


def test_a_name_declared_twice_is_refused():
    def check_a(fn):
        return True

    def check_b(fn):
        return True
    registry.exercise("99", "twice", cell="def x(", hints=["idea"])(check_a)
    with pytest.raises(ValueError, match="declared twice"):
        registry.exercise("99", "twice", cell="def x(", hints=["idea"])(check_b)
    registry._REGISTRY.pop(("99", "twice"))


def test_bad_declarations_name_the_field():
    with pytest.raises(ValueError, match="two digits"):
        registry.exercise("3", "x", cell="def x(", hints=["idea"])(lambda: None)
    with pytest.raises(ValueError, match="hints"):
        registry.exercise("03", "x", cell="def x(", hints=[])(lambda: None)
    with pytest.raises(KeyError, match="its exercises: flat_shard"):
        registry.find("03", "flat_shards")


def test_verdict_reads_the_last_line_of_a_check():
    ex = registry.find("03", "flat_shard")
    assert registry.verdict(ex, "hello") == ("not run", None)
    assert registry.verdict(ex, "⏳ flat_shard: not implemented yet — ...") == ("not attempted", None)
    wrong = "❌ flat_shard: rank 1 ...\n   likely mistake: pad the flat buffer with zeros at the end"
    assert registry.verdict(ex, wrong) == ("wrong", "no padding")
    assert registry.verdict(ex, wrong + "\n✅ flat_shard: six layouts") == ("solved", None)
    assert registry.verdict(ex, "❌ flat_shard: something new") == ("wrong", None)


def test_kill_table_counts_per_exercise_and_marks_what_passed():
    a, b = registry.find("03", "flat_shard"), registry.find("03", "Unshard")
    table = registry.kill_table([(a, "boundary", True), (a, "dim", False), (b, "cost", True)])
    rows = table.splitlines()[2:]
    assert rows[0].split()[:4] == ["03", "Unshard", "1", "1"]
    assert rows[1].split()[:4] == ["03", "flat_shard", "2", "1"] and "dim ✗" in rows[1]
