"""Loopback byte counters and the α-β sweep: parsing, the measuring protocol on real gloo ranks, the fit.

Timings are never asserted (a shared 2-core machine); byte counts are, loosely: the lo counter is
machine-wide, so other processes' traffic can add to a window -- medians keep that from mattering.
"""
from __future__ import annotations

import pytest

from course_lib.maths import costs
from course_lib.bench import wire
from course_lib.launch import RankError, run

# Runs alone under `make test`'s two workers (root conftest.py): counts bytes on the machine-wide loopback interface.
pytestmark = pytest.mark.serial

NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 10649928   55848    0    0    0     0          0         0 10649900   55840    0    0    0     0       0          0
  eth0: 165260376    5665    0    0    0     0          0         0   400737    3573    0    0    0     0       0          0
"""

needs_lo = pytest.mark.skipif(not wire.loopback_available(), reason="no /proc/net/dev with 'lo' (not Linux)")


# -- counters ----------------------------------------------------------------------------------------
def test_parse_net_dev_reads_transmit_bytes_and_packets_of_the_interface():
    assert wire.parse_net_dev(NET_DEV) == (10649900, 55840)
    assert wire.parse_net_dev(NET_DEV, "eth0") == (400737, 3573)


def test_parse_net_dev_names_the_interfaces_it_has_when_one_is_missing():
    with pytest.raises(ValueError, match=r"no interface 'wlan0' .*\['lo', 'eth0'\]"):
        wire.parse_net_dev(NET_DEV, "wlan0")


@needs_lo
def test_loopback_bytes_only_grows():
    a = wire.loopback_bytes()
    b = wire.loopback_bytes()
    assert isinstance(a, int) and b >= a >= 0


# -- the per-measurement arithmetic ----------------------------------------------------------------------
def test_wire_measurement_compares_the_sum_over_ranks_with_n_times_the_formula():
    m = wire.WireMeasurement("all_gather", nbytes=4096, world_size=4, measured_bytes=3 * 4096 + 660,
                             packets=10, seconds=0.001)
    assert m.formula_bytes == 4 * costs.wire_bytes("all_gather", 4096, 4) == 3 * 4096
    assert m.header_bytes == 10 * wire.TCP_HEADER_BYTES
    assert m.ratio == pytest.approx((3 * 4096 + 660) / (3 * 4096))
    assert m.ratio_without_headers == pytest.approx(1.0)


# -- real gloo ranks ---------------------------------------------------------------------------------------
@needs_lo
@pytest.mark.slow
def test_measured_loopback_bytes_match_the_ring_except_gloos_reduce_scatter():
    """Measured on this kind of machine: 4 ranks, 4 MiB: all-gather and all-reduce ~1.00, reduce-scatter ~2.0."""
    got = {m.op: m for m in wire.measure_wire(wire.OPS, nbytes=4 * wire.MiB, world_size=4, repeats=5)}
    for op in ("broadcast", "all_reduce", "all_gather"):
        assert 0.97 < got[op].ratio < 1.25, (op, got[op])
        assert got[op].measured_bytes > got[op].header_bytes > 0
    # gloo's reduce_scatter_tensor is an all-reduce plus a copy: twice the ring floor. If this fails on a
    # new torch, gloo changed -- update Lab 00's section 7, which teaches this measurement.
    assert 1.7 < got["reduce_scatter"].ratio < 2.4, got["reduce_scatter"]
    assert got["all_gather"].seconds > 0


@needs_lo
def test_measure_on_rank_returns_one_value_per_repeat_and_counters_on_rank_zero_only():
    out = run(wire.measure_on_rank, "all_reduce", 4096, 3, 2, True, world_size=2)
    assert len(out[0]["seconds"]) == len(out[0]["bytes"]) == len(out[0]["base_bytes"]) == 3
    assert out[1]["bytes"] == [] and len(out[1]["seconds"]) == 3
    timing_only = run(wire.measure_on_rank, "all_gather", 4096, 2, 1, False, world_size=2)
    assert timing_only[0]["bytes"] == [] and len(timing_only[0]["seconds"]) == 2


@needs_lo
def test_measure_on_rank_interleaves_a_tuple_of_ops_and_keys_the_result_by_op():
    out = run(wire.measure_on_rank, ("all_gather", "reduce_scatter"), 4096, 2, 1, True, "cpu", world_size=2)
    assert set(out[0]) == {"all_gather", "reduce_scatter"}
    assert all(len(out[0][op]["bytes"]) == 2 for op in out[0])
    # the ops ran in the order asked, twice each: the ledger shows them interleaved (plus the warm-ups)
    assert [r.op for r in out.ledger.filter(rank=0)] == ["all_gather", "reduce_scatter"] * 3


def test_net_bytes_keep_the_cleanest_window():
    """Other processes only ever add bytes: the smallest window minus the smallest baseline is ours."""
    assert wire._net([5000, 9000, 5000 + 40_000], [100, 700, 100]) == 4900


def test_measure_on_rank_rejects_sizes_that_do_not_split_evenly():
    with pytest.raises(RankError) as err:
        run(wire.measure_on_rank, "reduce_scatter", 4 * 3 * 5, world_size=4)
    assert err.value.exc_type == "ValueError" and "multiple of 4 * N = 16" in str(err.value)
    with pytest.raises(RankError) as err:
        run(wire.measure_on_rank, "all_to_all", 64, world_size=2)
    assert err.value.exc_type == "ValueError"


def test_time_collectives_gives_one_time_per_size_per_op_and_a_nonnegative_fit():
    sweep = wire.time_collectives(sizes=(1024, 16 * 1024, 64 * 1024), ops=("all_reduce", "all_gather"),
                                  world_size=2, repeats=2)
    assert sweep.sizes == (1024, 16384, 65536) and sweep.world_size == 2
    # the spread of the repeats (max/min of the slowest rank's times) is kept beside the medians
    assert all(len(sweep.spread[op]) == 3 and all(r >= 1.0 for r in sweep.spread[op]) for op in sweep.seconds)
    for op in ("all_reduce", "all_gather"):
        assert len(sweep.seconds[op]) == 3 and all(t > 0 for t in sweep.seconds[op])
        fit = sweep.fit(op)
        assert fit.alpha_s >= 0 and fit.beta_s_per_byte >= 0
    assert sweep.wire("all_reduce") == [costs.wire_bytes("all_reduce", v, 2) for v in sweep.sizes]


def test_calibrate_alpha_beta_reuses_a_sweep_and_refuses_one_that_lacks_the_op():
    sweep = wire.Sweep(4, (4096, 65536, 1 << 20), {"all_reduce": (1e-3, 1.5e-3, 9e-3)})
    cal = wire.calibrate_alpha_beta(world_size=4, sweep=sweep)
    assert cal.op == "all_reduce" and cal.sweep is sweep and cal.backend in ("gloo", "nccl")
    assert cal.alpha_beta == costs.fit_alpha_beta(sweep.wire("all_reduce"), sweep.seconds["all_reduce"])
    assert cal.predict(1 << 20) == pytest.approx(cal.alpha_beta.predict("all_reduce", 1 << 20, 4))
    with pytest.raises(ValueError, match="cannot calibrate 'all_gather' on 4"):
        wire.calibrate_alpha_beta(world_size=4, op="all_gather", sweep=sweep)
    with pytest.raises(ValueError, match="on 4 ranks"):
        wire.calibrate_alpha_beta(world_size=2, sweep=sweep)
