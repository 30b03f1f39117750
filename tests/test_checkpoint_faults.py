"""The checkpoint manager under damage it must survive: a deleted or damaged COMMIT.json, another run's
.metadata, a read-only or full folder, a load into other dtypes -- each one named error, and a resume from
what is left gives the same losses as a run that never stopped.

One process, no process group (the manager's collectives are skipped), the course GPT of Lab 07 (dropout on,
so the RNG state matters). A killed rank mid-save is in tests/test_checkpoint.py (real gloo ranks). The full
and read-only folders are real: small tmpfs mounts (root only; skipped otherwise), unmounted afterwards.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest
import torch

from course_lib.checks.lab07 import CKPT_CONFIG
from course_lib.models import GPTConfig
from course_lib.checkpoint import manager as cm
from course_lib.checkpoint import dcp as ck

cfg = CKPT_CONFIG
STEPS = 4


def _train(root, *, saves=(), resume=False, keep=3, config=cfg, **mgr_kw):
    """Steps 0..STEPS-1 (from the checkpoint with ``resume``), saving after the steps in ``saves``.
    Returns (manager, {step: loss})."""
    torch.manual_seed(1000 if not resume else 7)
    model, opt, sched, data = ck.resumable_run(config, seed=0 if not resume else 1)
    mgr = cm.Checkpointer(root, keep=keep, **mgr_kw)
    start = mgr.load({"app": ck.AppState(model, opt, sched, data)}) if resume else 0
    losses = {}
    for step in range(start, STEPS):
        losses[step] = ck.train_step(model, opt, sched, data)
        if step + 1 in saves:
            mgr.save(step + 1, {"app": ck.AppState(model, opt, sched, data)})
    return mgr, losses


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("straight"))[1]


@pytest.fixture
def saved(tmp_path):
    """Steps 1 and 2 committed; returns (root, step 2's directory)."""
    _train(tmp_path / "ck", saves=(1, 2))
    return tmp_path / "ck", cm.step_dir(tmp_path / "ck", 2)


def _flip_a_data_byte(step_dir):
    f = step_dir / "__0_0.distcp"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 1
    f.write_bytes(bytes(b))


def _resumes_exactly_from_step_1(root, straight):
    mgr, losses = _train(root, resume=True)
    assert sorted(losses) == [1, 2, 3] and all(losses[s] == straight[s] for s in losses)
    return mgr


def test_a_step_without_its_commit_record_is_not_a_checkpoint(saved, straight):
    root, two = saved
    (two / cm.COMMIT_FILE).unlink()
    _flip_a_data_byte(two)                     # nothing records the right bytes any more: it must not load
    with pytest.raises(cm.CheckpointCorrupt, match=r"step_00000002/COMMIT.json is missing: this step was never "
                                                   r"committed"):
        cm.verify(two)
    mgr = cm.Checkpointer(root)
    assert mgr.latest() == 1
    assert mgr.ignored() == [f"skipped step 2: {two / cm.COMMIT_FILE} is missing: this step was never committed (a "
                             "save that crashed before its commit, or a deleted commit record), so it is not a "
                             "checkpoint"]
    _resumes_exactly_from_step_1(root, straight)


@pytest.mark.parametrize("damage, says", [
    (lambda t: t[: len(t) // 2], r"COMMIT.json is damaged \(JSONDecodeError"),
    (lambda t: "[]", r"COMMIT.json is damaged \(TypeError"),
    (lambda t: t.replace('"step": 2', '"step": 9'), r"COMMIT.json records step 9, but the directory is step 2"),
], ids=["truncated", "not-a-record", "another-step"])
def test_a_damaged_commit_record_is_named_and_the_previous_step_is_used(saved, straight, damage, says):
    root, two = saved
    f = two / cm.COMMIT_FILE
    f.write_text(damage(f.read_text()))
    with pytest.raises(cm.CheckpointCorrupt, match=says):
        cm.verify(two)
    assert cm.Checkpointer(root).latest() == 1
    _resumes_exactly_from_step_1(root, straight)


def test_a_metadata_file_from_another_run_is_named(saved, tmp_path, straight):
    root, two = saved
    other, _ = _train(tmp_path / "other", saves=(2,), config=GPTConfig(seq_len=31, d_ff=200, n_layers=4, dropout=0.1))
    shutil.copy(cm.step_dir(other.root, 2) / ".metadata", two / ".metadata")
    with pytest.raises(cm.CheckpointCorrupt, match=r"step_00000002/.metadata is not the .metadata this step was "
                                                   r"committed with .* another run's"):
        cm.verify(two)
    _resumes_exactly_from_step_1(root, straight)


def test_loading_into_other_dtypes_names_each_tensor(saved):
    root, _ = saved
    model, opt, sched, data = ck.resumable_run(cfg, seed=1)
    model.to(torch.bfloat16)
    with pytest.raises(ck.CheckpointMismatch, match=r"dtype mismatch\(es\): app.model.\S+: checkpoint "
                                                    r"torch.float32, now torch.bfloat16"):
        cm.Checkpointer(root).load({"app": ck.AppState(model, None, rng=False)}, strict=False)


# -- read-only and full folders: real filesystems ---------------------------------------------------------
@contextlib.contextmanager
def tmpfs(path, size: str, readonly=False):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (a read-only or full folder root cannot write around)")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if readonly else ""), "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def test_a_read_only_or_full_folder_fails_at_start_in_one_named_error(tmp_path):
    with tmpfs(tmp_path / "ro", "1m", readonly=True) as ro:
        with pytest.raises(cm.CheckpointWriteError, match=rf"cannot write checkpoints to {ro}/ck: OSError: "
                                                          r"Read-only file system. Fix: point"):
            _train(ro / "ck", probe=True)
    with tmpfs(tmp_path / "tiny", "16k") as tiny:
        with pytest.raises(cm.CheckpointWriteError, match=r"No space left on device"):
            _train(tiny, probe=True)
        assert os.listdir(tiny) == []                          # the probe left nothing behind


def _one_checkpoint_bytes(tmp_path) -> int:
    mgr, _ = _train(tmp_path / "measure", saves=(1,))
    return sum(f.stat().st_size for f in cm.step_dir(mgr.root, 1).iterdir())


def test_a_disk_that_fills_mid_run_removes_the_debris_and_can_train_on(tmp_path, straight):
    room = int(_one_checkpoint_bytes(tmp_path) * 1.6)          # step 1 fits, step 2 does not
    with tmpfs(tmp_path / "disk", f"{room // 1024}k") as disk:
        with pytest.raises(cm.CheckpointWriteError, match=r"saving step 2 to .* failed: .* the disk is full .*partial "
                                                          r"directory was removed, the last complete checkpoint is "
                                                          r"step 1"):
            _train(disk / "a", saves=(1, 2), keep=2)
        assert sorted(os.listdir(disk / "a")) == ["step_00000001"]   # no .partial left
        shutil.rmtree(disk / "a")
        mgr, losses = _train(disk / "b", saves=(1, 2), keep=2, on_save_error="warn")
        assert losses == straight and mgr.steps() == [1] and mgr.incomplete() == []
        _resumes_exactly_from_step_1(disk / "b", straight)
