"""Lab 07's exercise checks: right answers pass, stubs are "not implemented yet", and plausible wrong
answers (at least four per exercise) are rejected with the right diagnosis."""
from __future__ import annotations

import pytest

from course_lib.checks import CheckFailed
from course_lib.checks import lab07


# -- exercise 1: the app state ------------------------------------------------------------------------
class Right:
    def __init__(self, model, optimizer, scheduler, data, *, drop=(), shared_rng=False):
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data
        self.drop, self.shared_rng = drop, shared_rng

    def _key(self):
        import torch.distributed as dist
        return "all" if self.shared_rng else f"rank{dist.get_rank()}"

    def state_dict(self):
        import torch
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
        if "optim" in self.drop:
            sd = {"model": get_model_state_dict(self.model)}
        else:
            sd = dict(zip(("model", "optim"), get_state_dict(self.model, self.optimizer)))
        if "sched" not in self.drop:
            sd["sched"] = self.scheduler.state_dict()
        if "data" not in self.drop:
            sd["data"] = self.data.state_dict()
        if "rng" not in self.drop:
            sd["rng"] = {self._key(): torch.get_rng_state()}
        return sd

    def load_state_dict(self, sd):
        import torch
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
        if "optim" in self.drop:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if "sched" not in self.drop:
            self.scheduler.load_state_dict(sd["sched"])
        if "data" not in self.drop:
            self.data.load_state_dict(sd["data"])
        if "rng" not in self.drop:
            torch.set_rng_state(sd["rng"][self._key()])


def variant(**kw):
    class V(Right):
        def __init__(self, *a):
            super().__init__(*a, **kw)
    return V


class Stub(Right):
    def state_dict(self):
        raise NotImplementedError("Exercise not done yet: everything the next step reads")


def test_app_state_right_and_stub(capsys):
    assert lab07.check_app_state(Right) is True
    assert "✅ AppState: model, optimizer, LR schedule, data position and per-rank RNG" in capsys.readouterr().out
    assert lab07.check_app_state(Stub) is False
    assert "⏳ AppState: not implemented yet — everything the next step reads" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (variant(drop=("optim",)), "optimizer state (Adam's m, v, step) not restored"),
    (variant(drop=("sched",)), "the schedule is not restored"),
    (variant(drop=("data",)), "the data stream restarts from the beginning"),
    (variant(drop=("rng",)), "RNG state not restored"),
    (variant(shared_rng=True), "'s RNG state → every rank saved it under the same key"),
], ids=["no-optimizer", "no-schedule", "no-data", "no-rng", "one-rng-key"])
def test_app_state_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab07.check_app_state(wrong)
    assert says in str(err.value)


# -- exercise 2: load at another world size -----------------------------------------------------------
def load_right(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def load_stub(model, optimizer, path):
    raise NotImplementedError("Exercise not done yet: a template for this mesh, filled in place")


def load_model_only(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])


def load_without_reading(model, optimizer, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)


def load_torch_file(model, optimizer, path):
    import os
    import torch
    import torch.distributed as dist
    model.load_state_dict(torch.load(os.path.join(path, f"__{dist.get_rank()}_0.distcp")))


def load_wrong_keys(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model_state": msd, "optimizer": osd}        # not the keys the save used
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model_state"], optim_state_dict=sd["optimizer"])


def load_keeps_fresh_param_groups(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    fresh = [dict(g) for g in optimizer.param_groups]
    sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for g, f in zip(optimizer.param_groups, fresh):   # "the schedule sets the LR anyway": it does not
        g["lr"] = f["lr"]


def test_load_resharded_right_and_stub(capsys):
    assert lab07.check_load_resharded(load_right) is True
    out = capsys.readouterr().out
    assert "✅ load_resharded: saved at 4 ranks, loaded at 2" in out and "equal never stopping" in out
    assert lab07.check_load_resharded(load_stub) is False
    assert "⏳ load_resharded: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (load_model_only, "optimizer state not restored"),
    (load_without_reading, "the checkpoint was never read into them"),
    (load_torch_file, "is one rank's slices in DCP's layout"),
    (load_wrong_keys, "the template's keys or shapes differ from the saved ones"),
    (load_keeps_fresh_param_groups, "the optimizer's hyper-parameters were not restored"),
])
def test_load_resharded_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab07.check_load_resharded(wrong)
    assert says in str(err.value)


def test_load_resharded_to_one_rank():
    assert lab07.check_load_resharded(load_right, save_world_size=2, load_world_size=1) is True


# -- exercise 3: Orbax restore target with shardings --------------------------------------------------
def _jax():
    import jax
    from jax.sharding import NamedSharding
    from course_lib.strategies.fsdp.jax import fsdp_spec
    return jax, NamedSharding, fsdp_spec


def target_right(state, mesh):
    jax, NS, spec = _jax()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NS(mesh, spec(x.shape, mesh.size))),
                        state)


def target_stub(state, mesh):
    raise NotImplementedError("Exercise not done yet: one abstract array per array")


def target_no_sharding(state, mesh):
    jax, _, _ = _jax()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def target_old_sharding(state, mesh):
    jax, _, _ = _jax()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def target_replicated(state, mesh):
    jax, NS, _ = _jax()
    from jax.sharding import PartitionSpec as P
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NS(mesh, P())), state)


def target_bf16(state, mesh):
    jax, NS, spec = _jax()
    import jax.numpy as jnp
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype,
                                                       sharding=NS(mesh, spec(x.shape, mesh.size))), state)


def target_concrete(state, mesh):
    jax, NS, spec = _jax()
    import jax.numpy as jnp
    return jax.tree.map(lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype), NS(mesh, spec(x.shape, mesh.size))),
                        state)


@pytest.fixture(scope="module")
def devices():
    import jax
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX devices (tests/conftest.py sets them up)")
    return jax.devices()[:8]


def test_restore_target_right_and_stub(devices, capsys):
    assert lab07.check_restore_target(target_right, devices) is True
    assert "✅ restore_target: restored from 8 devices onto 4 and 1" in capsys.readouterr().out
    assert lab07.check_restore_target(target_stub, devices) is False
    assert "⏳ restore_target: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (target_no_sharding, "has no sharding → Orbax puts it back on the mesh it was saved from"),
    (target_old_sharding, "that is the saved array's own sharding"),
    (target_replicated, "the whole array (N× the memory)"),
    (target_bf16, "Orbax would cast or fail"),
    (target_concrete, "a concrete target allocates the whole state once more"),
])
def test_restore_target_wrong_answers_are_named(devices, wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab07.check_restore_target(wrong, devices)
    assert says in str(err.value)


def test_hints_are_layered(capsys):
    from course_lib import checks
    for name, levels in lab07.HINTS.items():
        assert len(levels) == 3, name
        assert levels[0] in checks.hint(name, 1)
        assert name in lab07.TESTS
    assert "hint 1 of 3" in capsys.readouterr().out


def test_stub_says_what_the_check_tests(capsys):
    lab07.check_app_state(Stub)
    assert "The check will test: on 2 gloo ranks with dropout" in capsys.readouterr().out
