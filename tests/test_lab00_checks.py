"""Lab 00's exercise checks: the right answer passes, a stub is "not implemented yet". The wrong answers, each
with the diagnosis it must get, are in tests/wrong_answers/lab00.py (tests/test_wrong_answer_kinds.py).

The torch check runs on real gloo ranks; the JAX check on the suite's 8 simulated devices (tests/conftest.py).
"""
from __future__ import annotations

import pytest

from course_lib.checks import lab00
from course_lib.maths import costs
from course_lib.comm import collectives
from course_lib.checks import CheckFailed
from course_lib.maths.costs import wire_bytes


# -- exercise 1: all-reduce from reduce-scatter + all-gather (torch, on ranks) -------------------------
def right(x, mean=False):
    return collectives.all_reduce_by_parts(x, mean)


def stub(x, mean=False):
    raise NotImplementedError("Exercise not done yet: reduce-scatter, then all-gather")


def test_all_reduce_check_passes_the_right_answer_and_names_the_ops(capsys):
    assert lab00.check_all_reduce(right, world_size=4) is True
    out = capsys.readouterr().out
    assert out.startswith("✅ my_all_reduce: matches dist.all_reduce on 4 ranks (sum and mean)")
    assert "reduce_scatter + all_gather" in out


def test_all_reduce_check_says_not_implemented_for_the_stub(capsys):
    assert lab00.check_all_reduce(stub, world_size=4) is False
    assert "⏳ my_all_reduce: not implemented yet — reduce-scatter, then all-gather" in capsys.readouterr().out


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


@pytest.mark.parametrize("wrong", [
    lambda op, V, N: (N - 1) * V if op == "broadcast" else wire_bytes(op, V, N),
    lambda op, V, N: V if op == "broadcast" and N > 1 else wire_bytes(op, V, N),
], ids=["broadcast-total-not-per-rank", "broadcast-root-only"])
def test_ring_check_does_not_blame_a_broadcast_answer_on_the_ring_all_gather(wrong):
    """The diagnoses themselves: tests/wrong_answers/lab00.py (these two are there too)."""
    with pytest.raises(CheckFailed) as err:
        lab00.check_ring_bytes(wrong)
    assert "'broadcast'" in str(err.value).split("\n")[0]
    assert "ring steps sends one chunk" not in str(err.value) and "keeps (or already has)" not in str(err.value)


# -- exercise 3: the same composition in JAX (the suite's 8 simulated devices, tests/conftest.py) ----------
def test_jax_check_passes_the_composition_and_waits_for_the_stub(capsys):
    import jax
    mesh = jax.make_mesh((8,), ("x",))

    def stub(b):
        raise NotImplementedError("Exercise not done yet: psum_scatter then all_gather")
    right = lambda b: jax.lax.all_gather(jax.lax.psum_scatter(b, "x", tiled=True), "x", tiled=True)  # noqa: E731
    assert lab00.check_jax_all_reduce(right, mesh) is True
    assert lab00.check_jax_all_reduce(stub, mesh) is False
    out = capsys.readouterr().out
    assert "✅ jax_all_reduce: equals psum on all 8 devices; compiled HLO: reduce-scatter + all-gather" in out
    assert "⏳ jax_all_reduce: not implemented yet — psum_scatter then all_gather" in out
