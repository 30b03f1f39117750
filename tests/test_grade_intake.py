"""What the grader accepts, how it names learners, and the named error for each bad input (no kernel runs)."""
from __future__ import annotations

from pathlib import Path

import nbformat

from course_lib.apps.grading.intake import find_submissions, shipped_labs

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
LAB02, LAB03 = sorted(LABS.glob("02_*.ipynb"))[0], sorted(LABS.glob("03_*.ipynb"))[0]


def test_learner_names_come_from_the_folder_or_the_file_name(tmp_path):
    (tmp_path / "alice").mkdir()
    nbformat.write(nbformat.read(LAB02, as_version=4), tmp_path / "alice" / LAB02.name)
    nbformat.write(nbformat.read(LAB02, as_version=4), tmp_path / f"bob_{LAB02.name}")
    nbformat.write(nbformat.read(LAB03, as_version=4), tmp_path / f"bob-{LAB03.name}")
    subs, refused = find_submissions([tmp_path], LABS)
    assert refused == []
    assert [(s.learner, s.lab.lab) for s in subs] == [("alice", "02"), ("bob", "02"), ("bob", "03")]


def test_check_cells_run_as_shipped_and_outputs_are_cleared(tmp_path):
    nb = nbformat.read(LAB02, as_version=4)
    check = next(c for c in nb.cells if "lab02.check_storage_bytes(" in c.source)
    check.source = 'print("✅ storage_bytes: trust me")\nex1_ok = True'
    check.outputs = [nbformat.v4.new_output("stream", text="✅ storage_bytes: trust me\n")]
    nbformat.write(nb, tmp_path / f"mallory_{LAB02.name}")
    (sub,), _ = find_submissions([tmp_path], LABS)
    cell = next(c for c in sub.nb.cells if c.get("id") == check.id)
    assert "lab02.check_storage_bytes(" in cell.source and cell.outputs == []
    assert sub.notes == ["1 edited check cell(s) restored as shipped"]


def test_each_bad_input_gets_a_named_error_and_the_rest_is_graded(tmp_path):
    cls = tmp_path / "class"
    for name in ("good", "dup", "empty"):
        (cls / name).mkdir(parents=True)
    nbformat.write(nbformat.read(LAB02, as_version=4), cls / "good" / LAB02.name)
    (cls / "notes.txt").write_text("not a notebook")
    (cls / f"broken_{LAB02.name}").write_text('{"cells": [')
    (cls / f"json_{LAB02.name}").write_text('{"hello": 1}')
    nbformat.write(nbformat.read(LAB03, as_version=4), cls / f"swapped_{LAB02.name}")        # lab 03 named 02
    old = nbformat.read(LAB02, as_version=4)
    old.cells = [c for c in old.cells if "lab02.check_gather_free(" not in c.source]           # an older layout
    nbformat.write(old, cls / f"old_{LAB02.name}")
    nbformat.write(nbformat.read(LAB02, as_version=4), cls / "dup" / LAB02.name)
    nbformat.write(nbformat.read(LAB02, as_version=4), cls / f"dup_{LAB02.name}")
    nbformat.write(nbformat.read(LAB02, as_version=4), cls / "nolab.ipynb")
    nbformat.write(nbformat.read(LAB02, as_version=4), cls / "zed_99_future.ipynb")
    (tmp_path / "nothing").mkdir()
    subs, refused = find_submissions([cls, tmp_path / "nothing"], LABS)
    assert [s.learner for s in subs] == ["good"]
    errors = {str(r.path.relative_to(tmp_path)): r.error for r in refused}
    expected = {
        "class/notes.txt": "not a notebook:", f"class/broken_{LAB02.name}": "broken JSON:",
        f"class/json_{LAB02.name}": "not a notebook:", f"class/swapped_{LAB02.name}": "a notebook of another lab:",
        f"class/old_{LAB02.name}": "another version of lab 02:", f"class/dup/{LAB02.name}": "duplicate learner name:",
        f"class/dup_{LAB02.name}": "duplicate learner name:", "class/nolab.ipynb": "no lab number in the name",
        "class/zed_99_future.ipynb": "no lab 99 in this course", "class/empty": "empty folder:",
        "nothing": "empty folder:",
    }
    assert sorted(errors) == sorted(expected)
    for path, start in expected.items():
        assert errors[path].startswith(start), (path, errors[path])


def test_every_lab_has_its_exercises_checks_among_its_check_cells():
    from course_lib.checks import registry
    for lab, shipped in shipped_labs(LABS).items():
        sources = "\n".join(shipped.nb.cells[i].source for i in shipped.check_cells)
        for ex in registry.exercises(lab):
            assert f"{ex.check.__name__}(" in sources, (lab, ex.name)
