"""Lab 06's PyTorch tensor-parallel exercise: the right plan passes, a stub says "not implemented yet", and each
classic mistake is rejected with its own diagnosis."""
from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from course_lib.checks import CheckFailed, lab06_tp
from course_lib.checks.registry import find


def right(n_heads, d_ff, tp, nodes, gpus_per_node):
    return lab06_tp.reference_tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node)


def with_plan(**change):
    def fn(*args):
        shape, names, plan = right(*args)
        return shape, names, {**plan, **change}
    return fn


def tp_first(n_heads, d_ff, tp, nodes, gpus_per_node):                # TP over the inter-node dim
    shape, names, plan = right(n_heads, d_ff, tp, nodes, gpus_per_node)
    return shape[::-1], names[::-1], plan



def refuses_too_much(n_heads, d_ff, tp, nodes, gpus_per_node):          # tp must be <= 2, says it
    if tp > 2:
        raise ValueError("tp > 2")
    return right(n_heads, d_ff, tp, nodes, gpus_per_node)


def no_node_check(n_heads, d_ff, tp, nodes, gpus_per_node):             # only divisibility by heads and d_ff
    from torch.distributed.tensor.parallel import ColwiseParallel as C, RowwiseParallel as R
    if n_heads % tp or d_ff % tp:
        raise ValueError("no")
    plan = {m: C() for m in lab06_tp.COLUMN} | {m: R() for m in lab06_tp.ROW}
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan


def stub(*args):
    raise NotImplementedError("Exercise not done yet: the plan")


def test_the_reference_passes():
    assert lab06_tp.check_tp_plan(right)


def test_a_stub_is_not_implemented(capsys):
    assert not lab06_tp.check_tp_plan(stub)
    assert "⏳ tp_plan: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn,tag", [
    (with_plan(**{"mlp.fc": RowwiseParallel()}), "row-wise where column-wise belongs"),
    (with_plan(**{"attn.v": RowwiseParallel()}), "row-wise where column-wise belongs"),
    (with_plan(**{"mlp.proj": ColwiseParallel()}), "column-wise where row-wise belongs"),
    (with_plan(**{"mlp.fc": ColwiseParallel(output_layouts=Replicate())}), "layouts that do not chain"),
    (with_plan(**{"attn.q": ColwiseParallel(use_local_output=False)}), "layouts that do not chain"),
    (tp_first, "TP over the inter-node link"),
    (no_node_check, "TP over the inter-node link"),
])
def test_each_classic_mistake_is_named(fn, tag):
    ex = find("06", "tp_plan")
    with pytest.raises(CheckFailed) as err:
        lab06_tp.check_tp_plan(fn)
    assert ex.diagnosis(str(err.value)) == tag, str(err.value)


def test_heads_not_divisible_must_be_refused():
    def accepts_anything(n_heads, d_ff, tp, nodes, gpus_per_node):
        return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), right(6, 198, 1, 1, 1)[2]
    with pytest.raises(CheckFailed, match=r"n_heads\(6\) % tp\(4\) = 2: each rank must compute whole heads"):
        lab06_tp.check_tp_plan(accepts_anything)


def test_refusing_a_layout_that_works_is_wrong():
    with pytest.raises(CheckFailed, match="raised ValueError.*but this layout works"):
        lab06_tp.check_tp_plan(refuses_too_much)


def test_a_missing_entry_is_named():
    def fn(*args):
        shape, names, plan = right(*args)
        plan.pop("attn.k")
        return shape, names, plan
    with pytest.raises(CheckFailed, match=r"no entry for \['attn.k'\]"):
        lab06_tp.check_tp_plan(fn)


def test_forgetting_only_the_heads_is_caught():
    def no_heads(n_heads, d_ff, tp, nodes, gpus_per_node):
        if d_ff % tp or gpus_per_node % tp:
            raise ValueError("no")
        return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), right(6, 198, 1, 1, 1)[2]
    with pytest.raises(CheckFailed, match=r"n_heads\(6\) % tp\(4\) = 2"):
        lab06_tp.check_tp_plan(no_heads)


def test_a_refusal_of_the_wrong_kind_says_valueerror_is_expected():
    def asserts(n_heads, d_ff, tp, nodes, gpus_per_node):
        assert n_heads % tp == 0 and d_ff % tp == 0 and gpus_per_node % tp == 0, "tp must divide"
        return right(n_heads, d_ff, tp, nodes, gpus_per_node)
    with pytest.raises(CheckFailed, match=r"raised AssertionError\(tp must divide\); .* expects ValueError"):
        lab06_tp.check_tp_plan(asserts)


def test_a_list_is_as_good_as_a_tuple():
    assert lab06_tp.check_tp_plan(lambda *a: list(right(*a)))
