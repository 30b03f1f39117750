"""The tiny GPT: config errors, parameter count, torch == Flax on the same weights, meta-device init.

JAX's device count is fixed by its first computation, for the whole pytest process. So JAX is never
touched at import (collection) time here, and the fixture below gives it the project's 8 simulated
CPU devices if nobody has started it yet: a later test file that asks for 8 still gets them.
"""
import dataclasses
import functools
import subprocess
import sys

import numpy as np
import pytest
import torch

from course_lib import models as M


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matmuls: a second thread only adds sync cost, and on a busy 2-core box it costs seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def jax_with_the_projects_device_count():
    from course_lib.runtime import devices
    if not devices.jax_is_initialised():
        devices.setup_jax(8)


AWKWARD = M.GPTConfig(vocab_size=31, seq_len=13, d_model=21, n_heads=7, n_layers=2, d_ff=45)
LOGIT_TOL = 1e-5  # fp32, same weights, same maths: observed ~2e-6 on O(1) logits; tanh GELU or eps 1e-6 give ~8e-4


def perturbed(cfg, seed=0, scale=0.1):
    """Init weights plus a random kick, so logits are O(1) rather than ~0 and the comparison bites."""
    rng = np.random.default_rng(seed + 1)
    weights = M.init_weights(cfg, seed)
    return {k: (w + scale * rng.standard_normal(w.shape)).astype(np.float32) for k, w in weights.items()}


def test_config_errors_name_the_values():
    with pytest.raises(ValueError, match=r"d_model\(66\) % n_heads\(4\) = 2.*\[1, 2, 3, 6, 11, 22, 33, 66\]"):
        M.GPTConfig(n_heads=4)
    with pytest.raises(ValueError, match=r"positive ints.*'d_ff': 0"):
        M.GPTConfig(d_ff=0)
    with pytest.raises(ValueError, match=r"positive ints.*'vocab_size': 67.0"):
        M.GPTConfig(vocab_size=67.0)
    with pytest.raises(ValueError, match=r"dropout\(1.0\)"):
        M.GPTConfig(dropout=1.0)


@pytest.mark.parametrize("cfg", [M.GPTConfig(), AWKWARD, M.GPTConfig(n_layers=1, d_ff=7, d_model=5, n_heads=5)])
def test_param_count_matches_torch(cfg):
    model = M.TorchGPT(cfg)
    assert M.param_count(cfg) == sum(p.numel() for p in model.parameters())
    assert list(M.weight_shapes(cfg)) == list(model.state_dict())


def test_default_config_is_small_and_awkward():
    cfg = M.GPTConfig()
    assert 100_000 <= M.param_count(cfg) <= 300_000
    for n in (cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.d_ff, 3 * cfg.d_model):
        assert n % 4, f"{n} divides by 4: sharding over 4 ranks would not need padding"


def test_init_weights_deterministic_and_shaped():
    cfg = M.GPTConfig()
    a, b, c = M.init_weights(cfg, 0), M.init_weights(cfg, 0), M.init_weights(cfg, 1)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["head.weight"], c["head.weight"])
    assert all(w.dtype == np.float32 and w.shape == M.weight_shapes(cfg)[k] for k, w in a.items())
    assert not a["blocks.0.attn.qkv.bias"].any() and (a["blocks.2.ln2.weight"] == 1).all()
    assert abs(a["blocks.0.mlp.fc.weight"].std() - 0.02) < 0.002
    # a tensor's numbers do not depend on how many layers exist
    assert np.array_equal(a["head.weight"], M.init_weights(M.GPTConfig(n_layers=1), 0)["head.weight"])


@functools.cache
def _jitted_forward():
    from flax import nnx
    return nnx.jit(lambda model, idx, rngs: model(idx, rngs))


def flax_forward(model, idx, rngs=None):
    """One compiled program per shape and mode: op-by-op eager JAX compiles every op, ~3x slower here."""
    import jax.numpy as jnp
    return np.asarray(_jitted_forward()(model, jnp.asarray(idx), rngs))


@pytest.mark.parametrize("cfg", [M.GPTConfig(), AWKWARD])
def test_torch_equals_flax_on_same_weights(cfg):
    weights = perturbed(cfg)
    torch_model = M.torch_gpt(cfg)
    torch_model.load_state_dict({k: torch.from_numpy(w) for k, w in weights.items()})
    flax_model = M.flax_load_(M.flax_gpt(cfg), weights)
    rng = np.random.default_rng(0)
    # full length on the default config; on the awkward one a shorter T and the 1-token edge case
    for B, T in [(3, cfg.seq_len)] if cfg == M.GPTConfig() else [(5, cfg.seq_len - 4), (1, 1)]:
        idx = rng.integers(0, cfg.vocab_size, size=(B, T))
        with torch.no_grad():
            want = torch_model(torch.from_numpy(idx)).numpy()  # [B, T, V]
        got = flax_forward(flax_model, idx)
        assert got.shape == want.shape == (B, T, cfg.vocab_size)
        assert np.abs(want).max() > 0.5, "logits too small for the comparison to mean anything"
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGIT_TOL)
    back = M.flax_to_numpy_weights(flax_model)
    assert all(np.array_equal(back[k], w) for k, w in weights.items())


