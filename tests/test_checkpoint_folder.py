"""Nothing lost, whatever happens to a checkpoint folder (issue 40): one test per row of the issue's table, and
variants. Each asserts the named error (one line), the exit status, that every complete step of each trainer
still verifies and loads bit-identical (its files' CRC-32s unchanged), that no debris is left and no process.

* two trainers on one ``--ckpt-dir``: the second is refused in one line naming the first (the folder's lock,
  ``course_lib.checkpoint.owner``); a dead owner's lock is taken over; pruning never touches a step
  of another run;
* a full disk at a later save, on one rank only or on all: every rank raises the same ``CheckpointWriteError``
  (one collective), the ``.partial`` is removed; when space runs out the steps beyond ``keep`` go first and the
  save is tried again;
* a read-only folder loads;
* a truncated ``run.json``, the other framework's folder (with and without ``run.json``, resumed or not),
  another model without ``run.json`` (JAX: Orbax's metadata) -- one line each, before anything is loaded;
* 64 ranks on 2 cores: refused naming the limit and its cause, before any batch arithmetic.

JAX peer death (the survivor's one line, exit 3, no C++ dump): tests/test_train_faults.py. The torch trainers
here are single processes (``python -m course_lib.train``, 1 step each): the folder logic is the same at any
world size, and the multi-rank agreement is tested through ``course_lib.run`` (2 gloo ranks).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from read_only import read_only_view

import course_lib
from course_lib.apps import torchrun
from course_lib.apps.train_config import RUN_RECORD
from course_lib.checks.lab07 import CKPT_CONFIG
from course_lib.checkpoint import manager as cm
from course_lib.checkpoint import owner
from course_lib.checkpoint import dcp as ck
from reference_runs import ENV, REPO

TRAIN = [sys.executable, "-m", "course_lib.train", "--batch", "4", "--n-layers", "1"]
AGENT = ["--standalone", "--nproc-per-node", "1", "-m", "course_lib.train", "--batch", "4", "--n-layers", "1"]


def _crcs(root) -> dict:
    """Every file of every committed step -> CRC-32: what "still loads bit-identical" is checked against."""
    return {str(f.relative_to(root)): cm.crc32_file(f) for f in sorted(Path(root).glob("step_*/*"))}


def _one_line(capfd) -> str:
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    return lines[0]


def _stray(path) -> list[str]:
    return subprocess.run(["pgrep", "-f", str(path)], capture_output=True, text=True).stdout.split()


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory):
    """A real capstone checkpoint folder (1 process, 2 steps, saved at 1 and 2) and its files' CRCs."""
    ck_dir = tmp_path_factory.mktemp("dcp") / "ck"
    subprocess.run(TRAIN + ["--steps", "2", "--ckpt-dir", str(ck_dir), "--ckpt-every", "1"], env=ENV, cwd=REPO,
                   check=True, capture_output=True, timeout=300)
    return ck_dir, _crcs(ck_dir)


# -- one owner per folder -----------------------------------------------------------------------------------
def test_a_second_trainer_is_refused_naming_the_first_and_a_dead_owner_is_taken_over(tmp_path, capfd):
    import course_lib.models   # noqa: F401 - what B's preflight imports, imported before A's clock starts
    ck_dir, log = tmp_path / "ck", tmp_path / "a.jsonl"
    ck_dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (ck_dir / owner.LOCK_FILE).write_text(json.dumps({"host": os.uname().nodename, "pid": dead.pid,
                                                      "run_id": "deadbeef0000", "command": "a killed trainer"}))
    a = subprocess.Popen(TRAIN + ["--steps", "100", "--ckpt-dir", str(ck_dir), "--ckpt-every", "1", "--throttle",
                                  "0.5", "--jsonl", str(log)], env=ENV, cwd=REPO, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (ck_dir / "step_00000001").is_dir():
            assert a.poll() is None and time.monotonic() - t0 < 120, a.stderr.read()[-3000:]
            time.sleep(0.05)
        held = owner.holder(ck_dir)
        assert held["pid"] == a.pid and held["command"] == "python -m course_lib.train"
        t0 = time.monotonic()
        assert torchrun.main(AGENT + ["--steps", "100", "--ckpt-dir", str(ck_dir), "--resume"]) == 2
        took = time.monotonic() - t0
        line = _one_line(capfd)
        assert line.startswith(f"course_lib.train: {ck_dir} is in use by another trainer: python -m course_lib.train, "
                               f"pid {a.pid} on {held['host']}, run {held['run_id']}"), line
        assert "point --ckpt-dir at another folder" in line and took < 10
        assert a.poll() is None, "A finished before B was refused: raise A's --steps"
        a.send_signal(signal.SIGTERM)                   # A saves at the end of its step and leaves, lock released
        _, err = a.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.pid, signal.SIGKILL)
    assert a.returncode == 0, err[-3000:]
    assert f"was held by a killed trainer, pid {dead.pid}" in err and "no longer running: taken over" in err, err
    mgr = cm.Checkpointer(ck_dir)
    trained = [json.loads(r)["step"] for r in log.read_text().splitlines() if '"step"' in r]
    last = len(trained)
    assert trained == list(range(last)) and 1 < last < 100       # A trained every step, undisturbed, then stopped
    assert mgr.steps() == [last - 1, last] and mgr.incomplete() == []
    assert all(cm.verify(cm.step_dir(ck_dir, s)) for s in mgr.steps())
    assert not (ck_dir / owner.LOCK_FILE).exists() and _stray(ck_dir) == []


