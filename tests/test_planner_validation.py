"""The planner against published training runs: constants fitted on the calibration set only, judged on a
separate validation set. Prints both tables (run with ``-s`` to see them)::

    PYTHONPATH=. python -m pytest tests/test_planner_validation.py -q -s -p no:xdist
"""
import statistics

import pytest

from course_lib.maths import planner, planner_hw, planner_runs as runs


def test_calibration_and_validation_tables(capsys):
    cal, val = runs.compare(runs.CALIBRATION), runs.compare(runs.VALIDATION)
    with capsys.disabled():
        print("\n" + runs.table(cal, "CALIBRATION (the two fitted constants come from these runs)"))
        print("\n" + runs.table(val, "VALIDATION (no constant was fitted to these runs)"))
        mem = [r["predicted_gib"] / r["memory_gib"] for r in cal + val if r["memory_gib"]]
        print(f"memory where published (predicted / published GiB): {', '.join(f'{m:.2f}' for m in mem)}")
    s = runs.summary(val)
    assert 0.90 <= s["median"] <= 1.10, s                  # median within ±10%
    assert s["within_20"] >= 0.8 * s["n"], s               # >= 80% of runs within ±20%
    assert s["worst_factor"] <= 1.35, s                     # worst <= 1.35x either way
    assert all(0.8 <= m <= 1.2 for m in mem), mem            # memory, where published, within ±20%


def test_the_sets_are_separate_and_broad():
    assert not {r.name for r in runs.CALIBRATION if r.source != "TT-H100"}
    cal = {(r.model.name, r.cluster.world, r.compile, r.float8, r.seq_len) for r in runs.CALIBRATION}
    assert not cal & {(r.model.name, r.cluster.world, r.compile, r.float8, r.seq_len) for r in runs.VALIDATION}
    val = runs.VALIDATION
    assert len(val) >= 12 and len({r.source for r in val}) >= 3
    assert {r.cluster.gpu.name for r in val} >= {"A100-SXM4-80GB", "A100-SXM4-40GB", "H100-SXM5-80GB"}
    sizes = [r.model.params for r in val]
    assert min(sizes) < 1.6e9 and max(sizes) > 60e9
    assert len({r.cluster.world for r in val}) >= 4


def test_the_fitted_constants_are_what_the_calibration_set_gives():
    fit = runs.fit_calibration()
    assert planner.IDLE_FRACTION == pytest.approx(fit["idle_fraction"], abs=0.002)
    assert planner_hw.H100_TT500W.fp8_matmul_fraction == pytest.approx(fit["fp8_matmul_fraction"], abs=0.005)
    assert planner_hw.H100.fp8_matmul_fraction == planner_hw.H100_TT500W.fp8_matmul_fraction


def test_the_old_one_number_model_fails_the_same_validation():
    """The course's previous planner (every FLOP at 80% of peak, nothing else) misses on H100 most."""
    ratios = []
    for r in runs.VALIDATION:
        if r.float8 or r.tp > 1 or r.compile:
            continue                                          # it cannot even express these runs
        p = planner.plan(r.model, r.cluster, r.strategy, r.batch, seq_len=r.seq_len, checkpointing=r.checkpointing,
                         replicate=r.replicate, grad_accum=r.grad_accum, compute_efficiency=0.8)
        ratios.append(p.tokens_per_s_per_gpu / r.tokens_per_s)
    assert statistics.median(ratios) > 1.25 and max(ratios) > 1.5
