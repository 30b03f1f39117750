"""The planner's host term (issue 46): dispatches counted, seconds per dispatch calibrated on one tiny run here,
and the prediction checked against measured dispatch-bound steps of other tiny models, on this CPU.

Measured (2 cores shared by other jobs, load 2.7-2.8, torch 2.13): calibration 2.43 us per dispatch + 254 us fixed
per step, FSDP2 451 us per unit (its 3-layer step); predicted / measured: L6 0.98, L3 d32 0.92, FSDP2 L6 0.98 (earlier
runs, load 1.6-4.3: 0.98-1.02, 0.90-0.93, 0.95-0.98; an FSDP2 calibration at 1 layer extrapolated to 7 units gave
0.84 once, hence 3). One rate for every dispatch (no fixed part) was 1.34-1.45x too slow on the deeper models: a step
is not all alike dispatches.
"""
from __future__ import annotations

import statistics

import pytest
import torch

from course_lib.bench import host as bench_host
from course_lib.maths import planner, planner_host
from course_lib.measure.dispatches import count_dispatches


def _measured(**sizes):
    step, cfg = bench_host.tiny_step(**sizes)
    step()
    step()
    n = count_dispatches(step)[1].total
    t = statistics.median(bench_host.time_step(step, 20) for _ in range(3))   # median of three medians
    return n, t, planner.course_gpt(cfg)


#: How close the planner's host seconds must come to the clock in the suite. Idle, every run here landed within
#: 0.90-1.02 (the ±15% the issue asks for; Lab 08 prints the same comparison); the suite runs beside other work, so
#: each round calibrates and measures back to back (contention hits both alike), the ratio is the median of rounds,
#: the tests run alone (``serial``), and the band is wider than the figure: a test must not fail on a busy machine.
BAND = (0.75, 1.25)
ROUNDS = 3


def _ratio(measure, plan) -> tuple[float, list]:
    """Median over ROUNDS of (planner seconds with this round's calibration) / (this round's measured seconds)."""
    torch.set_num_threads(1)
    ratios, seen = [], []
    for _ in range(ROUNDS):
        cal = bench_host.calibrate(reps=20, fsdp=True)
        n, t, hw = measure(cal)
        ratios.append(hw.seconds / t)
        seen.append((n, hw.dispatches, t, hw.seconds))
    return statistics.median(ratios), seen


@pytest.mark.serial
@pytest.mark.parametrize("sizes", [dict(n_layers=6), dict(n_layers=3, d_model=32, d_ff=64, seq_len=16, batch=2)],
                         ids=["L6", "L3-d32"])
def test_host_term_matches_a_dispatch_bound_step(sizes):
    def measure(cal):
        n, t, shape = _measured(**sizes)
        return n, t, planner_host.dispatches_per_step(shape, fsdp=False, bf16=False, dispatch_s=cal["dispatch_s"],
                                                      step_fixed_s=cal["step_fixed_s"], gpu=False)
    ratio, seen = _ratio(measure, None)
    print(f"\n{sizes}: (counted, planner count, measured s, planner s) per round {seen}; median ratio {ratio:.2f}")
    n, counted = seen[0][0], seen[0][1]
    assert abs(counted - n) <= 0.02 * n          # the count table is the counter's
    assert BAND[0] <= ratio <= BAND[1], seen


@pytest.mark.serial
def test_host_term_with_fsdp_hooks():
    import torch.distributed as dist

    def measure(cal):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            step, cfg = bench_host.tiny_step(fsdp=True, n_layers=6)
            step()
            step()
            n = count_dispatches(step)[1].total
            t = statistics.median(bench_host.time_step(step, 20) for _ in range(3))
        finally:
            dist.destroy_process_group()
        return n, t, planner_host.dispatches_per_step(planner.course_gpt(cfg), fsdp=True, bf16=False,
                                                      dispatch_s=cal["dispatch_s"], step_fixed_s=cal["step_fixed_s"],
                                                      fsdp_unit_s=cal["fsdp_unit_s"], gpu=False)
    ratio, seen = _ratio(measure, None)
    print(f"\nFSDP2 L6: (counted, planner count, measured s, planner s) per round {seen}; median ratio {ratio:.2f}")
    n, counted = seen[0][0], seen[0][1]
    assert abs(counted - n) <= 0.02 * n
    assert BAND[0] <= ratio <= BAND[1], seen


def test_the_count_table_is_the_capstones_step():
    """EAGER_COUNTS (plain fp32) against the counter on the capstone's own step at 1 and 2 layers."""
    from course_lib.apps import train
    from course_lib.apps.train_config import TrainConfig
    counts = []
    for L in (1, 2):
        cfg = TrainConfig(world_size=1, n_layers=L, d_model=64, n_heads=2, d_ff=256, vocab_size=67, seq_len=32, batch=2)
        model, opt, sched, data = train.build(cfg, torch.device("cpu"))
        step = lambda: train.train_step(model, opt, sched, data.next(0, 1))  # noqa: E731
        step()
        step()
        counts.append(count_dispatches(step)[1])
    (per, base), (kper, kbase) = planner_host.EAGER_COUNTS[(False, False)]
    assert [c.total for c in counts] == [base + per, base + 2 * per]
    assert [c.kernels for c in counts] == [kbase + kper, kbase + 2 * kper]


def test_host_bound_plans():
    """A tiny GPT on an H200 is host-bound (the GPU would idle); torchtitan's Llama-3-8B is not, and its plan is
    unchanged by the host term (the published-run validation keeps its figures)."""
    from course_lib.models.config import GPTConfig
    one = planner.Cluster(planner.H200, 1)
    tiny = planner.plan(planner.course_gpt(GPTConfig(vocab_size=512, seq_len=128, d_model=128, n_heads=2, n_layers=4,
                                                     d_ff=512)), one, "fsdp", 2)
    assert tiny.host_bound and tiny.step_s == pytest.approx(tiny.host_s) and "HOST-BOUND" in tiny.summary()
    big = planner.plan(planner.LLAMA3_8B, planner.Cluster(planner.H100_TT500W, 8), "fsdp", 2, checkpointing="selective")
    assert not big.host_bound and big.host_s < 0.05 * big.device_s and big.step_s == big.device_s
    serial = planner.plan(planner.LLAMA3_8B, planner.Cluster(planner.H100_TT500W, 8), "fsdp", 2,
                          checkpointing="selective", host_serial_s=0.01)
    assert serial.step_s == pytest.approx(big.step_s + 0.01)
    jax = planner_host.dispatches_per_step(planner.LLAMA3_8B, fsdp=True, framework="xla")
    eager = planner_host.dispatches_per_step(planner.LLAMA3_8B, fsdp=True)
    assert jax.dispatches == 0 and jax.seconds < eager.seconds / 5
