"""``python -m course_lib.train_jax`` as a cluster runs it: two processes x two CPU devices, jax.distributed.

Cross-process collectives go through gloo, so this is a real multi-process run. Process 1 is SIGKILLed
mid-run, process 0 stopped; both restart with ``--resume`` (Orbax's newest complete step) and the loss
curve must equal an uninterrupted run's bit for bit. The 4-device checkpoint also resumes in ONE process
with 2 devices (Orbax reshards on restore). Bad meshes fail before JAX starts.
"""
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARGS = ["-m", "course_lib.train_jax", "--steps", "8", "--batch", "8", "--n-layers", "2", "--cpu-devices", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
for k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"):   # conftest's 8 simulated devices are not ours
    ENV.pop(k, None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def curve(path) -> dict[int, float]:
    out = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            out[row["step"]] = row["loss"]
    return out


def start(extra, nproc=2):
    port = free_port()
    return [subprocess.Popen([sys.executable] + ARGS + extra + ["--coordinator", f"127.0.0.1:{port}",
                                                                  "--num-processes", str(nproc), "--process-id", str(i)],
                             env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True) for i in range(nproc)]


def finish(procs, timeout=120):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
            outs.append(out)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    return outs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("jref")
    finish(start(["--ckpt-dir", str(d / "ck"), "--ckpt-every", "4", "--jsonl", str(d / "log.jsonl")]))
    return d


@pytest.mark.slow
def test_two_processes_killed_and_resumed_equal_uninterrupted(reference, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    extra = ["--ckpt-dir", str(ck), "--ckpt-every", "2", "--jsonl", str(log)]
    procs = start(extra + ["--throttle", "0.4"])
    try:
        t0 = time.monotonic()
        while not (ck / "4").is_dir():               # Orbax renames <step>.orbax-checkpoint-tmp -> <step> when complete
            assert all(p.poll() is None for p in procs), procs[0].stderr.read()[-3000:]
            assert time.monotonic() - t0 < 90, "no checkpoint at step 4"
            time.sleep(0.1)
        os.killpg(procs[1].pid, signal.SIGKILL)
        os.killpg(procs[0].pid, signal.SIGKILL)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert not (ck / "8").exists(), "the run finished before the kill: raise --throttle"
    finish(start(extra + ["--resume"]))
    got, want = curve(log), curve(reference / "log.jsonl")
    assert sorted(got) == list(range(8))
    assert got == want, f"resumed curve differs: {got} vs {want}"


@pytest.mark.slow
def test_resume_four_devices_at_two(reference, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(reference / "ck", ck)
    shutil.rmtree(ck / "8")
    log = tmp_path / "log.jsonl"
    p = subprocess.run([sys.executable] + ARGS + ["--ckpt-dir", str(ck), "--resume", "--jsonl", str(log)],
                       env=ENV, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    assert (summary["start"], summary["end"], summary["world_size"], summary["processes"]) == (4, 8, 2, 1)
    got, want = curve(log), curve(reference / "log.jsonl")
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


def test_checkpoint_of_another_model_is_refused_before_the_model_is_built(reference, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(reference / "ck", ck)
    p = subprocess.run([sys.executable] + ARGS + ["--ckpt-dir", str(ck), "--resume", "--d-model", "60",
                                                  "--n-heads", "4"], env=ENV, cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "d_model saved 66 vs now 60" in p.stderr and "n_heads saved 3 vs now 4" in p.stderr, p.stderr
    assert "--d-model 66 --n-heads 3" in p.stderr
