"""course_lib.strategies.checkpoint.jax: Orbax save on 8 devices, restore onto 8 -> 4 -> 1 with target
shardings, and resume parity of a jit-compiled FSDP step. Runs in the pytest process (conftest sets up
8 simulated CPU devices before JAX starts)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from course_lib.strategies.checkpoint import jax as cj

ROOT = Path(__file__).resolve().parent.parent


def test_importing_does_not_import_jax_or_orbax():
    code = "import sys, course_lib.strategies.checkpoint.jax; print('jax' in sys.modules, 'orbax' in sys.modules)"
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
import os, sys
import numpy as np
import jax
from course_lib.strategies.checkpoint import jax as cj
mngr = cj.manager(sys.argv[1])
state = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(64, np.float32)}
cj.save(mngr, 1, state, {"data_step": 1})
mngr.wait_until_finished()
cj.save(mngr, 2, {k: v * 2 for k, v in state.items()}, {"data_step": 2})
os._exit(9)                       # killed while the async save of step 2 is in flight
'''


def test_process_killed_during_async_save_leaves_previous_step(tmp_path):
    import jax
    from jax.sharding import SingleDeviceSharding
    out = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 9, out.stderr[-2000:]
    assert cj.incomplete_steps(tmp_path) and cj.incomplete_steps(tmp_path)[0].startswith("2.orbax-checkpoint-tmp")
    mngr = cj.manager(tmp_path)
    assert mngr.all_steps() == [1]                                  # the unfinished step 2 is not a step
    one = SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32, sharding=one),
              "b": jax.ShapeDtypeStruct((64,), np.float32, sharding=one)}
    state, meta = cj.restore(mngr, 1, target)
    assert meta == {"data_step": 1} and np.array_equal(np.asarray(state["w"]), np.arange(4096).reshape(64, 64))
    mngr.close()
