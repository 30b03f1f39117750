"""``python -m course_lib.train_jax`` as a cluster runs it: two processes x two CPU devices, jax.distributed.

Cross-process collectives go through gloo, so this is a real multi-process run. The 4-device checkpoint of
the run that never stopped (``jax_reference``: tests/reference_runs.py) resumes in ONE process with 2 devices
(Orbax reshards on restore). Bad meshes fail before JAX starts. A process killed mid-run, then ``--resume``
onto the same losses bit for bit: tests/test_train_faults.py (killed during a save, the harder case).
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARGS = ["-m", "course_lib.train_jax", "--steps", "8", "--batch", "8", "--n-layers", "2", "--cpu-devices", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
for k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"):   # conftest's 8 simulated devices are not ours
    ENV.pop(k, None)


def curve(path) -> dict[int, float]:
    out = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            out[row["step"]] = row["loss"]
    return out


@pytest.mark.slow
def test_resume_four_devices_at_two(jax_reference, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(jax_reference / "ck", ck)
    shutil.rmtree(ck / "8")
    log = tmp_path / "log.jsonl"
    p = subprocess.run([sys.executable] + ARGS + ["--ckpt-dir", str(ck), "--resume", "--jsonl", str(log)],
                       env=ENV, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert (summary["start"], summary["end"], summary["world_size"], summary["processes"]) == (4, 8, 2, 1)
    got, want = curve(log), curve(jax_reference / "log.jsonl")
    assert sorted(got) == [4, 5, 6, 7]
    assert got == pytest.approx({s: want[s] for s in got}, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("flags, needles", [
    (["--replicate", "3"], ["replicate(3) * shard(1) != WORLD_SIZE(4)"]),
    (["--replicate", "2", "--shard", "4"], ["replicate(2) * shard(4) != WORLD_SIZE(4)"]),
    (["--batch", "6"], ["batch(6) % WORLD_SIZE(4) = 2", "--batch 4 or 8"]),
])
def test_bad_mesh_fails_before_jax_starts(capsys, flags, needles):
    from course_lib.apps import train_jax
    argv = ["--cpu-devices", "2", "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:1"]
    assert train_jax.main(argv + flags) == 2          # a coordinator at port 1 would hang: it is never contacted
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_checkpoint_of_another_model_is_refused_before_the_model_is_built(jax_reference, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(jax_reference / "ck", ck)
    p = subprocess.run([sys.executable] + ARGS + ["--ckpt-dir", str(ck), "--resume", "--d-model", "60",
                                                  "--n-heads", "4"], env=ENV, cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "d_model saved 66 vs now 60" in p.stderr and "n_heads saved 3 vs now 4" in p.stderr, p.stderr
    assert "--d-model 66 --n-heads 3" in p.stderr


def test_bf16_step_computes_in_bf16():
    """--bf16 casts the parameters inside the step: every matmul of the compiled step must then take bf16 operands.
    (nnx.Embed fixes its compute dtype when built, so a bf16 table alone gave fp32 activations everywhere after
    it: on an H200 the step ran at 0.69x torch's speed with 2.1x its memory.)"""
    import re

    import jax
    import jax.numpy as jnp
    import optax
    from course_lib import models
    from course_lib.apps.train_jax import make_step
    from course_lib.strategies.fsdp import jax as fsdp_jax
    from course_lib.strategies.hsdp import jax as hsdp_jax
    cfg = models.GPTConfig(vocab_size=67, seq_len=8, d_model=16, n_heads=2, n_layers=1, d_ff=32)
    mesh, rule = hsdp_jax.hsdp_mesh(1, 1, jax.devices()[:1]), hsdp_jax.hsdp_rule(1)
    model = models.flax_gpt(cfg)
    fsdp_jax.shard_model(model, mesh, rule)
    opt = fsdp_jax.sharded_optimizer(model, optax.adamw(1e-3), mesh, rule)
    x = jnp.zeros((2, 8), jnp.int32)
    for bf16, want in ((True, "bf16"), (False, "f32")):
        step, state = make_step(mesh, rule, bf16, False, model, opt)
        hlo = step.lower(state, x, x).as_text()
        dots = re.findall(r"stablehlo\.dot_general.*?-> tensor<[^>]*x(\w+)>", hlo)
        assert dots and set(dots) == {want}, (bf16, sorted(set(dots)))
