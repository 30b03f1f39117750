"""The capstone's command line under bad input and signals: every flag checked before any rank starts, one
line naming the value and the fix, printed once; SIGTERM to the launcher saves, resumes exactly and exits
143 without a traceback. (A JAX process whose peer dies, stopping within 15 s and naming the dead task:
tests/test_train_faults.py, whose process-1 case is that death.)

``python -m course_lib.torchrun`` (torchrun with the capstone's flags checked in the launching process) is
called in-process for the bad-input cases: they must stop before torchrun starts anything.
"""
from __future__ import annotations

import contextlib
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.apps import torchrun
from course_lib.apps.train_config import QUIET_RANK_WAIT_S, RUN_RECORD
from reference_runs import SMALL          # the flags torch_reference was trained with

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
for k in ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES"):
    ENV.pop(k, None)
TORCHRUN = ["--standalone", "--nproc-per-node", "2", "-m", "course_lib.train"]


@contextlib.contextmanager
def read_only_folder(path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a read-only tmpfs (root writes through permission bits)")
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="module")
def one_layer_ckpt(tmp_path_factory):
    """A real DCP checkpoint of a 1-layer model (one process, 1 step); its run.json is removed by the tests that
    need a folder without one."""
    ck = tmp_path_factory.mktemp("other") / "ck"
    subprocess.run([sys.executable, "-m", "course_lib.train", "--steps", "1", "--batch", "4", "--n-layers", "1",
                    "--ckpt-dir", str(ck)], env=ENV, cwd=REPO, check=True, capture_output=True, timeout=300)
    return ck


def _bad(capfd, argv, *needles):
    assert torchrun.main(TORCHRUN + argv) == 2
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err                   # exactly one line, once: no rank started, no ChildFailedError
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv, needles", [
    (["--lr", "-1"], ["--lr -1.0 must be a positive learning rate (default 0.003)"]),
    (["--steps", "-3", "--keep", "-1"], ["--steps -3 must be a positive int (default 20)", "--keep -1 must be"]),
    (["--jsonl", "/nonexistent-folder/log.jsonl"], ["the folder /nonexistent-folder does not exist",
                                                    "mkdir -p /nonexistent-folder"]),
    (["--strategy", "zero9"], ["unrecognized arguments: --strategy zero9 (see --help)"]),
    (["--d-model", "x"], ["argument --d-model: invalid int value: 'x'"]),
], ids=["negative-lr", "negative-steps-keep", "jsonl-missing-folder", "unknown-strategy", "bad-int"])
def test_bad_flags_are_one_line_before_any_rank(capfd, argv, needles):
    _bad(capfd, argv, *needles)


def test_resume_from_a_folder_that_does_not_exist_is_refused(capfd, tmp_path):
    _bad(capfd, ["--resume", "--ckpt-dir", str(tmp_path / "typo")],
         f"--resume --ckpt-dir {tmp_path / 'typo'}: no such folder, so nothing to resume")


def test_a_read_only_checkpoint_folder_is_refused(capfd, tmp_path):
    with read_only_folder(tmp_path / "ro") as ro:
        _bad(capfd, ["--ckpt-dir", str(ro / "ck")], f"--ckpt-dir {ro / 'ck'}: {ro} is not writable")


def test_more_ranks_than_this_machine_runs(capfd, monkeypatch):
    monkeypatch.setenv("COURSE_LIB_MAX_WORLD_SIZE", "3")
    monkeypatch.setattr("course_lib.runtime.devices.gpu_count", lambda: 0)
    assert torchrun.main(["--standalone", "--nproc-per-node", "4", "-m", "course_lib.train", "--batch", "8"]) == 2
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0 and "--nproc-per-node 4 is more ranks than this machine can run (3" in err, err


