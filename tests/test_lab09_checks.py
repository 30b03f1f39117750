"""Lab 09's exercise checks: right answers pass, stubs say "not implemented yet", and the fixed cases are what
the checks say they are. The wrong answers, by kind of mistake, are in tests/wrong_answers/lab09.py
(tests/test_wrong_answer_kinds.py runs them against these checks)."""
from __future__ import annotations

import pytest
from exercise_contract import assert_right_passes_and_stub_waits

from course_lib.checks import lab09


@pytest.mark.parametrize("check, right", [
    (lab09.check_hang_report, lab09.reference_hang_report),
    (lab09.check_first_nonfinite, lab09.reference_first_nonfinite),
    (lab09.check_spec_fix, lab09.reference_spec_fix),
    (lab09.check_diverged_ranks, lab09.reference_diverged_ranks),
], ids=["hang_report", "first_nonfinite", "spec_fix", "diverged_ranks"])
def test_right_answer_passes_and_stub_waits(check, right, capsys):
    assert_right_passes_and_stub_waits(check, right, capsys)


def test_hang_cases_read_as_the_launcher_formats_stacks():
    """The cases' stacks parse with the launcher's own reader (outermost first) when it is there."""
    stacks = pytest.importorskip("course_lib.launch.stacks")
    case = lab09.HANG_CASES[2]
    text = lab09.stack_text(lab09._frames_of(case[1][1]))
    frames = stacks.parse("Thread 0x1 (most recent call first):\n" + "".join(
        f'  File "{f}", line {n} in {fn}\n' for f, n, fn, _ in reversed(lab09._frames_of(case[1][1]))))
    assert [f.name for f in frames][-2:] == ["all_gather_object", "all_gather"]
    assert 'in all_gather_object\n' in text and text.index("all_gather_object") < text.index("in all_gather\n")


def test_nan_records_spread_to_every_rank_the_next_step():
    recs = lab09.nan_records(4, 3, {(2, 1): (3, "inf")})
    bad = {(r["rank"], r["step"]) for r in recs if r["nan"] or r["inf"]}
    assert bad == {(2, 1)} | {(r, 2) for r in range(4)}
    born = [r for r in recs if (r["rank"], r["step"]) == (2, 1)]
    assert [(r["inf"], r["nan"]) for r in born[2:5]] == [(False, False), (True, False), (False, True)]


def test_drift_cases_differ_where_they_say():
    import torch
    base = dict(lab09.drift_case(0, 0).named_parameters())
    for k, (_, changes) in enumerate(lab09.DRIFT_CASES):
        for rank in range(4):
            diff = [n for n, p in lab09.drift_case(k, rank).named_parameters() if not torch.equal(p, base[n])]
            assert diff == [n for n, _ in changes.get(rank, [])], (k, rank, diff)
    swapped = dict(lab09.drift_case(2, 2).named_parameters())["blocks.0.weight"]
    assert swapped.double().sum() == base["blocks.0.weight"].double().sum()   # a float sum cannot see it
