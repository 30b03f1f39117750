"""Lab 05's exercise checks: the right answer passes and a stub is "not implemented yet". The wrong answers and
their diagnoses are in the catalogue, tests/wrong_answers/lab05.py (tests/test_wrong_answer_kinds.py).

The gather-pair check needs the course's 8 simulated devices: tests/conftest.py asks for them before JAX starts.
"""
from __future__ import annotations

import pytest

import course_lib
from course_lib.checks import lab05
from course_lib.strategies.fsdp import jax as fsdp_jax

P = pytest.importorskip("jax.sharding").PartitionSpec


# -- exercise 1: the sharding rule ---------------------------------------------------------------------
def right(shape, n, min_size=fsdp_jax.MIN_SIZE):
    return fsdp_jax.fsdp_spec(shape, n, min_size=min_size)


def stub(shape, n, min_size=fsdp_jax.MIN_SIZE):
    raise NotImplementedError("Exercise not done yet: replicate below min_size")


def test_right_answer_passes(capsys):
    assert lab05.check_spec_rule(right) is True
    assert "✅" in capsys.readouterr().out


def test_stub_is_not_implemented(capsys):
    assert lab05.check_spec_rule(stub) is False
    assert "not implemented yet" in capsys.readouterr().out


def test_reference_rule_cases():
    assert fsdp_jax.fsdp_spec((66, 198), 8) == P()                 # nothing divides: replicate
    assert fsdp_jax.fsdp_spec((30, 64), 8) == P(None, "fsdp")      # dim 0 does not divide: dim 1
    assert fsdp_jax.fsdp_spec((64, 512), 8, min_size=32768) == P("fsdp")
    assert fsdp_jax.sharded_dim(P(None, "fsdp")) == 1 and fsdp_jax.sharded_dim(P()) is None


# -- exercise 2: the gather pair (tests/conftest.py gives this process the course's 8 simulated devices) ----------
def _mesh():
    import jax
    from jax.sharding import AxisType
    devices = course_lib.setup_jax(8)
    return jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices)


def test_gather_pair_right_and_stub(capsys):
    import jax
    mesh = _mesh()
    ag = lambda w, d: jax.lax.all_gather(w, "fsdp", axis=d, tiled=True)                # noqa: E731
    rs = lambda g, d: jax.lax.psum_scatter(g, "fsdp", scatter_dimension=d, tiled=True)  # noqa: E731

    def stub(*_):
        raise NotImplementedError("Exercise not done yet: one collective")
    assert lab05.check_gather_pair(ag, rs, mesh) is True
    assert "✅ gather_pair: all 8 devices see the full weight" in capsys.readouterr().out
    assert lab05.check_gather_pair(stub, rs, mesh) is False
    assert "⏳ gather_pair: not implemented yet — one collective" in capsys.readouterr().out


def test_gather_pair_reference_functions_pass():
    assert lab05.check_gather_pair(fsdp_jax.all_gather_shard, fsdp_jax.psum_scatter_grad, _mesh()) is True
