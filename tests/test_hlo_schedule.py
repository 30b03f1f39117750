"""The schedule of a compiled HLO module: sync collectives vs async start/done pairs and the compute
scheduled inside each pair's window. Synthetic text for every spelling, then Lab 05's real step compiled
by XLA:CPU (in a subprocess: 8 simulated devices must be asked for before JAX starts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.comm import hlo_schedule as hs

ROOT = Path(__file__).resolve().parents[1]

# A GPU-style schedule: an all-gather with two fusions and a cuBLAS call inside its window, an all-reduce
# with nothing inside, a reduce-scatter wrapped in async-start/async-done with one fusion, and one sync op.
GPU_STYLE = """HloModule m, is_scheduled=true, num_partitions=4
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%async_rs (a: f32[4,8]) -> f32[2,8] {
  %a = f32[4,8]{1,0} parameter(0)
  ROOT %rs = f32[2,8]{1,0} reduce-scatter(%a), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}
ENTRY %main (p0: f32[2,8], x: f32[4,8]) -> f32[2,8] {
  %p0 = f32[2,8]{1,0} parameter(0)
  %x = f32[4,8]{1,0} parameter(1)
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}
  %f1 = f32[4,8]{1,0} fusion(%x), kind=kLoop, calls=%add
  %gemm = (f32[4,8]{1,0}, s8[0]{0}) custom-call(%x, %x), custom_call_target="__cublas$gemm"
  %gte = f32[4,8]{1,0} get-tuple-element(%gemm), index=0
  %f2 = f32[4,8]{1,0} fusion(%gte, /*index=1*/%f1), kind=kLoop, calls=%add
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  %ars = f32[4,8]{1,0} all-reduce-start(%f2), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[4,8]{1,0} all-reduce-done(%ars)
  %rs-start = ((f32[4,8]{1,0}), f32[2,8]{1,0}) async-start(%ard), calls=%async_rs
  %f3 = f32[4,8]{1,0} fusion(%ard), kind=kLoop, calls=%add
  %rs-done = f32[2,8]{1,0} async-done(%rs-start)
  %ar = f32[2,8]{1,0} all-reduce(%rs-done), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %t = (f32[8,8]{1,0}, f32[2,8]{1,0}, f32[4,8]{1,0}) tuple(%agd, %ar, %f3)
}
"""


def test_forms_count_each_collective_once():
    forms = hs.collective_forms(GPU_STYLE)
    assert forms == {("all-gather", "start"): 1, ("all-gather", "done"): 1, ("all-reduce", "start"): 1,
                     ("all-reduce", "done"): 1, ("reduce-scatter", "start"): 1, ("reduce-scatter", "done"): 1,
                     ("all-reduce", "sync"): 1}     # the reduce-scatter inside %async_rs is not counted again


def test_windows_hold_the_compute_scheduled_inside():
    pairs = hs.async_pairs(GPU_STYLE)
    assert [(p.kind, p.start, p.done, p.between, p.compute) for p in pairs] == [
        ("all-gather", "ags", "agd", 4, 3),          # fusion, custom-call, get-tuple-element, fusion
        ("all-reduce", "ars", "ard", 0, 0),
        ("reduce-scatter", "rs-start", "rs-done", 1, 1)]
    assert hs.summary(GPU_STYLE) == {"all-gather": {"sync": 0, "pairs": 1, "overlapped": 1},
                                     "all-reduce": {"sync": 1, "pairs": 1, "overlapped": 0},
                                     "reduce-scatter": {"sync": 0, "pairs": 1, "overlapped": 1}}


def test_sugared_start_done_names_and_tuple_shapes():
    text = """HloModule m, is_scheduled=true