def test_the_lock_is_one_owner_and_released_on_every_exit_path(tmp_path):
    first = owner.take(tmp_path, command="first")
    with pytest.raises(owner.FolderBusy, match=f"in use by another trainer: first, pid {os.getpid()}"):
        owner.take(tmp_path, command="second")
    first.release()
    assert not (tmp_path / owner.LOCK_FILE).exists()
    # SIGKILL: the kernel releases the lock; the file names a dead owner, which the next taker recognises
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from course_lib.checkpoint import "
                              "owner; lock = owner.take(sys.argv[1], command='doomed'); print('held', flush=True); "
                              "time.sleep(60)", str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    with pytest.raises(owner.FolderBusy, match=f"doomed, pid {child.pid}"):
        owner.take(tmp_path, command="second")
    child.kill()
    child.wait()
    with owner.take(tmp_path, command="third") as lock:
        assert lock.stale["pid"] == child.pid and lock.stale["command"] == "doomed"
    assert not (tmp_path / owner.LOCK_FILE).exists()


def _save_steps(mgr, steps):
    model, opt, sched, data = ck.resumable_run(CKPT_CONFIG)
    for s in steps:
        ck.train_step(model, opt, sched, data)
        mgr.save(s, {"app": ck.AppState(model, opt, sched, data)})
    return model, opt, sched, data


def test_pruning_never_removes_a_step_another_run_wrote(tmp_path):
    other = cm.Checkpointer(tmp_path, keep=2)
    _save_steps(other, (1, 2))
    theirs = _crcs(tmp_path)
    other.close()                                     # runs one after another: at the same time, the second is
    mine = cm.Checkpointer(tmp_path, keep=2)          # refused (the folder's lock: tests/test_checkpoint_owner.py)
    _save_steps(mine, (3, 4, 5))
    assert mine.steps() == [1, 2, 4, 5]               # its own step 3 pruned; the other run's 1 and 2 untouched
    assert {k: v for k, v in _crcs(tmp_path).items() if k in theirs} == theirs
    mine.close()
    with pytest.raises(cm.CheckpointWriteError, match=r"step 2 already exists, written by run \w+ \(not this one\)"):
        _save_steps(cm.Checkpointer(tmp_path, keep=2), (2,))   # a third run saving the same step number
    assert {k: v for k, v in _crcs(tmp_path).items() if k in theirs} == theirs and not list(tmp_path.glob("*.partial"))
    resumed = cm.Checkpointer(tmp_path, keep=2)       # a run that resumes the other's step 2 continues its lineage
    model, opt, sched, data = ck.resumable_run(CKPT_CONFIG, seed=1)
    assert resumed.load({"app": ck.AppState(model, opt, sched, data)}, 2) == 2
    ck.train_step(model, opt, sched, data)
    resumed.save(6, {"app": ck.AppState(model, opt, sched, data)})
    assert resumed.steps() == [2, 4, 5, 6] and resumed.incomplete() == []   # the other run's 1 now is its own


