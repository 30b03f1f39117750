"""Reading a profiler trace: intervals, union and intersection, compute vs communication; one real gloo trace."""
import json

import pytest

from course_lib.bench import timeline
from course_lib.bench.timeline import classify, intersect, measure_of, overlap_stats, union


def test_interval_arithmetic():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert measure_of([(0, 2), (1, 3), (10, 11)]) == 4
    assert intersect([(0, 10)], [(2, 3), (9, 12), (20, 30)]) == [(2, 3), (9, 10)]
    assert intersect([], [(0, 1)]) == []


def _ev(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def test_cpu_trace_classification():
    events = [_ev("aten::mm", 0, 100), _ev("aten::add", 50, 10), _ev("aten::mm", 200, 100),
              _ev("gloo:all_gather", 80, 60, tid=7, cat="user_annotation"),     # gloo's background thread
              _ev("aten::copy_", 90, 5, tid=7)]                                   # not the model's thread
    iv = classify(events)
    assert iv["comm"] == [(80, 140)] and union(iv["compute"]) == [(0, 100), (200, 300)]
    s = overlap_stats(iv)
    assert s.comm_s == pytest.approx(60e-6) and s.overlapped_s == pytest.approx(20e-6)
    assert s.exposed_s == pytest.approx(40e-6) and s.overlap_fraction == pytest.approx(1 / 3)


def test_gpu_trace_classification():
    events = [_ev("ampere_bf16_gemm", 0, 100, cat="kernel"),
              _ev("ncclDevKernel_AllGather_RING_LL", 30, 100, cat="kernel"),
              _ev("aten::mm", 0, 5)]
    s = overlap_stats(classify(events, gpu=True))
    assert s.compute_s == pytest.approx(100e-6) and s.overlapped_s == pytest.approx(70e-6)


def test_real_fsdp2_trace_on_two_gloo_ranks(tmp_path):
    from course_lib import run
    from course_lib.models.config import GPTConfig
    cfg = GPTConfig(vocab_size=67, seq_len=16, d_model=32, n_heads=2, n_layers=2, d_ff=65)
    path = str(tmp_path / "trace.json")
    res = run(timeline.profile_on_rank, cfg, 2, 1, "two", True, path, world_size=2, timeout=120)
    events = timeline.load_events(path)
    assert any(e["name"].startswith("gloo:all_gather") for e in events)
    assert any(e["name"].startswith("FSDP::all_gather") for e in events)
    s = timeline.OverlapStats(**res[0]["stats"])
    assert s.comm_s > 0 and s.compute_s > 0 and 0 <= s.overlapped_s <= s.comm_s
    assert json.load(open(path))["traceEvents"]
    with pytest.raises(ValueError, match="prefetch='three'"):
        timeline.profile_on_rank(cfg, 2, prefetch="three")
