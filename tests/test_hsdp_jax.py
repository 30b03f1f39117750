"""HSDP and FSDP × TP in JAX on 8 simulated devices: the compiled step's collectives are attributed to mesh
axes from their replica groups, explicit shard_map HSDP issues exactly all-gather/reduce-scatter over 'fsdp'
and all-reduce over 'replicate', every variant matches the single-device step, and FSDP × TP holds
1/(F·T) of each big kernel per device."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from course_lib import models  # noqa: E402
from course_lib.comm import jax_ledger  # noqa: E402
from course_lib.models.data import TokenTask  # noqa: E402
from course_lib.strategies.fsdp import jax as fsdp_jax  # noqa: E402
from course_lib.strategies.hsdp import jax as hsdp_jax  # noqa: E402
from course_lib.strategies.tp import jax as tp_jax  # noqa: E402

CFG = models.GPTConfig(vocab_size=512, seq_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256)
B, K = 32, 2
TX = optax.adamw(3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


@pytest.fixture(scope="module", autouse=True)
def _precision():
    old = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", old)


def _batches(sharding=None):
    task = TokenTask(CFG.vocab_size, CFG.seq_len, seed=0)
    for s in range(K):
        x, y = (v.astype(np.int32) for v in task.global_batch(s, B))
        yield (x, y) if sharding is None else (jax.device_put(x, sharding), jax.device_put(y, sharding))


@pytest.fixture(scope="module")
def single():
    model = models.flax_gpt(CFG, seed=0)
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, g = nnx.value_and_grad(fsdp_jax.loss_fn)(model, x, y)
        opt.update(model, g)
        return loss
    return [float(step(model, opt, x, y)) for x, y in _batches()]


def _jit_run(mesh, rule):
    model = models.flax_gpt(CFG, seed=0)
    fsdp_jax.shard_model(model, mesh, rule)
    opt = fsdp_jax.sharded_optimizer(model, TX, mesh, rule)
    step = fsdp_jax.make_train_step(mesh, rule)
    bs = list(_batches(NamedSharding(mesh, hsdp_jax.batch_spec(mesh))))
    compiled = step.lower(model, opt, *bs[0]).compile(fsdp_jax.compile_options(mesh))
    return [float(compiled(model, opt, *b)) for b in bs], jax_ledger.from_compiled(compiled.compiled, mesh), model


def test_mesh_factors_validated():
    with pytest.raises(ValueError, match=r"replicate\(3\) \* fsdp\(2\) = 6 != 8 devices"):
        hsdp_jax.hsdp_mesh(3, 2, jax.devices()[:8])


def test_jit_hsdp_axes_and_parity(single):
    mesh = hsdp_jax.hsdp_mesh(2, 4, jax.devices()[:8])
    losses, led, model = _jit_run(mesh, hsdp_jax.hsdp_rule(4))
    np.testing.assert_allclose(losses, single, rtol=1e-5, atol=1e-6)
    kernel = model.blocks[0].mlp.fc.kernel.get_value()
    assert kernel.sharding.spec == P("fsdp") and kernel.addressable_shards[0].data.shape == (16, 256)
    axes = Counter((r.op, r.axis) for r in led)
    assert axes[("all_gather", "fsdp")] >= 8                      # the sharded weights, gathered in the shard group
    assert not any(r.op == "all_gather" and r.axis != "fsdp" for r in led)
    assert {r.axis for r in led if r.op == "all_reduce"} >= {"replicate"}  # gradients cross the replica groups
    for r in led:       # groups: 'fsdp' = 4 consecutive devices, 'replicate' = devices d and d+4
        if r.axis == "fsdp":
            assert r.group_size == 4 and list(r.group_ranks) == list(range(r.group_ranks[0], r.group_ranks[0] + 4))
        if r.axis == "replicate":
            assert r.group_size == 2 and r.group_ranks[1] - r.group_ranks[0] == 4


def test_shard_map_hsdp_is_exactly_what_is_written(single):
    mesh = hsdp_jax.hsdp_mesh(2, 4, jax.devices()[:8])
    rule = hsdp_jax.hsdp_rule(4)
    model = models.flax_gpt(CFG, seed=0)
    fsdp_jax.shard_model(model, mesh, rule)
    gd, params = nnx.split(model, nnx.Param)
    specs = fsdp_jax.state_specs(params, 4, rule)
    opt_state = TX.init(params)
    opt_specs = fsdp_jax.state_specs(opt_state, 4, rule)
    opt_state = jax.device_put(opt_state, fsdp_jax.shardings(mesh, opt_specs))
    step = jax.jit(hsdp_jax.shard_map_hsdp_step(gd, TX, mesh, specs, opt_specs))
    bs = list(_batches(NamedSharding(mesh, P(("replicate", "fsdp")))))
    compiled = step.lower(params, opt_state, *bs[0]).compile(fsdp_jax.compile_options(mesh))
    losses = []
    for b in bs:
        params, opt_state, loss = compiled(params, opt_state, *b)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, single, rtol=1e-5, atol=1e-6)
    led = jax_ledger.from_compiled(compiled, mesh)
    kinds = {(r.op, r.axis) for r in led}
    assert kinds == {("all_gather", "fsdp"), ("reduce_scatter", "fsdp"), ("all_reduce", "replicate"),
                     ("all_reduce", "replicate,fsdp")}, kinds
    n_cut = sum(fsdp_jax.sharded_dim(s) is not None for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))
    assert sum(r.op == "all_gather" for r in led) == n_cut
    assert sum(r.op == "reduce_scatter" for r in led) == n_cut
    # the replicate all-reduce carries the reduced shards: (Ψ cut) / F elements, float32
    cut_bytes = sum(int(np.prod(x.shape)) * 4 for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(
        specs, is_leaf=lambda s: isinstance(s, P))) if fsdp_jax.sharded_dim(s) is not None)
    assert sum(r.nbytes for r in led if r.axis == "replicate") == cut_bytes // 4


def test_fsdp_tp_memory_and_parity(single):
    mesh = tp_jax.tp_mesh(4, 2, jax.devices()[:8])
    rule = tp_jax.fsdp_tp_rule(4, 2)
    assert tp_jax.fsdp_tp_spec((64, 256), 4, 2) == P("fsdp", "tensor")
    assert tp_jax.fsdp_tp_spec((64,), 4, 2) == P()
    losses, led, model = _jit_run(mesh, rule)
    np.testing.assert_allclose(losses, single, rtol=1e-5, atol=1e-6)
    k = model.blocks[0].mlp.fc.kernel.get_value()
    assert k.sharding.spec == P("fsdp", "tensor") and k.addressable_shards[0].data.shape == (16, 128)
    held = hsdp_jax.bytes_per_device(nnx.state(model, nnx.Param))
    big = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(nnx.state(model, nnx.Param))
              if tp_jax.fsdp_tp_spec(x.shape, 4, 2) == P("fsdp", "tensor"))
    psi = models.param_count(CFG) * 4
    assert len(set(held)) == 1
    assert held[0] == big // 8 + (psi - big)        # Ψ_big/(F·T), plus the small arrays, replicated
    assert {r.axis for r in led} >= {"fsdp", "tensor"}


def test_jax_fsdp_tp_matches_pytorch_2d_on_the_same_weights_and_data():
    """Lab 06's two FSDP × TP runs agree: JAX on a ('fsdp' 2, 'tensor' 2) mesh and PyTorch's (dp_shard 2, tp 2)
    run, whose losses equal one torch process exactly (tests/test_tp_torch.py), from init_weights and the same
    batches, plain SGD, 3 steps."""
    from course_lib.strategies.tp import torch as tpt
    cfg = models.GPTConfig(d_model=66, n_heads=6, d_ff=198, seq_len=31, vocab_size=67, n_layers=2)
    steps, batch, lr = 3, 8, 0.5
    torch_losses = tpt.train_2d(cfg, 1, 1, steps=steps, batch=batch, lr=lr)["losses"]
    mesh = tp_jax.tp_mesh(2, 2, jax.devices()[:4])
    rule = tp_jax.fsdp_tp_rule(2, 2)
    model = models.flax_gpt(cfg, seed=0)
    fsdp_jax.shard_model(model, mesh, rule)
    opt = fsdp_jax.sharded_optimizer(model, optax.sgd(lr), mesh, rule)
    step = fsdp_jax.make_train_step(mesh, rule)
    task, sharding = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0), NamedSharding(mesh, hsdp_jax.batch_spec(mesh))
    losses = []
    for s in range(steps):
        x, y = (jax.device_put(v.astype(np.int32), sharding) for v in task.global_batch(s, batch))
        losses.append(float(step(model, opt, x, y)))
    assert model.blocks[0].mlp.fc.kernel.get_value().sharding.spec == P("fsdp", "tensor")
    np.testing.assert_allclose(losses, torch_losses, rtol=0, atol=1e-5)
