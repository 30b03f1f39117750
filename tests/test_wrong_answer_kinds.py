"""Every check catches every kind of classic mistake that applies to it, and names the cause: one test.

The catalogue (``tests/wrong_answers/labNN.py``) holds a learner's classic mistakes written as code. Each is
run here against its check exactly as the lab's check cell calls it, in lab mode (``COURSE_LIB_STRICT_CHECKS=0``,
as a learner runs it): the check must return False, print its ❌ line with the diagnosis the exercise registry
declares for that mistake, and never let a traceback through. Each exercise declares the kinds of mistake it
guards (:data:`course_lib.checks.registry.KINDS`); the catalogue must hold one wrong answer of each.

The same modules' ``RIGHT`` lists hold valid alternatives written another way than the reference: each must pass
its check (a check that rejects them stops a learner who was right).

``pytest tests/test_wrong_answer_kinds.py -p no:xdist -s`` prints the kill table: per exercise, the wrong answers
tried and rejected, by kind.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from course_lib.checks import registry

HERE = Path(__file__).resolve().parent / "wrong_answers"
sys.path.insert(0, str(HERE.parent))     # `from wrong_answers import Wrong` in the catalogue modules


def _catalogue() -> tuple[list, list]:
    found, right = [], []
    for path in sorted(HERE.glob("lab*.py")):
        spec = importlib.util.spec_from_file_location(f"wrong_answers_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found += module.WRONG
        right += getattr(module, "RIGHT", [])
    return found, right


CATALOGUE, RIGHT = _catalogue()
RESULTS: list = []        # (exercise, kind, rejected) of the answers run so far, for the kill table


def _namespace() -> dict:
    """What a lab's kernel holds when the learner's cell runs: the course's check modules and the usual imports.
    ``__main__``, as in a notebook, so that the answer travels to the ranks by value (cloudpickle)."""
    import math

    import numpy as np
    import torch

    from course_lib import checks
    from course_lib.checks import (lab00, lab01, lab02, lab03, lab04, lab04_grads, lab05, lab06, lab06_tp, lab07, lab08,
                                   lab09, lab10)
    ns = {"__name__": "__main__", "math": math, "np": np, "torch": torch, "checks": checks}
    ns.update({m.__name__.rsplit(".", 1)[1]: m for m in (lab00, lab01, lab02, lab03, lab04, lab04_grads, lab05, lab06,
                                                           lab06_tp, lab07, lab08, lab09, lab10)})
    return ns


def test_the_catalogue_is_well_formed():
    for w in CATALOGUE:
        ex = registry.find(w.lab, w.exercise)
        assert w.kind in registry.KINDS, f"{w.lab}/{w.exercise}: kind {w.kind!r} is not one of {sorted(registry.KINDS)}"
        assert w.kind in ex.guards, f"{w.lab}/{w.exercise}: a {w.kind!r} mistake, but the exercise guards only {ex.guards}"
        assert w.tag in ex.mistakes, f"{w.lab}/{w.exercise}: {w.tag!r} is not among its declared mistakes {sorted(ex.mistakes)}"
        assert w.call.split("(")[0].split(".")[-1] == ex.check.__name__, \
            f"{w.lab}/{w.exercise}: the call {w.call!r} does not call its check {ex.check.__name__}"


def test_every_exercise_has_a_wrong_answer_of_each_kind_it_guards():
    have = {(w.lab, w.exercise, w.kind) for w in CATALOGUE}
    missing = [f"{e.lab}/{e.name}: {k}" for e in registry.exercises() for k in e.guards if (e.lab, e.name, k) not in have]
    assert not missing, "no wrong answer in tests/wrong_answers/ of these kinds:\n  " + "\n  ".join(missing)


@pytest.mark.parametrize("w", CATALOGUE, ids=[f"{w.lab}-{w.exercise}-{w.kind}-{w.tag}" for w in CATALOGUE])
def test_a_wrong_answer_is_rejected_with_its_diagnosis(w, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")       # lab mode: ❌ and fall back, never raise
    ex = registry.find(w.lab, w.exercise)
    ns = _namespace()
    cell = tmp_path / "ipykernel_0" / f"{w.lab}_{w.exercise.replace(' ', '').replace('/', '_')}.py"
    cell.parent.mkdir()
    cell.write_text(w.source)     # as ipykernel does: a cell is a file, so tracebacks (on ranks too) show its lines
    exec(compile(w.source, str(cell), "exec"), ns)
    rejected = False
    try:
        result = eval(compile(w.call, f"<cell {w.lab}/{w.exercise} check>", "eval"), ns)
        out = capsys.readouterr().out
        assert result is False, f"{w.lab}/{w.exercise} ({w.why}): the check returned {result!r}:\n{out}"
        line = next((l for l in out.splitlines() if l.startswith(f"❌ {ex.name}:")), None)
        assert line is not None, f"{w.lab}/{w.exercise} ({w.why}): no '❌ {ex.name}:' line in:\n{out}"
        block = out[out.index(line):]
        assert "Traceback" not in block, f"{w.lab}/{w.exercise}: a traceback in the ❌ block:\n{block}"
        if "your code raised" in line:      # a crash is named: the call, the line, and its likely cause
            assert "likely cause:" in block.split("\n   The rest of the lab")[0], \
                f"{w.lab}/{w.exercise} ({w.why}): a raw exception, no likely cause named:\n{block}"
        for s in (ex.mistakes[w.tag], *w.more):
            assert s in block, f"{w.lab}/{w.exercise} ({w.why}): {s!r} not in\n{block}"
        assert registry.verdict(ex, out) == ("wrong", w.tag), \
            f"{w.lab}/{w.exercise} ({w.why}): diagnosed as {registry.verdict(ex, out)}, not {w.tag!r}:\n{block}"
        rejected = True
    finally:
        RESULTS.append((ex, w.kind, rejected))


@pytest.mark.parametrize("a", RIGHT, ids=[f"{a.lab}-{a.exercise}-right-{i}" for i, a in enumerate(RIGHT)])
def test_a_valid_alternative_is_accepted(a, monkeypatch, capsys, tmp_path):
    """No false rejections: an answer written another way than the reference, but right, passes its check."""
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")
    ex = registry.find(a.lab, a.exercise)
    ns = _namespace()
    cell = tmp_path / "ipykernel_0" / f"{a.lab}_{a.exercise.replace(' ', '').replace('/', '_')}_right.py"
    cell.parent.mkdir()
    cell.write_text(a.source)
    exec(compile(a.source, str(cell), "exec"), ns)
    result = eval(compile(a.call, f"<cell {a.lab}/{a.exercise} check>", "eval"), ns)
    out = capsys.readouterr().out
    assert result is True and registry.verdict(ex, out) == ("solved", None), f"{a.lab}/{a.exercise} ({a.why}):\n{out}"


def test_zz_kill_table():
    """Printed with ``-s`` (the closing note's table); the assertions are the test above's."""
    if RESULTS:
        print("\n" + registry.kill_table(RESULTS))