def test_dropout_runs_and_eval_modes_agree():
    from flax import nnx
    cfg = dataclasses.replace(AWKWARD, n_layers=1, dropout=0.2)  # one layer: a smaller program to compile
    torch_model, flax_model = M.torch_gpt(cfg), M.flax_gpt(cfg)
    idx = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, cfg.seq_len))
    x = torch.from_numpy(idx)
    assert not torch.equal(torch_model(x), torch_model(x))  # train mode: a fresh mask each call
    train = [flax_forward(flax_model, idx, nnx.Rngs(dropout=k)) for k in (0, 1)]
    assert not np.array_equal(*train)
    with pytest.raises(Exception, match="rngs"):            # Flax wants the key said out loud
        flax_forward(flax_model, idx)
    torch_model.eval(), flax_model.eval()
    with torch.no_grad():
        np.testing.assert_allclose(flax_forward(flax_model, idx), torch_model(x).numpy(), rtol=0, atol=LOGIT_TOL)


def test_too_long_sequence_is_an_error():
    cfg, idx = M.GPTConfig(seq_len=8), np.zeros((1, 9), dtype=np.int64)
    with pytest.raises(ValueError, match=r"T\(9\) > cfg.seq_len\(8\)"):
        M.torch_gpt(cfg)(torch.from_numpy(idx))
    with pytest.raises(ValueError, match=r"T\(9\) > cfg.seq_len\(8\)"):  # JAX would clamp the index silently
        M.flax_gpt(cfg)(idx)


def assert_same_state(model, reference):
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_meta_device_build_reproduces_torch_gpt():
    cfg, seed = AWKWARD, 3
    with torch.device("meta"):
        model = M.TorchGPT(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    for module in model.modules():  # the standard layers' own (random) init still works after to_empty
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()
    model.reset_parameters(seed)    # the root's: the course's numbers
    assert_same_state(model, M.torch_gpt(cfg, seed))
    # apply() visits children first and the root last, so it too ends on the course's numbers (seed 0)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    assert_same_state(model, M.torch_gpt(cfg, 0))


def test_torch_init_rejects_other_config():
    with pytest.raises(ValueError, match=r"missing \['blocks.2.attn.proj.bias'"):
        M.torch_init_(M.TorchGPT(M.GPTConfig(n_layers=2)), M.GPTConfig(), 0)


def test_gradients_match_across_frameworks():
    """Same weights, same batch: same loss and same gradients, so any optimizer keeps them equal."""
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from course_lib.models.data import TokenTask

    cfg = AWKWARD
    weights = perturbed(cfg)
    x, y = TokenTask(cfg.vocab_size, cfg.seq_len).global_batch(step=0, batch_size=6)
    torch_model = M.torch_gpt(cfg)
    torch_model.load_state_dict({k: torch.from_numpy(w) for k, w in weights.items()})
    torch_loss = M.loss_fn(torch_model(torch.from_numpy(x)), torch.from_numpy(y))
    torch_loss.backward()

    @nnx.jit
    def flax_loss_and_grads(model, x, y):
        return nnx.value_and_grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(model)

    flax_model = M.flax_load_(M.flax_gpt(cfg), weights)
    flax_loss, grads = flax_loss_and_grads(flax_model, jnp.asarray(x), jnp.asarray(y))
    flax_grads = M.flax_to_numpy_weights(nnx.merge(nnx.graphdef(flax_model), grads))  # grads in torch layout
    assert abs(float(flax_loss) - torch_loss.item()) < 1e-5
    for name, p in torch_model.named_parameters():
        scale = max(np.abs(p.grad.numpy()).max(), 1e-3)
        np.testing.assert_allclose(flax_grads[name], p.grad.numpy(), rtol=0, atol=1e-5 * scale, err_msg=name)


def test_a_few_adam_steps_reduce_loss():
    from course_lib.models.data import TokenTask
    cfg = M.GPTConfig()
    task, model = TokenTask(cfg.vocab_size, cfg.seq_len), M.torch_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(30):
        x, y = task.global_batch(step, batch_size=16)
        loss = M.loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - np.log(cfg.vocab_size)) < 0.1   # starts at chance: small init, ~uniform logits
    assert np.mean(losses[-5:]) < 2.0, losses               # ln(67) = 4.2; the floor is ~0.68


def test_importing_models_does_not_import_jax():
    code = ("import sys; import course_lib.models as m; from course_lib.models import *; "
            "assert 'jax' not in sys.modules, 'jax imported at import time'; "
            "m.FlaxGPT; assert 'jax' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