ENTRY %main (x: f32[8]) -> f32[2] {
  %x = f32[8]{0} parameter(0)
  %rss = ((f32[8]{0}), f32[2]{0}) reduce-scatter-start(%x), replica_groups={{0,1,2,3}}, dimensions={0}
  %d = f32[8]{0} dot(%x, %x)
  ROOT %rsd = f32[2]{0} reduce-scatter-done(%rss)
}"""
    assert hs.summary(text) == {"reduce-scatter": {"sync": 0, "pairs": 1, "overlapped": 1}}


def test_start_without_done_is_an_error_that_says_what_to_pass():
    half = "\n".join(line for line in GPU_STYLE.splitlines() if "%agd =" not in line)
    with pytest.raises(ValueError, match=r"ags \(all-gather-start\) has no matching \*-done.*compiled.as_text"):
        hs.async_pairs(half)


def test_only_the_entry_computation_is_read():
    assert [i.name for i in hs.entry(GPU_STYLE)][:3] == ["p0", "x", "ags"]
    assert {i.computation for i in hs.instructions(GPU_STYLE)} == {"add", "async_rs", "ENTRY main"}


_CPU = """
import json, sys
import course_lib
course_lib.setup_jax(8)
from course_lib.bench import xla_overlap
from course_lib.comm import hlo_schedule
res = xla_overlap.compile_variants("cpu", 8)
text = res["variants"]["default"]
print(json.dumps({"summary": hlo_schedule.summary(text), "scheduled": "is_scheduled=true" in text,
                  "known": xla_overlap.known_options()}))
"""


def test_xla_cpu_emits_only_sync_collectives_for_lab05s_step():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _CPU], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # Lab 05 section 5: 10 all-gathers (forward), 2 all-reduces (pos_emb's small one, the combined gradients)
    assert res["scheduled"] and res["summary"] == {"all-gather": {"sync": 10, "pairs": 0, "overlapped": 0},
                                                   "all-reduce": {"sync": 2, "pairs": 0, "overlapped": 0}}
    known = res["known"]
    assert known["xla_gpu_enable_latency_hiding_scheduler"] and known["xla_gpu_disable_async_collectives"]
    assert not known["xla_gpu_enable_async_all_gather"] and not known["xla_gpu_enable_async_all_reduce"]


GPU_TEXT = ROOT / "tests" / "fixtures" / "xla_gpu" / "lab05_step_8gpu_jax0.11.2.hlo.txt.gz"


def _gpu_text() -> str:
    import gzip
    return gzip.decompress(GPU_TEXT.read_bytes()).decode()


def test_xla_gpu_schedule_of_lab05s_step():
    """XLA:GPU's plan for the same step (see tests/fixtures/xla_gpu/README.md): the forward's all-gathers
    combined into one synchronous op before the first matmul; the gradients' reduce-scatter and the replicated
    parameters' all-reduce async, each with compute inside its window."""
    text = _gpu_text()
    assert "is_scheduled=true" in text
    assert hs.summary(text) == {"all-gather": {"sync": 1, "pairs": 0, "overlapped": 0},
                                "all-reduce": {"sync": 0, "pairs": 1, "overlapped": 1},
                                "reduce-scatter": {"sync": 0, "pairs": 1, "overlapped": 1}}
    pairs = {p.kind: p for p in hs.async_pairs(text)}
    assert (pairs["all-reduce"].compute, pairs["reduce-scatter"].compute) == (15, 41)
    order = hs.entry(text)
    gather = next(n for n, i in enumerate(order) if i.opcode == "all-gather")
    assert len(order[gather].operands) == 11          # every sharded weight in one combined all-gather
    first_matmul = next(n for n, i in enumerate(order) if "gemm" in i.name)
    assert gather < first_matmul
    # the backward's matmuls that run inside the all-reduce's window
    start, done = (next(n for n, i in enumerate(order) if i.name == p) for p in ("all-reduce-start", "all-reduce-done"))
    assert sum("gemm" in i.name for i in order[start:done]) == 9


def test_the_ledger_reads_xla_gpu_async_forms_at_the_formula():
    """((operands), outputs) *-start shapes count the outputs once; reduce-scatter-start is a reduce-scatter.
    On XLA:GPU the jit step moves exactly FSDP's bytes without the backward re-gather (Lab 05, section 5)."""
    from course_lib.comm.jax_ledger import from_hlo_text
    from course_lib.maths.costs import ledger_wire_bytes
    ledger = from_hlo_text(_gpu_text())
    assert sorted((r.op, r.nbytes, r.group_size) for r in ledger) == [
        ("all_gather", 164_864 * 4, 8), ("all_reduce", (1_792 + 1) * 4, 8), ("reduce_scatter", 164_864 * 4, 8)]
    assert ledger_wire_bytes(ledger) == 2 * 7 / 8 * 164_864 * 4 + 2 * 7 / 8 * 1_793 * 4