def test_another_models_checkpoint_with_and_without_its_run_record(capfd, one_layer_ckpt, tmp_path):
    line = _bad(capfd, ["--resume", "--ckpt-dir", str(one_layer_ckpt), "--n-layers", "2", "--batch", "4"],
                "n_layers saved 1 vs now 2", "--n-layers 1")
    bare = tmp_path / "bare"
    import shutil
    shutil.copytree(one_layer_ckpt, bare)
    (bare / RUN_RECORD).unlink()
    line = _bad(capfd, ["--resume", "--ckpt-dir", str(bare), "--n-layers", "2", "--d-ff", "200", "--batch", "4"],
                "is of another model (its .metadata, read before loading anything)", "app.model.blocks.0.mlp.fc.weight "
                "saved [198, 66] vs now [200, 66]", "15 tensor(s) differ", "point --ckpt-dir at a new directory")
    assert "Traceback" not in line


def test_under_plain_torchrun_a_slow_rank_0_still_says_why(tmp_path):
    """Rank 0 reaches its check 3 s after rank 1 (a loaded machine): rank 1 must not exit first, or torchrun stops
    rank 0 before it prints (seen in a full run: torchrun's summary alone, no reason). Rank 1 waits for torchrun's
    SIGTERM, which rank 0's exit brings at once: the run still fails fast."""
    (tmp_path / "sitecustomize.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n")
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ENV['PYTHONPATH']}"}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run"] + TORCHRUN + ["--lr", "-1"], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stderr.count("--lr -1.0 must be a positive learning rate") == 1, out.stderr
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*2\b", out.stderr), out.stderr  # rank 0 exited itself
    assert time.monotonic() - t0 < 3 + QUIET_RANK_WAIT_S, "rank 1 waited out its whole wait: rank 0's exit should end it"


def test_under_plain_torchrun_only_rank_0_speaks(tmp_path):
    """Each worker checks again (plain torchrun has no parent-side check): rank 0 prints the line, the others
    exit with the same status in silence. torchrun's own ChildFailedError summary follows (torchrun's code)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run"] + TORCHRUN + ["--lr", "-1"], env=ENV,
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.count("--lr -1.0 must be a positive learning rate") == 1, out.stderr
    # torchrun reports the first failure (status 2) and may stop the other worker before it exits by itself
    # (then -15): at least one 2, and nothing but 2 or -15
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, codes
    assert out.stderr.split("\n")[0].startswith("course_lib.train: bad configuration")   # ours comes first


def _curve(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "step" in r}


def _launch(extra, **kw):
    return subprocess.Popen([sys.executable, "-m", "course_lib.torchrun"] + TORCHRUN + SMALL + extra, env=ENV,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


@pytest.mark.slow
def test_sigterm_to_the_agent_saves_resumes_exactly_and_exits_143(torch_reference, tmp_path):
    """`python -m course_lib.torchrun` is the agent here: SIGTERM to it reaches the workers (torchrun forwards
    it), they save at the end of the step and leave; the agent exits 143, no traceback; --resume is exact."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    agent = _launch(["--ckpt-dir", str(ck), "--jsonl", str(log), "--throttle", "0.5"])
    try:
        t0 = time.monotonic()
        while not (log.exists() and len(log.read_text().splitlines()) >= 2):
            assert agent.poll() is None and time.monotonic() - t0 < 120, agent.stderr.read()[-3000:]
            time.sleep(0.1)
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
    assert agent.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "stopped by SIGTERM" in err, err[-3000:]
    saved = sorted(p.name for p in ck.glob("step_*"))
    assert saved and not any(p.endswith(".partial") for p in saved) and "step_00000008" not in saved, saved
    again = _launch(["--ckpt-dir", str(ck), "--jsonl", str(log), "--resume"])
    assert again.wait(timeout=180) == 0, again.stderr.read()[-3000:]
    assert _curve(log) == _curve(torch_reference / "log.jsonl")      # the run that never stopped
    assert subprocess.run(["pgrep", "-f", str(ck)], capture_output=True).stdout == b""   # no worker left behind
