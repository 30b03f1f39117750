"""The capstones' uninterrupted runs, trained once per pytest run and shared by every test that compares with one.

A resumed run is checked against a run that never stopped, of the same configuration: 8 steps, batch 8, 2
layers. Three test files need the torch one (2 gloo ranks under ``python -m course_lib.torchrun``) or the JAX one
(2 ``jax.distributed`` processes x 2 CPU devices), and each used to train its own: the same losses, bit for
bit, three times over. Under ``pytest-xdist`` the files run on different workers, so a module-scoped fixture
cannot share them; :func:`once` does, with a lock file in the directory the workers of one run share (what
pytest-xdist's documentation recommends for session fixtures). The first worker to ask trains, the others wait
for it and read the same folder. Tests read these folders, or copy them; they never write into them.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--steps", "8", "--batch", "8", "--n-layers", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
for _k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "COURSE_TEST_SAVE_GATE"):
    ENV.pop(_k, None)   # conftest's 8 simulated devices are not the capstone's; no fault gate in a reference


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``make(folder)`` filled, made by whichever worker of this pytest run asked first."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base   # .../pytest-N, this run's own
    folder = shared / f"reference-{name}"
    with open(shared / f"reference-{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes, also if make() raises
        if not (folder / "DONE").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / "DONE").touch()
    return folder


def _check(procs: list[subprocess.Popen], timeout: float = 180) -> None:
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"the reference run failed (exit {p.returncode}): {err[-3000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def torch_run(folder: Path) -> None:
    """2 gloo ranks, never stopped: ``folder/log.jsonl``."""
    argv = [sys.executable, "-m", "course_lib.torchrun", "--standalone", "--nproc-per-node", "2", "-m",
            "course_lib.train", *SMALL, "--jsonl", str(folder / "log.jsonl")]
    _check([subprocess.Popen(argv, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)])


def jax_run(folder: Path) -> None:
    """2 processes x 2 CPU devices, never stopped, an Orbax checkpoint at steps 4 and 8: ``folder/log.jsonl``,
    ``folder/ck``."""
    port = free_port()
    argv = [sys.executable, "-m", "course_lib.train_jax", "--cpu-devices", "2", *SMALL, "--ckpt-dir",
            str(folder / "ck"), "--ckpt-every", "4", "--jsonl", str(folder / "log.jsonl"), "--coordinator",
            f"127.0.0.1:{port}", "--num-processes", "2"]
    _check([subprocess.Popen(argv + ["--process-id", str(i)], env=ENV, cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True) for i in range(2)])
