"""Lab 10's exercise checks: right answers pass, stubs say "not implemented yet", and the cases are what the checks
say they are. The wrong answers, by kind of mistake, are in tests/wrong_answers/lab10.py
(tests/test_wrong_answer_kinds.py runs them against these checks)."""
from __future__ import annotations

import pytest
from exercise_contract import assert_right_passes_and_stub_waits
import torch

from course_lib.checks import lab10
from course_lib.strategies.ep import routing
from course_lib.strategies.pp import schedule


@pytest.mark.parametrize("check, right", [
    (lab10.check_one_f_one_b, lab10.reference_one_f_one_b),
    (lab10.check_bubble_fraction, lab10.reference_bubble_fraction),
    (lab10.check_ring_merge, lab10.reference_ring_merge),
    (lab10.check_dispatch_counts, lab10.reference_dispatch_counts),
], ids=["one_f_one_b", "bubble_fraction", "ring_merge", "dispatch_counts"])
def test_right_answer_passes_and_stub_waits(check, right, capsys):
    assert_right_passes_and_stub_waits(check, right, capsys)


def test_the_one_f_one_b_cases_include_fewer_micro_batches_than_stages_and_one_stage():
    assert any(m < p - 1 for p, m in lab10.ONE_F_ONE_B_CASES) and any(p == 1 for p, _ in lab10.ONE_F_ONE_B_CASES)


def test_the_large_score_merge_case_overflows_a_naive_exp():
    """The case exists to catch weights written as exp(lse): its lse really is past float32's exp range."""
    from course_lib.strategies.cp.torch import block_attention
    q, _, _, ks, vs = lab10._merge_inputs(1)
    _, lse = block_attention(q, ks[0], vs[0])
    assert float(lse.max()) > 89 and torch.isinf(lse.exp()).any()


def test_every_dispatch_case_drops_copies_and_the_first_two_tell_rows_from_columns():
    for k, (_, world, E, _, _, cap, _) in enumerate(lab10.DISPATCH_CASES):
        ids = lab10.dispatch_inputs(k)
        kept = routing.dispatch_matrix(ids, E, world, cap)
        assert sum(map(sum, kept)) < sum(t.numel() for t in ids), f"case {k} drops nothing"
    for k in (0, 1):
        m = routing.dispatch_matrix(lab10.dispatch_inputs(k), lab10.DISPATCH_CASES[k][2], lab10.DISPATCH_CASES[k][1],
                                    lab10.DISPATCH_CASES[k][5])
        assert m != [list(c) for c in zip(*m)]


def test_the_bubble_judge_measures_the_simulated_timeline():
    for p, m in lab10.BUBBLE_CASES:
        assert lab10._measured_bubble(p, m) == pytest.approx(schedule.bubble_fraction(p, m), rel=1e-12)


def test_the_huge_score_merge_case_overflows_exp_even_in_float64():
    """The case exists to catch exp(lse) computed in float64: its lse passes float64's exp range (~709) too."""
    from course_lib.strategies.cp.torch import block_attention
    k = next(i for i, case in enumerate(lab10.MERGE_CASES) if case[0].startswith("huge"))
    q, _, _, ks, vs = lab10._merge_inputs(k)
    _, lse = block_attention(q, ks[0], vs[0])
    assert float(lse.max()) > 709 and torch.isinf(lse.double().exp()).any()


def test_a_wrong_order_is_shown_around_its_first_difference_never_in_full():
    """The ❌ line names the learner's ops near the first difference and the one op 1F1B runs there; the reference's
    whole order would hand out the answer."""
    def cool_down_reversed(stage, p, m):
        ops = lab10.reference_one_f_one_b(stage, p, m)
        w = min(p - stage - 1, m)
        return ops[:len(ops) - w] + ops[len(ops) - w:][::-1]
    with pytest.raises(AssertionError) as err:
        lab10.judge_one_f_one_b(lab10.run_one_f_one_b(cool_down_reversed))
    text = str(err.value)
    assert "your ops" in text and "1F1B runs ('B', 5)" in text
    assert str(lab10.reference_one_f_one_b(0, 4, 8)) not in text and str(lab10.reference_one_f_one_b(0, 4, 8)[:6])[:-1] \
        not in text


def test_the_hints_and_the_overflow_diagnosis_do_not_spell_out_the_merge():
    from course_lib.checks import registry
    said = " ".join(lab10.HINTS["ring_merge"]) + " ".join(registry.find("10", "ring_merge").mistakes.values())
    def overflowing(o_a, lse_a, o_b, lse_b):
        e_a, e_b = lse_a.exp(), lse_b.exp()
        return (e_a[..., None] * o_a + e_b[..., None] * o_b) / (e_a + e_b)[..., None], (e_a + e_b).log()
    with pytest.raises(AssertionError, match="overflow") as err:
        lab10.judge_ring_merge(lab10.run_ring_merge(overflowing))
    said += str(err.value)
    assert "logaddexp" not in said and "lse_a - lse" not in said and "lse_block - lse" not in said


def test_an_endless_order_is_stopped_and_the_trace_function_before_it_is_restored():
    """A ``while`` whose counter never moves once filled 24 GB and killed the kernel: the run half stops it after
    LINE_BUDGET lines (an ``except Exception`` in the loop does not swallow the stop) and puts back the trace function
    that was set (a debugger's, coverage's), on a normal return too."""
    import sys

    def endless(stage, p, m):
        ops = []
        while len(ops) >= 0:
            try:
                ops.append(("F", 0))
            except Exception:
                pass
        return ops

    def tracer(frame, event, arg):
        return None
    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        data = lab10.run_one_f_one_b(endless)
        assert sys.gettrace() is tracer
        lab10.run_one_f_one_b(lab10.reference_one_f_one_b)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(before)
    assert data["endless"] == "stage=0, p=4, m=8"
    with pytest.raises(AssertionError, match="never returned"):
        lab10.judge_one_f_one_b(data)
