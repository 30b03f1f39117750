"""course_lib.checkpoint.orbax: Orbax save on 8 devices, restore onto 8 -> 4 -> 1 and FSDP × TP (4, 2)
-> 2 -> 1 with target shardings, and resume parity of a jit-compiled FSDP step. Runs in the pytest process (conftest sets up
8 simulated CPU devices before JAX starts)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from course_lib.checkpoint import orbax as cj

ROOT = Path(__file__).resolve().parent.parent


def test_importing_does_not_import_jax_or_orbax():
    code = "import sys, course_lib.checkpoint.orbax; print('jax' in sys.modules, 'orbax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.strip() == "False False", out.stderr[-2000:]


@pytest.fixture(scope="module")
def jx():
    import jax
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX devices (tests/conftest.py sets them up)")
    import optax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    from course_lib import models
    from course_lib.strategies.fsdp import jax as fsdp_jax
    jax.config.update("jax_default_matmul_precision", "highest")
    devices = jax.devices()[:8]
    mesh_of = lambda n: jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices[:n])  # noqa: E731
    mesh8, cfg, tx = mesh_of(8), models.GPTConfig(seq_len=31, d_ff=199), optax.adamw(3e-3)
    task = models.TokenTask(cfg.vocab_size, cfg.seq_len)

    def fresh(seed):
        model = models.flax_gpt(cfg, seed)
        fsdp_jax.shard_model(model, mesh8)
        return model, fsdp_jax.sharded_optimizer(model, tx, mesh8)

    def batch(step):
        x, y = task.global_batch(step, 16)
        return tuple(jax.device_put(a, NamedSharding(mesh8, P("fsdp"))) for a in (x, y))
    return dict(jax=jax, mesh_of=mesh_of, mesh8=mesh8, fresh=fresh, batch=batch,
                step=fsdp_jax.make_train_step(mesh8))


def test_restore_8_to_4_to_1_bit_exact_and_resume_parity(jx, tmp_path):
    jax, step, batch, fresh = jx["jax"], jx["step"], jx["batch"], jx["fresh"]
    model, opt = fresh(0)
    straight = [float(step(model, opt, *batch(s))) for s in range(4)]
    final = jax.tree.map(np.asarray, cj.train_state(model, opt))
    model, opt = fresh(0)
    first = [float(step(model, opt, *batch(s))) for s in range(2)]
    saved = jax.tree.map(np.asarray, cj.train_state(model, opt))
    mngr = cj.manager(tmp_path, keep=2)
    cj.save(mngr, 2, cj.train_state(model, opt), {"data_step": 2})
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2] and cj.incomplete_steps(tmp_path) == []
    assert (tmp_path / "2" / "commit_success.txt").exists() or (tmp_path / "2" / "_CHECKPOINT_METADATA").exists()
    for n in (4, 1):
        state, meta = cj.restore(mngr, 2, cj.restore_target(cj.train_state(model, opt), jx["mesh_of"](n)))
        assert {x.sharding.mesh.size for x in jax.tree.leaves(state)} == {n} and meta == {"data_step": 2}
        assert cj.same_arrays(state, saved) == []
    model2, opt2 = fresh(1)
    state, meta = cj.restore(mngr, 2, cj.restore_target(cj.train_state(model2, opt2), jx["mesh8"]))
    cj.put_state(model2, opt2, state)
    rest = [float(step(model2, opt2, *batch(s))) for s in range(meta["data_step"], 4)]
    assert first + rest == straight
    assert cj.same_arrays(cj.train_state(model2, opt2), final) == []
    mngr.close()


def test_fsdp_x_tp_8_devices_to_fsdp_2_to_1_bit_exact(jx, tmp_path):
    """Issue 21 item 6, the JAX half: a model + AdamW state laid out FSDP over 8 devices is restored onto an
    FSDP × TP (4, 2) mesh, saved from that 2-D layout, and restored onto 2-device FSDP and onto 1 device:
    parameters and Adam's m, v bit for bit. Every array holds its own random values (a slice put in the wrong
    place cannot hide behind a zero or a one). A TP-friendly config (d_model 64, d_ff 200): most kernels are cut
    over both axes, pos_emb (31 rows) falls back to columns, the small vectors are replicated."""
    jax = jx["jax"]
    import optax
    from flax import nnx
    from course_lib import models
    from course_lib.strategies.fsdp import jax as fsdp_jax
    from course_lib.strategies.tp import jax as tp_jax
    tcfg = models.GPTConfig(vocab_size=68, seq_len=31, d_model=64, n_heads=4, n_layers=2, d_ff=200)
    model = models.flax_gpt(tcfg, 0)
    abstract = nnx.eval_shape(lambda: cj.train_state(model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))
    rng = np.random.default_rng(0)
    want = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype) if x.dtype == np.float32
                        else np.full(x.shape, 7, x.dtype), abstract)           # count = 7 steps
    mesh8 = jx["mesh8"]
    mngr = cj.manager(tmp_path / "fsdp8")
    cj.save(mngr, 1, jax.device_put(want, fsdp_jax.shardings(mesh8, fsdp_jax.state_specs(want, 8))))
    mngr.wait_until_finished()
    tp = tp_jax.tp_mesh(4, 2, jax.devices()[:8])
    state, _ = cj.restore(mngr, 1, cj.restore_target(want, tp, tp_jax.fsdp_tp_rule(4, 2)))
    mngr.close()
    specs = {fsdp_jax.path_name(p): tuple(x.sharding.spec) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert specs["model.blocks.0.attn.qkv.kernel"] == ("fsdp", "tensor") == specs["opt.opt_state.0.mu.head.kernel"]
    assert specs["model.pos_emb.embedding"] == (None, "fsdp") and specs["model.ln_f.scale"] == ()
    assert cj.same_arrays(state, want) == []
    mngr = cj.manager(tmp_path / "fsdp_tp")
    cj.save(mngr, 1, state)                                            # saved from the 2-D layout
    mngr.wait_until_finished()
    for n in (2, 1):
        back, _ = cj.restore(mngr, 1, cj.restore_target(want, jx["mesh_of"](n)))
        assert {x.sharding.mesh.size for x in jax.tree.leaves(back)} == {n}
        assert cj.same_arrays(back, want) == []
    mngr.close()


def test_restore_without_shardings_is_refused_and_eval_shape_drops_them(jx, tmp_path):
    jax = jx["jax"]
    from flax import nnx
    from course_lib import models
    model, opt = jx["fresh"](0)
    abstract = nnx.eval_shape(lambda: nnx.state(models.flax_gpt(models.GPTConfig(seq_len=31, d_ff=199), 0)))
    assert all(getattr(x, "sharding", None) is None for x in jax.tree.leaves(abstract))   # flax#5110
    mngr = cj.manager(tmp_path)
    cj.save(mngr, 1, cj.train_state(model, opt))
    mngr.wait_until_finished()
    bare = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cj.train_state(model, opt))
    with pytest.raises(ValueError, match=r"restore target has no sharding for \d+ array\(s\)"):
        cj.restore(mngr, 1, bare)
    mngr.close()


def test_manager_rejects_bad_keep(tmp_path):
    with pytest.raises(ValueError, match="keep=0 must be an int >= 1"):
        cj.manager(tmp_path, keep=0)


KILLED_SAVE = '''
import os, sys, time
import numpy as np
import jax
from course_lib.checkpoint import orbax as cj
mngr = cj.manager(sys.argv[1])
state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(64, np.float32)}
cj.save(mngr, 1, state, {"data_step": 1})
mngr.wait_until_finished()
cj.save(mngr, 2, {k: v * 2 for k, v in state.items()}, {"data_step": 2})
while not os.path.exists(sys.argv[2]):   # the gate: step 2's part is written, the save holds short of its commit
    time.sleep(0.01)
os._exit(9)                       # killed while the async save of step 2 is in flight
'''


def test_process_killed_during_async_save_leaves_previous_step(tmp_path):
    """The save of step 2 is held open by tests/fault_gate (test-only) until the process is killed: without it,
    ``os._exit`` right after ``save()`` returned raced Orbax's background thread, which on a busy machine had not
    yet made step 2's temporary folder (seen once in a full run)."""
    import jax
    from jax.sharding import SingleDeviceSharding
    gate, ck = tmp_path / "gate", tmp_path / "ck"
    gate.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "fault_gate"), str(ROOT)]),
           "COURSE_TEST_SAVE_GATE": str(gate), "COURSE_TEST_SAVE_GATE_PROCESS": "0", "COURSE_TEST_SAVE_GATE_STEP": "2"}
    out = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(ck), str(gate / "saving.process0")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert out.returncode == 9, out.stderr[-2000:]
    assert cj.incomplete_steps(ck) and cj.incomplete_steps(ck)[0].startswith("2.orbax-checkpoint-tmp")
    mngr = cj.manager(ck)
    assert mngr.all_steps() == [1]                                  # the unfinished step 2 is not a step
    one = SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=one),
              "b": jax.ShapeDtypeStruct((64,), np.float32, sharding=one)}
    state, meta = cj.restore(mngr, 1, target)
    assert meta == {"data_step": 1} and np.array_equal(np.asarray(state["w"]), np.arange(4096).reshape(64, 64))
    mngr.close()
