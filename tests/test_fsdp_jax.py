"""course_lib.strategies.fsdp.jax: sharding rules, the jit (GSPMD) FSDP step and the shard_map FSDP step.

Everything that computes runs once, in :data:`SCRIPT`, on the 8 simulated CPU devices every pytest process has
(``tests/conftest.py`` asks for them before any test module imports JAX; a subprocess cost another interpreter
importing JAX, Flax and optax for nothing). Its ``out`` becomes plain JSON; the tests below only read it.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from course_lib.strategies.fsdp import jax as fsdp_jax

ROOT = Path(__file__).resolve().parent.parent


def test_importing_does_not_import_jax():
    code = "import sys, course_lib, course_lib.strategies.fsdp.jax; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_spec_table_plans_from_shapes():
    state = {"w": np.zeros((64, 256), np.float32), "b": np.zeros((256,), np.float32),
             "odd": np.zeros((66, 198), np.float32)}                          # nothing divides by 8
    table = fsdp_jax.spec_table(state, 8)
    lines = {l.split()[0]: l for l in table.splitlines()[1:-1]}
    assert "P('fsdp'" in lines["w"] and lines["w"].split()[-1] == f"{64 * 256 * 4 // 8:,}"
    assert "P()" in lines["b"] and "P()" in lines["odd"]
    held = 64 * 256 * 4 // 8 + 256 * 4 + 66 * 198 * 4
    assert table.splitlines()[-1].split()[1] == f"{held:,}"


SCRIPT = textwrap.dedent('''
    import json, math
    import numpy as np
    import course_lib
    devices = course_lib.setup_jax(8)
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from course_lib.maths import costs
    from course_lib.strategies.fsdp import jax as fsdp_jax
    from course_lib.comm import jax_ledger
    from course_lib import models
    from course_lib.models.data import TokenTask

    out, K, B = {}, 3, 32
    tx = optax.adamw(3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)

    def mesh_of(n):
        return jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices[:n])

    def batches(cfg, mesh):
        task, sh = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0), NamedSharding(mesh, P("fsdp"))
        for s in range(K):
            x, y = task.global_batch(s, B)
            yield jax.device_put(x.astype(np.int32), sh), jax.device_put(y.astype(np.int32), sh)

    def run_jit(cfg, mesh, remat=False):
        model = models.flax_gpt(cfg, seed=0)
        fsdp_jax.shard_model(model, mesh)
        opt = fsdp_jax.sharded_optimizer(model, tx, mesh)
        step, losses, compiled = fsdp_jax.make_train_step(mesh, remat=remat), [], None
        for x, y in batches(cfg, mesh):
            compiled = compiled or step.lower(model, opt, x, y).compile(fsdp_jax.compile_options(mesh))
            losses.append(float(compiled(model, opt, x, y)))
        return model, opt, compiled, losses

    def run_shard_map(cfg, mesh, gather=None):
        graphdef, params = nnx.split(models.flax_gpt(cfg, seed=0))
        specs = fsdp_jax.state_specs(params, mesh.size)
        params = jax.device_put(jax.tree.map(np.asarray, params), fsdp_jax.shardings(mesh, specs))
        ospecs = fsdp_jax.state_specs(jax.eval_shape(tx.init, params), mesh.size)
        opt = jax.jit(tx.init, out_shardings=fsdp_jax.shardings(mesh, ospecs))(params)
        step = jax.jit(fsdp_jax.shard_map_step(graphdef, tx, mesh, specs, ospecs, gather=gather), donate_argnums=(0, 1))
        losses, compiled = [], None
        for x, y in batches(cfg, mesh):
            compiled = compiled or step.lower(params, opt, x, y).compile(fsdp_jax.compile_options(mesh))
            params, opt, loss = compiled(params, opt, x, y)
            losses.append(float(loss))
        return specs, compiled, losses

    # -- the lab's model on 8 devices ----------------------------------------------------------------
    cfg = models.GPTConfig(vocab_size=512, seq_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256)
    mesh, one = mesh_of(8), mesh_of(1)
    model, opt, compiled, out["jit"] = run_jit(cfg, mesh)
    _, _, ref_compiled, out["ref"] = run_jit(cfg, one)
    specs, sm_compiled, out["shard_map"] = run_shard_map(cfg, mesh, gather=fsdp_jax.gather_vjp())
    _, _, out["shard_map_autodiff"] = run_shard_map(cfg, mesh)

    out["jit_counts"] = dict(jax_ledger.from_compiled(compiled.compiled, mesh).counts())
    sm_ledger = jax_ledger.from_compiled(sm_compiled, mesh)
    out["sm_counts"] = dict(sm_ledger.counts())
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    sharded = [x.shape for x in leaves if fsdp_jax.sharded_dim(x.sharding.spec) is not None]
    replicated = [x.shape for x in leaves if fsdp_jax.sharded_dim(x.sharding.spec) is None]
    analytic = (costs.step_cost("fsdp", [[s] for s in sharded], 8, padding="none", reshard_after_forward=False).wire_bytes
                + costs.step_cost("dp", replicated, 8).wire_bytes)
    out["sm_wire_ratio"] = costs.ledger_wire_bytes(sm_ledger) / analytic
    S, psi = sum(map(math.prod, sharded)), models.param_count(cfg)
    out["args"] = compiled.compiled.memory_analysis().argument_size_in_bytes
    out["args_predicted"] = 12 * (S // 8 + psi - S) + 8 + 2 * (B // 8) * cfg.seq_len * 4
    opt_leaves = jax.tree_util.tree_flatten_with_path(nnx.state(opt))[0]
    out["adam_specs_like_params"] = all(
        x.sharding.spec == fsdp_jax.fsdp_spec(x.shape, 8) for _, x in opt_leaves)
    out["donated_in_place"] = all(x.sharding.spec == fsdp_jax.fsdp_spec(x.shape, 8) for x in leaves)

    # -- forward() is FlaxGPT.__call__, with and without nnx.remat ------------------------------------
    fresh = models.flax_gpt(cfg, seed=0)
    idx = jnp.asarray(TokenTask(cfg.vocab_size, cfg.seq_len).global_batch(0, 4)[0], jnp.int32)
    want = np.asarray(fresh(idx))
    out["forward_err"] = [float(np.abs(np.asarray(fsdp_jax.forward(fresh, idx, r)) - want).max()) for r in (False, True)]
    remat_compiled = fsdp_jax.make_train_step(mesh, remat=True).lower(model, opt, *next(batches(cfg, mesh))).compile(
        fsdp_jax.compile_options(mesh))
    out["remat_all_gathers"] = jax_ledger.from_compiled(remat_compiled.compiled, mesh).counts()["all_gather"]

    # -- awkward sizes (the default GPT: 66, 67, 30, 198) over 2 devices: some arrays cut on dim 1 ----
    odd = models.GPTConfig(n_layers=1)
    mesh2 = mesh_of(2)
    odd_specs, _, out["odd_shard_map"] = run_shard_map(odd, mesh2)
    out["odd_dims"] = sorted({str(s) for s in jax.tree.leaves(odd_specs, is_leaf=lambda s: isinstance(s, P))})
    _, _, _, out["odd_jit"] = run_jit(odd, mesh2)
    _, _, _, out["odd_ref"] = run_jit(odd, one)
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def result():
    scope = {"__name__": "fsdp_jax_script"}
    with contextlib.redirect_stdout(io.StringIO()):   # its RESULT line is for a person running SCRIPT by hand
        exec(compile(SCRIPT, f"{__file__}:SCRIPT", "exec"), scope)
    return json.loads(json.dumps(scope["out"]))     # plain JSON types, as the tests read them


FP32 = dict(rtol=1e-5, atol=1e-6)   # checks.TOLERANCES["fp32"]: same maths, other order of additions


@pytest.mark.slow
def test_jit_fsdp_matches_single_device(result):
    np.testing.assert_allclose(result["jit"], result["ref"], **FP32)
    assert result["ref"][0] == pytest.approx(np.log(512), abs=0.05)   # starts near a uniform guess


@pytest.mark.slow
@pytest.mark.parametrize("key", ["shard_map", "shard_map_autodiff"])
def test_shard_map_fsdp_matches_single_device(result, key):
    np.testing.assert_allclose(result[key], result["ref"], **FP32)


@pytest.mark.slow
def test_compiled_collectives(result):
    # GSPMD on XLA:CPU: 10 forward all-gathers (pos_emb goes through a small all-reduce instead), one
    # combined gradient all-reduce: no reduce-scatter (see ledger_jax's docstring)
    assert result["jit_counts"] == {"all_gather": 10, "all_reduce": 2}
    # by hand: one all-gather and one reduce-scatter per cut array, one all-reduce for the rest
    assert result["sm_counts"] == {"all_gather": 11, "reduce_scatter": 11, "all_reduce": 1}
    assert result["sm_wire_ratio"] == pytest.approx(1.0, abs=1e-4)   # the 4-byte loss psum is the only extra
    assert result["remat_all_gathers"] == 18                            # the 8 block kernels gathered again


@pytest.mark.slow
def test_memory_and_placement(result):
    assert result["args"] == result["args_predicted"]      # 12 (S/N + R) + counters + batch, to the byte
    assert result["adam_specs_like_params"] and result["donated_in_place"]
    assert max(result["forward_err"]) < 1e-5


@pytest.mark.slow
def test_awkward_sizes_cut_another_dim(result):
    assert "P(None, 'fsdp')" in result["odd_dims"] and "P('fsdp',)" in result["odd_dims"]
    np.testing.assert_allclose(result["odd_shard_map"], result["odd_ref"], **FP32)
    np.testing.assert_allclose(result["odd_jit"], result["odd_ref"], **FP32)
