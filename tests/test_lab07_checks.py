"""Lab 07's exercise checks: right answers pass and stubs are "not implemented yet". The classic wrong answers,
each with its diagnosis, are in the catalogue (tests/wrong_answers/lab07.py, run by test_wrong_answer_kinds.py)."""
from __future__ import annotations

import pytest

from course_lib.checks import lab07


# -- exercise 1: the app state ------------------------------------------------------------------------
class Right:
    def __init__(self, model, optimizer, scheduler, data):
        self.model, self.optimizer, self.scheduler, self.data = model, optimizer, scheduler, data

    def state_dict(self):
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict
        sd = dict(zip(("model", "optim"), get_state_dict(self.model, self.optimizer)))
        return {**sd, "sched": self.scheduler.state_dict(), "data": self.data.state_dict(),
                "rng": {f"rank{dist.get_rank()}": torch.get_rng_state()}}

    def load_state_dict(self, sd):
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.data.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"][f"rank{dist.get_rank()}"])


class Stub(Right):
    def state_dict(self):
        raise NotImplementedError("Exercise not done yet: everything the next step reads")


def test_app_state_right_and_stub(capsys):
    assert lab07.check_app_state(Right) is True
    assert "✅ AppState: model, optimizer, LR schedule, data position and per-rank RNG" in capsys.readouterr().out
    assert lab07.check_app_state(Stub) is False
    assert "⏳ AppState: not implemented yet — everything the next step reads" in capsys.readouterr().out


# -- exercise 2: load at another world size -----------------------------------------------------------
def load_right(model, optimizer, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def load_stub(model, optimizer, path):
    raise NotImplementedError("Exercise not done yet: a template for this mesh, filled in place")


def test_load_resharded_right_and_stub(capsys):
    assert lab07.check_load_resharded(load_right) is True
    out = capsys.readouterr().out
    assert "✅ load_resharded: saved at 4 ranks, loaded at 2" in out and "equal never stopping" in out
    assert lab07.check_load_resharded(load_stub) is False
    assert "⏳ load_resharded: not implemented yet" in capsys.readouterr().out


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


def test_hints_are_layered(capsys):
    from course_lib import checks
    for name, levels in lab07.HINTS.items():
        assert len(levels) == 3, name
        assert levels[0] in checks.core.hint_text(name, 1)
        assert name in lab07.TESTS
    checks.hint("AppState")
    assert "hint 1 of 3" in capsys.readouterr().out


def test_stub_says_what_the_check_tests(capsys):
    lab07.check_app_state(Stub)
    assert "The check will test: on 2 gloo ranks with dropout" in capsys.readouterr().out
