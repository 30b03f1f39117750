"""Lab 01's exercise checks: the right answer passes, the stub says "not implemented yet". The wrong answers, each
with the diagnosis it must get, are in tests/wrong_answers/lab01.py (tests/test_wrong_answer_kinds.py).

The torch checks run on real gloo ranks; the JAX checks on 4 of the suite's 8 simulated devices.
"""
from __future__ import annotations

from course_lib.strategies.dp import torch as dp
from course_lib.checks import lab01


# -- exercise 1: average the gradients ----------------------------------------------------------------
def right(model):
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def stub(model):
    raise NotImplementedError("Exercise not done yet: all-reduce each p.grad, then divide")


def test_average_gradients_passes_the_right_answer(capsys):
    assert lab01.check_average_gradients(right, world_size=4) is True
    assert capsys.readouterr().out.startswith("✅ average_gradients: every rank holds the whole-batch gradient")


def test_average_gradients_accepts_the_reference():
    assert lab01.check_average_gradients(dp.average_gradients_, world_size=4) is True


def test_average_gradients_stub_is_not_implemented(capsys):
    assert lab01.check_average_gradients(stub, world_size=4) is False
    assert "⏳ average_gradients: not implemented yet" in capsys.readouterr().out


# -- exercise 2: buckets --------------------------------------------------------------------------------
def test_make_buckets_passes_the_right_answer(capsys):
    assert lab01.check_make_buckets(dp.make_buckets) is True
    assert "✅ make_buckets" in capsys.readouterr().out


def test_make_buckets_stub_is_not_implemented(capsys):
    def stub_b(params, cap_bytes):
        raise NotImplementedError("Exercise not done yet: walk the parameters in reverse")
    assert lab01.check_make_buckets(stub_b) is False
    assert "not implemented yet" in capsys.readouterr().out


# -- exercises 3 and 4: JAX, on 4 of the suite's 8 simulated devices (tests/conftest.py) ------------------
def test_jax_checks_pass_the_references_and_wait_for_the_stubs(capsys):
    import jax
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])

    def vg_stub(loss_fn, p, x, y):
        raise NotImplementedError("Exercise not done yet: grad of pmean(loss)")

    def key_stub(key):
        raise NotImplementedError("Exercise not done yet: fold_in")
    assert lab01.check_jax_dp_value_and_grad(dp.jax_dp_value_and_grad, mesh) is True
    assert lab01.check_jax_dp_value_and_grad(vg_stub, mesh) is False
    assert lab01.check_jax_device_key(dp.jax_device_key, mesh) is True
    assert lab01.check_jax_device_key(key_stub, mesh) is False
    out = capsys.readouterr().out
    assert "✅ dp_value_and_grad: whole-batch loss and gradient on all 4 devices" in out
    assert "✅ device_key: 4 devices, 4 different masks" in out
    assert "⏳ dp_value_and_grad: not implemented yet" in out and "⏳ device_key: not implemented yet" in out
