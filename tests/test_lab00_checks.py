"""Lab 00's exercise checks: the right answer passes, a stub is "not implemented yet", and plausible
wrong answers fail with feedback that names the mistake.

The torch check runs on real gloo ranks. The JAX check needs 8 simulated devices, which must be set
before JAX starts: it runs in a subprocess (this pytest process may already have JAX with 1 device).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_lib.checks import lab00
from course_lib.maths import costs
from course_lib.comm import collectives
from course_lib.checks import CheckFailed
from course_lib.maths.costs import wire_bytes

ROOT = Path(__file__).resolve().parent.parent


# -- exercise 1: all-reduce from reduce-scatter + all-gather (torch, on ranks) -------------------------
def right(x, mean=False):
    return collectives.all_reduce_by_parts(x, mean)


def stub(x, mean=False):
    raise NotImplementedError("Exercise not done yet: reduce-scatter, then all-gather")


def forgot_the_gather(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = torch.empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    return shard / n if mean else shard


def sum_where_mean_asked(x, mean=False):
    return collectives.all_reduce_by_parts(x, mean=False)


def averaged_twice(x, mean=False):
    out = collectives.all_reduce_by_parts(x, mean)
    return out / 4 if mean else out


def gathered_the_input_chunk(x, mean=False):
    import torch
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    shard = torch.empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x.chunk(n)[r].contiguous())   # the input's chunk, not the sum's
    return out / n if mean else out


def chunks_in_the_wrong_place(x, mean=False):
    import torch
    out = collectives.all_reduce_by_parts(x, mean)
    return torch.roll(out, out.numel() // 4)          # shard r written where shard r+1 belongs


def the_real_all_reduce(x, mean=False):
    import torch.distributed as dist
    dist.all_reduce(x)
    return x / dist.get_world_size() if mean else x


def test_all_reduce_check_passes_the_right_answer_and_names_the_ops(capsys):
    assert lab00.check_all_reduce(right, world_size=4) is True
    out = capsys.readouterr().out
    assert out.startswith("✅ my_all_reduce: matches dist.all_reduce on 4 ranks (sum and mean)")
    assert "reduce_scatter + all_gather" in out


def test_all_reduce_check_says_not_implemented_for_the_stub(capsys):
    assert lab00.check_all_reduce(stub, world_size=4) is False
    assert "⏳ my_all_reduce: not implemented yet — reduce-scatter, then all-gather" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, feedback", [
    (forgot_the_gather, "looks like one rank's shard; all-gather it first"),
    (sum_where_mean_asked, "you summed instead of averaging (forgot ÷4)"),
    (averaged_twice, "you averaged twice"),
    (gathered_the_input_chunk, "the all-gather was fed the input, not the reduce-scatter's output shard"),
    (chunks_in_the_wrong_place, "shifted by 1 shard(s)"),
    (the_real_all_reduce, "called all_reduce itself"),
], ids=lambda v: getattr(v, "__name__", "feedback"))
def test_all_reduce_check_rejects_plausible_mistakes_with_the_reason(wrong, feedback):
    with pytest.raises(CheckFailed) as err:
        lab00.check_all_reduce(wrong, world_size=4)
    assert str(err.value).startswith("❌ my_all_reduce:")
    assert feedback in str(err.value)


def test_all_reduce_by_parts_refuses_sizes_it_cannot_split():
    from course_lib.launch import RankError, run

    def odd():
        import torch
        return collectives.all_reduce_by_parts(torch.ones(10))
    with pytest.raises(RankError, match="multiple of N=4"):
        run(odd, world_size=4)


# -- exercise 2: the ring cost per rank --------------------------------------------------------------
def _ring(op, V, N):
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V


def test_ring_check_passes_the_formula_and_the_course_reference(capsys):
    assert lab00.check_ring_bytes(_ring) is True
    assert lab00.check_ring_bytes(costs.wire_bytes) is True
    assert "✅ ring_bytes: 20 cases match costs.wire_bytes" in capsys.readouterr().out


def test_ring_check_says_not_implemented_for_the_stub(capsys):
    def todo(op, V, N):
        raise NotImplementedError("Exercise not done yet: N-1 steps of V/N")
    assert lab00.check_ring_bytes(todo) is False
    assert "⏳ ring_bytes: not implemented yet — N-1 steps of V/N" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, feedback", [
    (lambda op, V, N: (N - 1) / N * V, "all-reduce is reduce-scatter THEN all-gather"),
    (lambda op, V, N: (2 if op == "all_reduce" else 1) * (N - 1) * V, "not the whole V"),
    (lambda op, V, N: (2 if op == "all_reduce" else 1) * V / N, "that is one ring step"),
    (lambda op, V, N: 2 * (N - 1) / N * V, "that is all-reduce's cost"),
    (lambda op, V, N: (2 if op == "all_reduce" else 1) * (N - 1) / N * V if N > 1 else V, "nothing leaves"),
    (lambda op, V, N: None, "return a number of bytes"),
    (lambda op, V, N: (N - 1) * V if op == "broadcast" else wire_bytes(op, V, N),
     "what all ranks send together in the pipelined ring; the cost is per rank"),
    (lambda op, V, N: V if op == "broadcast" and N > 1 else wire_bytes(op, V, N),
     "only the root sends all of V"),
], ids=["one-phase-all-reduce", "whole-V-per-step", "one-step", "all-reduce-everywhere", "n1", "none",
        "broadcast-total-not-per-rank", "broadcast-root-only"])
def test_ring_check_rejects_plausible_mistakes_with_the_reason(wrong, feedback):
    with pytest.raises(CheckFailed) as err:
        lab00.check_ring_bytes(wrong)
    assert str(err.value).startswith("❌ ring_bytes:") and feedback in str(err.value)
    if "broadcast" in str(err.value).split("\n")[0]:      # a broadcast answer is not blamed on the ring all-gather
        assert "ring steps sends one chunk" not in str(err.value) and "keeps (or already has)" not in str(err.value)


# -- exercise 3: the same composition in JAX (subprocess: 8 simulated devices) -------------------------
JAX_SCRIPT = textwrap.dedent(r'''
    import json
    import course_lib
    course_lib.setup_jax(8)
    import jax
    from course_lib.checks import CheckFailed, lab00

    mesh = jax.make_mesh((8,), ("x",))
    answers = {
        "right": lambda b: jax.lax.all_gather(jax.lax.psum_scatter(b, "x", tiled=True), "x", tiled=True),
        "psum": lambda b: jax.lax.psum(b, "x"),
        "no_gather": lambda b: jax.lax.psum_scatter(b, "x", tiled=True),
        "pmean": lambda b: jax.lax.all_gather(jax.lax.psum_scatter(b, "x", tiled=True), "x", tiled=True) / 8,
        "untiled_gather": lambda b: jax.lax.all_gather(jax.lax.psum_scatter(b, "x", tiled=True), "x"),
    }
    def stub(b):
        raise NotImplementedError("Exercise not done yet: psum_scatter then all_gather")
    answers["stub"] = stub
    out = {}
    for name, fn in answers.items():
        try:
            out[name] = ["passed" if lab00.check_jax_all_reduce(fn, mesh) else "todo", ""]
        except CheckFailed as err:
            out[name] = ["failed", str(err)]
    print("RESULT" + json.dumps(out))
''')


@pytest.fixture(scope="module")
def jax_results():
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):]), proc.stdout


def test_jax_check_passes_the_composition_and_waits_for_the_stub(jax_results):
    results, stdout = jax_results
    assert results["right"] == ["passed", ""]
    assert "✅ jax_all_reduce: equals psum on all 8 devices; compiled HLO: reduce-scatter + all-gather" in stdout
    assert results["stub"] == ["todo", ""]
    assert "⏳ jax_all_reduce: not implemented yet — psum_scatter then all_gather" in stdout


@pytest.mark.parametrize("name, feedback", [
    ("psum", "the compiled program issues ['all_reduce']"),
    ("no_gather", "the reduce-scatter's output was not all-gathered"),
    ("pmean", "you averaged twice"),
    ("untiled_gather", "all_gather without tiled=True adds a new leading axis"),
])
def test_jax_check_rejects_plausible_mistakes(jax_results, name, feedback):
    status, message = jax_results[0][name]
    assert status == "failed" and message.startswith("❌ jax_all_reduce:") and feedback in message
