"""Lab 06's PyTorch tensor-parallel exercise: the right plan passes (as a tuple or a list) and a stub says "not
implemented yet". Its wrong answers, by kind of mistake, are in tests/wrong_answers/lab06.py."""
from __future__ import annotations

from course_lib.checks import lab06_tp


def right(n_heads, d_ff, tp, nodes, gpus_per_node):
    return lab06_tp.reference_tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node)


def stub(*args):
    raise NotImplementedError("Exercise not done yet: the plan")


def test_the_reference_passes():
    assert lab06_tp.check_tp_plan(right)


def test_a_stub_is_not_implemented(capsys):
    assert not lab06_tp.check_tp_plan(stub)
    assert "⏳ tp_plan: not implemented yet" in capsys.readouterr().out


def test_a_list_is_as_good_as_a_tuple():
    assert lab06_tp.check_tp_plan(lambda *a: list(right(*a)))
