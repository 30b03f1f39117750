"""``python -m course_lib bench step-time``: the predicted-vs-measured table and what it can measure."""
from types import SimpleNamespace as NS

import pytest

from course_lib.bench import step_time
from course_lib.maths.costs import AlphaBeta


def _pred(step_ms, compute_ms=10.0, gamma_ms=1.0):
    s = step_ms / 1e3
    return NS(step_s=s, compute_s=compute_ms / 1e3, framework_s=gamma_ms / 1e3,
              comm_s=s - (compute_ms + gamma_ms) / 1e3)


def _fake_run(pred_ms_per_round, meas_ms_per_round):
    configs = [step_time.Config("dp", 4, 16, 128), step_time.Config("fsdp", 4, 16, 128)]
    cal = NS(comm=NS(fits={("all_reduce", 4): AlphaBeta(2e-3, 1e-9)}), comm_spread={("all_reduce", 4): 1.5},
             compute=NS(overhead_s=5e-3, flops_per_s=30e9), compute_points=[(1e9, 0.04, 1.2)],
             per_collective_s=3e-3, ddp_per_bucket_s=1e-3)
    return {"configs": configs, "calibrations": {4: cal},
            "predictions": [[_pred(p) for p in rnd] for rnd in pred_ms_per_round],
            "measured": [[(m / 1e3, 1.1) for m in rnd] for rnd in meas_ms_per_round]}


def test_table_prints_medians_over_rounds_the_worst_ratio_and_each_rounds_worst():
    out = _fake_run([[40, 80], [44, 100], [36, 90]], [[40, 100], [40, 100], [40, 100]])
    text = step_time.format_table(out)
    assert "medians over 3 round(s)" in text
    dp = next(line for line in text.splitlines() if line.startswith("dp N=4"))
    assert "40.0ms" in dp and dp.split()[-1] == "1.00"                 # median 40 predicted / 40 measured
    fsdp = next(line for line in text.splitlines() if line.startswith("fsdp N=4"))
    assert "90.0ms" in fsdp and fsdp.split()[-1] == "0.90"
    assert "worst ratio predicted/measured: 0.90 (within the ±25% goal)" in text
    assert "worst of each round: 0.80, 1.10, 0.90" in text


def test_table_says_outside_when_a_prediction_misses_by_more_than_a_quarter():
    text = step_time.format_table(_fake_run([[40, 60]], [[40, 100]]))
    assert "worst ratio predicted/measured: 0.60 (OUTSIDE the ±25% goal)" in text


def test_config_names_what_it_accepts():
    with pytest.raises(ValueError, match=r"strategy='zero3' must be one of .*'zero2'"):
        step_time.Config("zero3", 4, 16, 128)
    with pytest.raises(ValueError, match=r"batch\(6\) a multiple of world_size\(4\)"):
        step_time.Config("fsdp", 4, 6, 128)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero_stages_are_measured_for_the_frontier(strategy):
    median, spread = step_time.measure(step_time.Config(strategy, 2, 4, 32), steps=2)
    assert 0 < median < 10 and spread >= 1.0


@pytest.mark.parametrize("n", range(2, 9))
def test_configs_for_every_world_size(n):
    configs = step_time.configs_for(n)
    assert all(c.world_size == n and c.batch % n == 0 for c in configs)
    kinds = [c.strategy for c in configs]
    assert kinds.count("fsdp") == 3 and "dp" in kinds
    assert ("hsdp" in kinds) == any(n % r == 0 for r in range(2, n))


def test_configs_for_names_the_range():
    with pytest.raises(ValueError, match=r"ranks=9 must be an int from 2 to 8"):
        step_time.configs_for(9)


@pytest.mark.parametrize("v, group, want", [(16 * 1024, 3, 16380), (16 * 1024, 4, 16384), (4096 * 1024, 7, 4194288)])
def test_group_payload_splits_evenly(v, group, want):
    got = step_time.group_payload(v, group)
    assert got == want and got % (4 * group) == 0 and v - got < 4 * group


def test_calibration_runs_on_three_ranks():
    """The sweep used to gather 3 x 1365 float32 elements into 4096 and gloo refused (issue 22)."""
    comm, spread = step_time.calibrate_comm(3, sizes=(16 * 1024, 128 * 1024), repeats=1)
    assert set(comm.fits) == {("all_gather", 3), ("reduce_scatter", 3), ("all_reduce", 3)}


def test_ddp_own_work_is_added_to_dp_only_per_bucket():
    """δ (DDP's own work per bucket, probed at width 96) goes into DP's framework term, never into FSDP's."""
    from course_lib.maths import step_model
    comm = step_model.CommModel({(op, 4): AlphaBeta(1e-3, 1e-9) for op in ("all_gather", "reduce_scatter", "all_reduce")})
    compute = step_model.ComputeModel(5e-3, 30e9)
    cal = step_time.Calibration(4, comm, {}, compute, [], per_collective_s=3e-3, ddp_per_bucket_s=2e-3)
    dp, fsdp = step_time.predict_all([step_time.Config("dp", 4, 16, 128), step_time.Config("fsdp", 4, 16, 128)], {4: cal})
    buckets = sum(o.count for o in dp.cost.ops if o.op == "all_reduce")
    assert buckets >= 1 and dp.framework_s == 2e-3 * buckets
    assert fsdp.framework_s == 3e-3 * fsdp.framework_calls



class _Ranks(list):
    backend = "gloo"


@pytest.mark.parametrize("quick, windows, steps", [(None, 9, 15), ("1", step_time.QUICK_REPEATS, step_time.QUICK_STEPS)])
def test_quick_mode_caps_windows_and_steps_and_nothing_else(monkeypatch, quick, windows, steps):
    """``COURSE_LIB_QUICK=1`` (the suite's notebook runs) times fewer windows and steps; the same calls else."""
    import course_lib.launch
    calls = []

    def fake_run(fn, *args, world_size, **kw):
        calls.append((fn.__name__, args))
        if fn is step_time.time_steps_on_rank:
            return _Ranks([[1e-4 * args[1].d_model * (1 + i % 2) for i in range(args[3])]] * world_size)
        plan, sizes, repeats = args[:3]
        return _Ranks([{(op, kind, v): [1e-4 + v * 1e-9] * repeats for op, kind in plan for v in sizes}] * world_size)

    if quick is None:
        monkeypatch.delenv("COURSE_LIB_QUICK", raising=False)
    else:
        monkeypatch.setenv("COURSE_LIB_QUICK", quick)
    monkeypatch.setattr(course_lib.launch, "run", fake_run)
    assert step_time.measure(step_time.Config("fsdp", 4, 16, 128), steps=15)[1] == 2.0
    step_time.calibrate_compute(4, widths=(32, 64), steps=15)
    step_time.calibrate_comm(4, ops=("all_reduce",), sizes=(16 * 1024, 128 * 1024), repeats=9)
    assert calls == [("time_steps_on_rank", ("fsdp", step_time.lab_cfg(128), 4, steps, 2, 1)),
                     *[("time_steps_on_rank", ("plain", step_time.lab_cfg(w), 4, steps)) for w in (32, 64)],
                     ("comm_sweep_on_rank", ([("all_reduce", "world")], (16 * 1024, 128 * 1024), windows, 1))]