# -- read-only folders load -------------------------------------------------------------------------------
def test_a_read_only_folder_loads_and_refuses_only_a_save(dcp_folder, tmp_path):
    src, crcs = dcp_folder
    with read_only_view(src, tmp_path / "ro") as ro:
        mgr = cm.Checkpointer(ro)
        from course_lib.apps.train_config import TrainConfig
        mcfg = TrainConfig(world_size=1, n_layers=1, batch=4).model_config()
        model, opt, sched, data = ck.resumable_run(mcfg, batch_size=4, warmup=8)
        assert mgr.load({"app": ck.AppState(model, opt, sched, data)}) == 2 and data.step == 2
        with pytest.raises(cm.CheckpointWriteError, match=r"cannot write checkpoints to .*Read-only file system"):
            mgr.save(3, {"app": ck.AppState(model, opt, sched, data)})
    assert _crcs(src) == crcs


# -- a full disk: ranks decide together -------------------------------------------------------------------
@contextlib.contextmanager
def _tmpfs(path, kib: int):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _full_disk_on_ranks(root, room_root):
    """On 2 gloo ranks: (1) steps 1, 2 saved; step 3 fails on rank 1 alone (ENOSPC injected in its writer) ->
    every rank's error; (2) in ``room_root`` (a tmpfs holding ~2.5 steps), steps 1-3 with keep=2: step 3 runs
    out of space, step 1 is pruned first, step 3 saved again."""
    import errno
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter
    mgr = cm.Checkpointer(root, keep=3)
    model, opt, sched, data = _save_steps(mgr, (1, 2))
    real = FileSystemWriter.write_data
    if dist.get_rank() == 1:
        def full(self, plan, planner):
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(self.path, "__1_0.distcp"))
        FileSystemWriter.write_data = full
    try:
        ck.train_step(model, opt, sched, data)
        mgr.save(3, {"app": ck.AppState(model, opt, sched, data)})
        said = None
    except BaseException as e:  # noqa: BLE001 - a raw CheckpointException would be a BaseException
        said = f"{type(e).__name__}: {e}"
    finally:
        FileSystemWriter.write_data = real
    roomy = cm.Checkpointer(room_root, keep=2)
    _save_steps(roomy, (1, 2, 3))
    return said, roomy.steps()


