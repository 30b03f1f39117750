"""Lab 06's exercise checks: right answers pass and stubs are "not implemented yet". The wrong answers, by kind of
mistake, are in tests/wrong_answers/lab06.py (tests/test_wrong_answer_kinds.py runs them)."""
from __future__ import annotations

import math

from course_lib.checks import lab06


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- exercise 1: the 2-D mesh -------------------------------------------------------------------------------
def _shard(model, replicate, shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def test_shard_hsdp_right_and_stub(capsys):
    assert lab06.check_hsdp_shard(_shard)
    assert "✅" in capsys.readouterr().out
    assert lab06.check_hsdp_shard(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


# -- exercise 2: bytes per axis -----------------------------------------------------------------------------
def test_axis_bytes_right_and_stub(capsys):
    assert lab06.check_axis_bytes(lambda psi, R, F, b=4: lab06.reference_axis_bytes(psi, R, F, b))
    assert lab06.check_axis_bytes(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


def test_axis_bytes_two_mistakes_at_once_are_each_named(capsys, monkeypatch):
    """Both axes wrong, each its own way: the ❌ names the shard axis's mistake and the replicate axis's."""
    def two_wrong(psi, R, F, b=4):
        return {"shard": 2 * (F - 1) / F * psi * b,              # the backward re-gather forgotten
                "replicate": 2 * (R - 1) / R * psi * b}          # the whole Ψ all-reduced, not one shard
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")        # lab mode: ❌ printed, False returned
    assert lab06.check_axis_bytes(two_wrong) is False
    out = capsys.readouterr().out
    assert "two mistakes, one per axis" in out
    assert "- shard axis: with every unit resharded after forward, the backward all-gathers again" in out
    assert "- replicate axis: the all-reduce carries only the reduced shard" in out


# -- exercise 3: choose F -----------------------------------------------------------------------------------
def test_choose_f_right_and_stub(capsys):
    assert lab06.check_choose_f(lab06.reference_choose_f)
    assert lab06.check_choose_f(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


# -- exercise 4: FSDP x TP specs ----------------------------------------------------------------------------
def _tp(shape, fsdp, tensor):
    from jax.sharding import PartitionSpec as P
    from course_lib.strategies.fsdp import jax as fsdp_jax
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P("fsdp", "tensor")
    return fsdp_jax.fsdp_spec(shape, fsdp)


def test_tp_spec_right_and_stub(capsys):
    assert lab06.check_tp_spec(_tp)
    assert lab06.check_tp_spec(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out
