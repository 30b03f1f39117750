"""A prediction is the learner's or absent, in every lab (issue: Lab 08 once shipped its predictions filled in and
scored the reference model as "you predicted ...").

Two checks on every lab as shipped, read from its source (no kernel: the labs' untouched runs elsewhere in the suite
assert that nothing was scored; see tests/test_labs_wrong_answers.py and the root conftest.py):

* every variable a "predict" cell declares (a line whose comment says PREDICTION) ships as ``None``;
* every ``checks.prediction(name, predicted, ...)`` scores either such a variable, or a value the lab computed
  from the learner's own exercise, guarded as ``value if <exercise>_ok else None`` (never a reference fallback's).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

from course_lib import checks

LABS = sorted((Path(__file__).resolve().parents[1] / "labs").glob("*.ipynb"))


def _top_level(nb) -> list[tuple[int, ast.AST, str]]:
    """(cell index, top-level statement, its source line) of every code cell."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        src = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        lines = src.splitlines()
        for node in ast.parse(src).body:
            out.append((i, node, lines[node.lineno - 1]))
    return out


def _calls(nb):
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            src = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "prediction" \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "checks":
                    yield i, node


@pytest.mark.parametrize("lab", LABS, ids=[p.name[:2] for p in LABS])
def test_predictions_ship_empty_and_only_the_learners_are_scored(lab):
    nb = nbformat.read(lab, as_version=4)
    assigned: dict[str, list[ast.AST]] = {}
    declared = []
    for i, node, line in _top_level(nb):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned.setdefault(node.targets[0].id, []).append(node.value)
            if re.search(r"#.*prediction", line, re.I):
                declared.append((i, node.targets[0].id, node.value))
    filled = [f"cells[{i}] {name} = {ast.unparse(v)}" for i, name, v in declared
              if not (isinstance(v, ast.Constant) and v.value is None)]
    assert not filled, f"{lab.name}: predictions shipped filled in (a prediction is the learner's): {filled}"
    bad = []
    for i, call in _calls(nb):
        arg = call.args[1] if len(call.args) > 1 else next((k.value for k in call.keywords if k.arg == "predicted"), None)
        if isinstance(arg, ast.Name):
            values = assigned.get(arg.id, [])
            if not values or any(not (isinstance(v, ast.Constant) and v.value is None) for v in values):
                bad.append(f"cells[{i}]: {arg.id} is not a prediction variable shipped as None")
        elif not (isinstance(arg, ast.IfExp) and isinstance(arg.orelse, ast.Constant) and arg.orelse.value is None
                  and isinstance(arg.test, ast.Name) and arg.test.id.endswith("_ok")):
            bad.append(f"cells[{i}]: scores {ast.unparse(arg)!r}, neither the learner's variable nor "
                       "'value if <exercise>_ok else None'")
    assert not bad, f"{lab.name}: " + "; ".join(bad)
    assert declared or not list(_calls(nb)) or lab.name.startswith("08"), f"{lab.name}: no prediction variable found"


def test_a_missing_prediction_scores_nothing_and_says_why(capsys):
    assert checks.prediction("bytes", None, 768, unit="B") is None
    assert checks.prediction("step", None, 71.3, unit="ms", missing="no model of yours yet") is None
    out = capsys.readouterr().out
    assert "🎯 bytes: no prediction written (set it in the cell above before running); measured 768 B." in out
    assert "🎯 step: no model of yours yet; measured 71.3 ms." in out and "you predicted" not in out
    assert checks.prediction("bytes", 750, 768, unit="B") is True
    assert "you predicted 750 B, measured 768 B: 2.3% low — close" in capsys.readouterr().out


def test_every_lab_states_its_run_time_and_the_check_is_an_upper_bound_only():
    """course_lib/authoring/lab_time.py reads each lab's "takes LOW–HIGH min on 2 CPU cores". A run far above the high
    end (beyond a loaded machine's margin) is a failure that says what to do; a run faster than the low end, however
    fast, never is (a fast laptop is not a bug)."""
    from course_lib.authoring import lab_time
    for lab in LABS:
        rng = lab_time.stated_seconds(lab)
        assert rng is not None and 0 < rng[0] < rng[1], f"{lab.name}: no 'takes LOW–HIGH min on 2 CPU cores'"
        lo, hi = rng
        assert lab_time.problem(lab, (lo + hi) / 2) is None
        assert lab_time.problem(lab, 0.01 * lo) is None and lab_time.problem(lab, 0.0) is None     # no floor
        assert lab_time.problem(lab, lab_time.SLOW_MARGIN * hi) is None
        assert "bench labs" in lab_time.problem(lab, 1.01 * lab_time.SLOW_MARGIN * hi)
        assert lab_time.verdict(lab, 0.5 * lo) == "faster" and lab_time.verdict(lab, 2 * hi) == "SLOWER"