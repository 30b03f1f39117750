"""Notebook code runs unchanged under torchrun (the multi-node path): course_lib.run defers to it."""
import os
import subprocess
import sys


def test_run_under_torchrun_two_processes():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "course_lib.torchrun_demo"],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "world=2 mean grad=1.500 (expected 1.500)" in out.stdout
    assert "wire bytes on this rank 17476 vs ring formula 17476" in out.stdout