def test_a_full_disk_is_one_agreed_error_and_makes_room_before_retrying(tmp_path, capfd):
    room = tmp_path / "room"
    probe = cm.Checkpointer(tmp_path / "size")
    _save_steps(probe, (1,))
    one = sum(f.stat().st_size for f in cm.step_dir(probe.root, 1).iterdir())
    with _tmpfs(room, int(one * 2.6) // 1024 + 64):
        said, steps = zip(*course_lib.run(_full_disk_on_ranks, str(tmp_path / "ck"), str(room / "ck"), world_size=2))
        err = capfd.readouterr().err
        assert said[0] == said[1], said                      # the same error, the same words, on every rank
        assert said[0].startswith(f"CheckpointWriteError: saving step 3 to {tmp_path / 'ck'} failed on rank(s) [1] "
                                  "of 2: OSError: No space left on device"), said[0]
        assert "the last complete checkpoint is step 2. Fix: free space on that disk" in said[0]
        assert steps == ([2, 3], [2, 3])                     # step 1 made room; step 3 saved on the second try
        assert f"no space left to save step 3 in {room / 'ck'}: removed step 1" in err, err
        assert all(cm.verify(cm.step_dir(room / "ck", s)) for s in (2, 3)) and not list((room / "ck").glob("*.partial"))
    mgr = cm.Checkpointer(tmp_path / "ck")
    assert mgr.steps() == [1, 2] and mgr.incomplete() == [] and mgr.latest() == 2   # no debris; 1 and 2 intact


# -- every file the capstone reads ---------------------------------------------------------------------------
def test_a_truncated_run_record_is_one_line(dcp_folder, tmp_path, capfd):
    folder = tmp_path / "ck"
    shutil.copytree(dcp_folder[0], folder)
    record = folder / RUN_RECORD
    record.write_text(record.read_text()[:40])
    assert torchrun.main(AGENT + ["--steps", "3", "--ckpt-dir", str(folder), "--resume"]) == 2
    line = _one_line(capfd)
    assert f"{record} is damaged (JSONDecodeError: " in line and "delete it to resume anyway" in line, line
    from course_lib.apps import train_jax
    record.write_text("[1, 2")
    assert train_jax.main(["--cpu-devices", "1", "--ckpt-dir", str(folder), "--resume"]) == 2
    assert f"{record} is damaged (JSONDecodeError" in _one_line(capfd)


def test_the_other_frameworks_folder_is_named_with_the_command_that_resumes_it(jax_reference, dcp_folder, tmp_path,
                                                                               capfd):
    from course_lib.apps import train_jax
    orbax = tmp_path / "orbax"
    shutil.copytree(jax_reference / "ck", orbax)
    before = sorted(p.name for p in orbax.rglob("*"))
    for resume in (["--resume"], []):
        assert torchrun.main(AGENT + ["--steps", "9", "--ckpt-dir", str(orbax)] + resume) == 2
        line = _one_line(capfd)
        assert (f"--ckpt-dir {orbax} holds Orbax checkpoints written by course_lib.train_jax (steps 4, 8), not DCP "
                f"checkpoints of course_lib.train: resume it with `python -m course_lib.train_jax --ckpt-dir {orbax} "
                "--resume`") in line, line
        (orbax / RUN_RECORD).unlink(missing_ok=True)       # the folder's own contents say it, run.json or not
    assert sorted(p.name for p in orbax.rglob("*")) == [n for n in before if n != RUN_RECORD]
    dcp, crcs = dcp_folder
    assert train_jax.main(["--cpu-devices", "1", "--n-layers", "1", "--batch", "4", "--ckpt-dir", str(dcp),
                           "--resume"]) == 2
    line = _one_line(capfd)
    assert (f"holds DCP checkpoints written by course_lib.train (steps 1, 2), not Orbax checkpoints of "
            f"course_lib.train_jax: resume it with `python -m course_lib.torchrun --standalone --nproc-per-node N -m "
            f"course_lib.train --ckpt-dir {dcp} --resume`") in line, line
    assert torchrun.main(AGENT + ["--steps", "3", "--ckpt-dir", str(dcp)]) == 2   # a fresh start would overwrite
    assert "already holds checkpoints (steps 1, 2) and this run was not asked to resume" in _one_line(capfd)
    assert _crcs(dcp) == crcs


def test_jax_resume_of_another_model_without_run_record_names_the_shapes(jax_reference, tmp_path):
    folder = tmp_path / "ck"
    shutil.copytree(jax_reference / "ck", folder)
    (folder / RUN_RECORD).unlink()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "course_lib.train_jax", "--cpu-devices", "2", "--steps", "8", "--batch",
                        "8", "--n-layers", "2", "--d-model", "60", "--n-heads", "4", "--ckpt-dir", str(folder),
                        "--resume"], env=ENV, cwd=REPO, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert f"the checkpoint {folder / '8'} is of another model (Orbax's metadata, read before loading anything)" \
           in lines[0] and "model.blocks.0.attn.proj.kernel.value saved [66, 66] vs now [60, 60]" in lines[0], lines[0]
    assert took < 60 and sorted(p.name for p in folder.iterdir()) == ["4", "8"]   # nothing written, no lock left


# -- rank limits ----------------------------------------------------------------------------------------------
def test_a_world_size_the_machine_cannot_hold_is_refused_naming_the_limit(capfd, monkeypatch):
    from course_lib.apps import train_config
    monkeypatch.delenv("COURSE_LIB_MAX_WORLD_SIZE", raising=False)
    monkeypatch.setattr("course_lib.runtime.devices.gpu_count", lambda: 0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    argv = ["--standalone", "--nproc-per-node", "64", "-m", "course_lib.train", "--batch", "8"]
    assert torchrun.main(argv) == 2
    line = _one_line(capfd)
    assert ("--nproc-per-node 64 is more ranks than this machine can run (8: cores: 4 per CPU core x 2 core(s)"
            in line and "use --nproc-per-node 8 or fewer" in line and "batch" not in line), line
    monkeypatch.setattr(train_config, "RANK_BYTES", 1 << 40)      # a machine whose memory holds one rank
    assert torchrun.main(argv) == 2
    assert "(1: memory: ~1048576 MB per rank of" in _one_line(capfd)
    monkeypatch.setenv("COURSE_LIB_MAX_WORLD_SIZE", "64")          # the override: on to the next check (the batch)
    assert torchrun.main(argv) == 2
    assert "batch(8) % WORLD_SIZE(64)" in _one_line(capfd)
