"""Lab 06's exercise checks: right answers pass, stubs are "not implemented yet", and plausible wrong answers
(at least four per exercise) are rejected with the right diagnosis."""
from __future__ import annotations

import math

import pytest

from course_lib.checks import CheckFailed
from course_lib.checks import lab06


def _stub(*args, **kwargs):
    raise NotImplementedError


# -- exercise 1: the 2-D mesh -------------------------------------------------------------------------------
def _shard(kind):
    def fn(model, replicate, shard):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        shape, names = (replicate, shard), ("replicate", "shard")
        if kind == "swapped":
            shape, names = (shard, replicate), ("shard", "replicate")
        if kind == "names":
            names = ("shard", "replicate")
        mesh = (init_device_mesh("cpu", (replicate * shard,)) if kind == "1d"
                else init_device_mesh("cpu", shape, mesh_dim_names=names))
        if kind != "root_only":
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
        if kind != "no_root":
            fully_shard(model, mesh=mesh)
        return mesh
    return fn


def test_shard_hsdp_right_and_stub(capsys):
    assert lab06.check_hsdp_shard(_shard("right"))
    assert "✅" in capsys.readouterr().out
    assert lab06.check_hsdp_shard(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("kind,diagnosis", [
    ("swapped", "axes are swapped"),
    ("1d", "1-D mesh"),
    ("no_root", "the root was never sharded"),
    ("root_only", "FSDP unit"),
    ("names", "mesh_dim_names"),
])
def test_shard_hsdp_wrong(kind, diagnosis):
    with pytest.raises(CheckFailed, match=diagnosis):
        lab06.check_hsdp_shard(_shard(kind))


# -- exercise 2: bytes per axis -----------------------------------------------------------------------------
def test_axis_bytes_right_and_stub(capsys):
    assert lab06.check_axis_bytes(lambda psi, R, F, b=4: lab06.reference_axis_bytes(psi, R, F, b))
    assert lab06.check_axis_bytes(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("fn,diagnosis", [
    (lambda p, R, F, b=4: {"shard": 3 * (F - 1) / F * p * b, "replicate": 2 * (R - 1) / R * p * b}, "reduced shard"),
    (lambda p, R, F, b=4: {"shard": 3 * (F - 1) / F * p * b, "replicate": 2 * (R * F - 1) / (R * F) * p / F * b},
     "over the R ranks"),
    (lambda p, R, F, b=4: {"shard": 3 * (R * F - 1) / (R * F) * p * b, "replicate": 2 * (R - 1) / R * p / F * b},
     "F ranks of a shard group"),
    (lambda p, R, F, b=4: {"shard": 2 * (F - 1) / F * p * b, "replicate": 2 * (R - 1) / R * p / F * b},
     "backward all-gathers again"),
    (lambda p, R, F, b=4: {"shard": 4 * (F - 1) / F * p * b, "replicate": 2 * (R - 1) / R * p / F * b},
     "half an all-reduce"),
    (lambda p, R, F, b=4: {"shard": 3 * (F - 1) / F * p, "replicate": 2 * (R - 1) / R * p / F}, "bytes, not elements"),
    (lambda p, R, F, b=4: lab06.reference_axis_bytes(p, F, R, b), "swapped"),
    (lambda p, R, F, b=4: (1, 2), "return a dict"),
])
def test_axis_bytes_wrong(fn, diagnosis):
    with pytest.raises(CheckFailed, match=diagnosis):
        lab06.check_axis_bytes(fn)


# -- exercise 3: choose F -----------------------------------------------------------------------------------
def test_choose_f_right_and_stub(capsys):
    assert lab06.check_choose_f(lab06.reference_choose_f)
    assert lab06.check_choose_f(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


def _smallest_fit(psi, world, per_node, budget, bwi, bwx):
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return fits[0] if fits else None


def _strict_budget(psi, world, per_node, budget, bwi, bwx):   # "fits" read as strictly below the budget
    return lab06.reference_choose_f(psi, world, per_node, budget * (1 - 1e-12), bwi, bwx)


def _largest_fit(psi, world, per_node, budget, bwi, bwx):
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return fits[-1] if fits else None


@pytest.mark.parametrize("fn,diagnosis", [
    (lambda psi, world, *a: world, "plain FSDP"),                                     # always FSDP
    (lambda psi, world, per_node, *a: per_node, "compare the predicted times|does not fit|fits for every F"),
    (_smallest_fit, "predicted time"),                                                # memory only
    (_largest_fit, "plain FSDP"),                                                     # as much sharding as possible
    (_strict_budget, "exactly the budget, and fits"),                                 # < where the text says <=
    (lambda psi, world, per_node, budget, *a: max(1, math.ceil(16 * psi / budget)), "must divide|does not fit|predicted"),
])
def test_choose_f_wrong(fn, diagnosis):
    with pytest.raises(CheckFailed, match=diagnosis):
        lab06.check_choose_f(fn)


# -- exercise 4: FSDP x TP specs ----------------------------------------------------------------------------
def _tp(kind):
    def fn(shape, fsdp, tensor):
        from jax.sharding import PartitionSpec as P
        from course_lib.strategies.fsdp import jax as fsdp_jax
        big = len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE
        if big and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
            return {"both_on_dim0": P(("fsdp", "tensor"), None), "fsdp_only": P("fsdp", None),
                    "swapped": P("tensor", "fsdp"), "replicate": P(), "right": P("fsdp", "tensor"),
                    "small_cut": P("fsdp", "tensor")}[kind]
        if kind == "small_cut" and len(shape) == 1:
            return P("fsdp")
        return fsdp_jax.fsdp_spec(shape, fsdp)
    return fn


def test_tp_spec_right_and_stub(capsys):
    assert lab06.check_tp_spec(_tp("right"))
    assert lab06.check_tp_spec(_stub) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("kind,diagnosis", [
    ("both_on_dim0", "over both axes"),
    ("fsdp_only", "whole along \\['tensor'\\]"),
    ("swapped", "swaps the axes"),
    ("replicate", "whole along"),
    ("small_cut", "small arrays"),
])
def test_tp_spec_wrong(kind, diagnosis):
    with pytest.raises(CheckFailed, match=diagnosis):
        lab06.check_tp_spec(_tp(kind))


def test_tp_spec_ignoring_divisibility_is_caught():
    from jax.sharding import PartitionSpec as P
    with pytest.raises(CheckFailed, match="do not divide"):
        lab06.check_tp_spec(lambda shape, f, t: P("fsdp", "tensor") if len(shape) == 2 and shape[0] >= 64
                            else P())


# -- the whole lab, as a learner runs it, with a wrong answer in every exercise ------------------------------
