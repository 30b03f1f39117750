"""Authoring: make-labs, validate and run-solutions, on fixture notebooks (tests/fixtures/)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from course_lib import authoring
from course_lib.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
SMOKE = ROOT / "tests" / "fixtures" / "smoke" / "00_smoke.ipynb"
HEADER = "# 07 · Title\n\n**Objectives**\n- one thing\n\n**Time:** ~30 min"


def notebook(*cells, header=HEADER) -> nbformat.NotebookNode:
    """A solution notebook: header, setup cell printing the banner, then ``cells`` (code strings)."""
    nb = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                               "language": "python"}})
    nb.cells = [new_markdown_cell(header), new_code_cell("import course_lib\nprint(course_lib.banner())")]
    nb.cells += [c if isinstance(c, dict) else new_code_cell(c) for c in cells]
    return nb


def write(folder: Path, name: str, nb) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(nbformat.writes(nb), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------- stubs
def test_region_becomes_stub_at_its_indentation_with_the_hint():
    src = ("def f(x):\n"
           "    if x:\n"
           "        ### BEGIN SOLUTION\n"
           "        ### HINT: return \"twice\" x\n"
           "        return 2 * x\n"
           "        ### END SOLUTION\n"
           "    return 0")
    assert authoring.transform_source(src) == (
        "def f(x):\n"
        "    if x:\n"
        "        # YOUR CODE HERE\n"
        '        raise NotImplementedError("Exercise not done yet: return \\"twice\\" x")\n'
        "    return 0")


def test_default_hint_and_tab_indentation():
    src = "def f():\n\t### BEGIN SOLUTION\n\treturn 1\n\t### END SOLUTION"
    out = authoring.transform_source(src)
    assert out == ("def f():\n\t# YOUR CODE HERE\n"
                   f'\traise NotImplementedError("Exercise not done yet: {authoring.DEFAULT_HINT}")')
    exec(compile(out, "<lab>", "exec"), {})          # the stub is valid Python


def test_hidden_region_is_removed_and_markdown_region_answered():
    src = "x = 1\n### BEGIN HIDDEN\nassert x == 1\n### END HIDDEN\nprint(x)"
    assert authoring.transform_source(src) == "x = 1\nprint(x)"
    md = "Why?\n### BEGIN SOLUTION\nBecause.\n### END SOLUTION"
    assert authoring.transform_source(md, markdown=True) == "Why?\nYOUR ANSWER HERE"


@pytest.mark.parametrize("src, message", [
    ("def f():\n    ### BEGIN SOLUTION\n    return 1", "line 2: '### BEGIN SOLUTION' is never closed"),
    ("def f():\n    return 1\n    ### END SOLUTION", "line 3: '### END SOLUTION' without a matching BEGIN"),
    ("def f():\n  ### BEGIN SOLUTION\n  ### BEGIN HIDDEN\n  ### END HIDDEN\n  ### END SOLUTION", "no nesting"),
])
def test_unmatched_or_nested_markers_are_errors(src, message):
    with pytest.raises(authoring.AuthoringError, match=message):
        authoring.transform_source(src)


def test_top_level_region_is_rejected_with_file_cell_and_line(tmp_path, capsys):
    write(tmp_path / "solutions", "01_dp.ipynb",
          notebook("import numpy as np\n### BEGIN SOLUTION\ny = np.ones(3)\n### END SOLUTION"))
    assert main(["make-labs", "--src", str(tmp_path / "solutions"), "--dst", str(tmp_path / "labs")]) == 2
    err = capsys.readouterr().err
    assert "01_dp.ipynb cells[2] line 2" in err and "indentation 0" in err
    assert not (tmp_path / "labs").exists()


# ----------------------------------------------------------------------------------- make-labs
@pytest.fixture
def course(tmp_path):
    """tmp/solutions with the smoke notebook; tmp/labs derived from it."""
    (tmp_path / "solutions").mkdir()
    shutil.copy(SMOKE, tmp_path / "solutions" / SMOKE.name)
    args = ["--src", str(tmp_path / "solutions"), "--dst", str(tmp_path / "labs")]
    assert main(["make-labs", *args]) == 0
    return tmp_path, args


def test_lab_has_stub_no_solution_no_hidden_no_outputs(course):
    tmp, _ = course
    sol = nbformat.read(tmp / "solutions" / SMOKE.name, as_version=4)
    lab = nbformat.read(tmp / "labs" / SMOKE.name, as_version=4)
    text = (tmp / "labs" / SMOKE.name).read_text()
    assert "### BEGIN" not in text and "total = sum(grads)" not in text and "assert average(" not in text
    assert ('    # YOUR CODE HERE\n    raise NotImplementedError("Exercise not done yet: add the per-rank '
            'arrays, then divide by how many there are")') in lab.cells[3].source
    assert [c.id for c in lab.cells] == [c.id for c in sol.cells]
    assert lab.cells[1].metadata["tags"] == ["setup"]
    for cell in lab.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    nbformat.validate(lab)


def test_make_labs_is_idempotent_and_byte_identical_across_processes(course, capsys):
    tmp, args = course
    lab = tmp / "labs" / SMOKE.name
    first = lab.read_bytes()
    capsys.readouterr()
    assert main(["make-labs", *args]) == 0
    assert "0 lab(s) written" in capsys.readouterr().out
    lab.unlink()
    subprocess.run([sys.executable, "-m", "course_lib", "make-labs", *args], check=True, capture_output=True)
    assert lab.read_bytes() == first


def test_cells_without_ids_get_stable_ids(tmp_path, monkeypatch):
    nb = notebook("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION")
    nb.nbformat_minor = 4
    for cell in nb.cells:
        del cell["id"]
    path = write(tmp_path / "solutions", "02_memory.ipynb", nb)
    first = authoring.lab_text(path)
    monkeypatch.chdir(tmp_path / "solutions")           # a different cwd gives the same bytes
    assert authoring.lab_text(Path(path.name)) == first
    lab = nbformat.reads(first, as_version=4)
    nbformat.validate(lab)
    assert lab.nbformat_minor >= 5 and len({c.id for c in lab.cells}) == len(lab.cells)


def test_check_detects_stale_missing_and_orphan_labs(course, capsys):
    tmp, args = course
    assert main(["make-labs", "--check", *args]) == 0
    sol = tmp / "solutions" / SMOKE.name
    nb = nbformat.read(sol, as_version=4)
    nb.cells[2].source += " (edited)"
    nbformat.write(nb, sol)
    shutil.copy(tmp / "labs" / SMOKE.name, tmp / "labs" / "09_orphan.ipynb")
    capsys.readouterr()
    assert main(["make-labs", "--check", *args]) == 1
    out = capsys.readouterr().out
    assert "00_smoke.ipynb: out of date" in out and "09_orphan.ipynb: no solution" in out
    (tmp / "labs" / SMOKE.name).unlink()
    assert main(["make-labs", "--check", *args]) == 1
    assert "00_smoke.ipynb: missing" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ validate
def test_validate_accepts_the_smoke_notebook():
    assert authoring.validate_notebook(SMOKE) == []


@pytest.mark.parametrize("header, expected", [
    ("# 01 · DP\n\n**Time:** ~30 min", "needs an 'Objectives' list"),
    ("# 01 · DP\n\n**Objectives**\n- a\n", "needs a time estimate"),
    ("# 01 · DP\n\n**Objectives**\n- a\n\nTime: 2 min", "implausible"),
    ("DP\n\n**Objectives**\n- a\n\nTime: 20 min", "'# Title' heading"),
])
def test_validate_catches_a_bad_header(tmp_path, header, expected):
    path = write(tmp_path, "01_dp.ipynb", notebook(header=header))
    problems = authoring.validate_notebook(path)
    assert any(expected in p for p in problems), problems


def test_validate_catches_kernel_banner_name_and_markers(tmp_path, capsys):
    nb = notebook("def f():\n    ### BEGIN SOLUTION\n    pass")
    nb.metadata.kernelspec.name = "julia"
    nb.cells[1].source = "import numpy"
    write(tmp_path, "dp.ipynb", nb)
    assert main(["validate", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for expected in ("kernelspec.name must be 'python3'", "print course_lib.banner()", "NN_name.ipynb",
                     "cells[2] line 2: '### BEGIN SOLUTION' is never closed"):
        assert expected in out


# ------------------------------------------------------------------------------- run-solutions
def test_parse_banner():
    line = "course_lib runtime: backend=gloo ranks=4 torch=2.13.0+cpu jax_devices=8xcpu simulated"
    assert authoring.parse_banner(line) == ("gloo x4", "CPU, jax 8xcpu simulated")
    assert authoring.parse_banner("course_lib runtime: backend=nccl ranks=8 torch=2.11 gpus=8") == \
        ("nccl x8", "8 GPU")


def test_run_solutions_ok_prints_the_table(tmp_path, capsys):
    shutil.copy(SMOKE, tmp_path / SMOKE.name)
    assert main(["run-solutions", "--dir", str(tmp_path), "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "00_smoke.ipynb" in line)
    assert " ok " in row and "gloo x4" in row and "jax 8xcpu simulated" in row
    assert out.splitlines()[0].split() == ["notebook", "status", "seconds", "backend", "devices"]
    assert "1 ok, 0 failed" in out


def test_run_solutions_failure_names_cell_and_error_and_exits_nonzero(tmp_path, capsys):
    write(tmp_path, "01_broken.ipynb", notebook("x = 1", "raise ValueError('boom\\nmore')"))
    nb = nbformat.read(tmp_path / "01_broken.ipynb", as_version=4)
    nb.cells[1].source = "print('no banner here')"
    nbformat.write(nb, tmp_path / "01_broken.ipynb")
    write(tmp_path, "02_other.ipynb", notebook("x = 1"))
    assert main(["run-solutions", "--dir", str(tmp_path), "--pattern", "01_*.ipynb", "--timeout", "60"]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "01_broken.ipynb" in line)
    assert "FAILED cells[3]: ValueError: boom" in row and "more" not in row
    assert row.split()[-2:] == ["-", "-"]             # no banner line: backend and devices unknown
    assert "02_other" not in out and "0 ok, 1 failed" in out


def test_run_solutions_write_refreshes_outputs_only_when_every_cell_ran(tmp_path, capsys):
    write(tmp_path, "01_good.ipynb", notebook("print(6 * 7)"))
    write(tmp_path, "02_bad.ipynb", notebook("print(6 * 7)", "raise ValueError('boom')"))
    before = (tmp_path / "02_bad.ipynb").read_text()
    assert main(["run-solutions", "--dir", str(tmp_path), "--timeout", "60", "--write"]) == 1
    good = nbformat.read(tmp_path / "01_good.ipynb", as_version=4)
    printed = [o.get("text", "") for c in good.cells if c.cell_type == "code" for o in c.outputs]
    assert "42\n" in printed and all(c.execution_count for c in good.cells if c.cell_type == "code")
    assert (tmp_path / "02_bad.ipynb").read_text() == before      # a failing run writes nothing
    assert "1 ok, 1 failed" in capsys.readouterr().out


def test_run_solutions_with_nothing_to_run_fails(tmp_path, capsys):
    assert main(["run-solutions", "--dir", str(tmp_path)]) == 1
    assert "nothing ran" in capsys.readouterr().err


# -------------------------------------------------------------------------------- CLI plumbing
def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "course_lib", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in ("make-labs", "validate", "run-solutions", "doctor", "bench"):
        assert name in out


def test_bench_runs_without_the_notebook_tools():
    """A machine with torch but no nbformat (a GPU box's own image, where `bench gpu-mfu` is run): every verb but
    grade and site still parses and runs; those two say in one line what is missing and how to fix it."""
    code = ("import sys; sys.modules['nbformat'] = None\n"   # as if nbformat were not installed
            "from course_lib.apps import cli\n"
            "assert cli.main(['bench', 'no_such_thing']) == 2\n"
            "assert cli.main(['grade', 'class/']) == 2\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "no benchmark 'no_such_thing'" in out.stderr
    assert "course_lib grade: needs the Python package nbformat, which is not installed here. Fix: `make install`" \
        in out.stderr


def test_bench_unknown_lists_the_available_ones(capsys):
    assert main(["bench", "no_such_thing"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no_such_thing'" in err and "Available:" in err


def test_no_solution_shows_a_stray_value():
    """A cell whose last line is a check or a widget call shows its return value (True, <function ...>) under the
    output the learner reads: assign it (`_ = ...`). Read from every solution's stored outputs."""
    import glob

    import nbformat
    stray = []
    for path in sorted(glob.glob(str(Path(__file__).resolve().parents[1] / "solutions" / "*.ipynb"))):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                text = out.get("data", {}).get("text/plain", "") if out.get("output_type") == "execute_result" else ""
                if text in ("True", "False", "None") or text.startswith("<function "):
                    stray.append(f"{Path(path).name} cell {i}: {text[:40]}")
    assert stray == [], f"stray values shown: {stray}"


@pytest.mark.parametrize("folder", ["labs", "solutions"])
def test_a_lab_downloaded_alone_says_what_it_needs(folder):
    """A learner who downloads one .ipynb (from the site) has no course_lib: the setup cell must stop with one
    sentence that names the repository and `make lab`, not a bare "No module named 'course_lib'"."""
    import sys as _sys
    import nbformat as _nbf
    for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
        nb = _nbf.read(path, as_version=4)
        cell = next(c for c in nb.cells if c.cell_type == "code" and "import course_lib" in c.source)
        head = cell.source.split("import course_lib")[0] + "import course_lib" + \
            cell.source.split("import course_lib")[1].split(") from None")[0] + ") from None"
        saved = _sys.modules.get("course_lib")
        _sys.modules["course_lib"] = None          # what a machine without the repository sees
        try:
            with pytest.raises(ModuleNotFoundError) as err:
                exec(compile(head, str(path), "exec"), {})
        finally:
            _sys.modules["course_lib"] = saved
        assert "course's repository" in str(err.value) and "make lab" in str(err.value), path.name
