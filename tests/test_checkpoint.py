"""course_lib.checkpoint.dcp / checkpoint_manager / resumable: DCP save, reshard, resume, faults.

Multi-rank tests use real gloo ranks through course_lib.run; the course GPT has awkward sizes
(vocab 67, d_ff 199, seq_len 31), so every shard at 4 ranks is padded and the last rank holds fewer rows.
Single-process tests (faults, keep-last-K, consolidation) run in the pytest process without a process group.
"""
from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

import course_lib
from course_lib.checks.lab07 import CKPT_CONFIG
from course_lib.models import GPTConfig, TokenTask
from course_lib.checkpoint import dcp as ck
from course_lib.checkpoint import manager as cm

cfg = CKPT_CONFIG   # dropout 0.1: the RNG state matters to an exact resume


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in b if k not in a or not torch.equal(a[k], b[k])] + [k for k in a if k not in b]


# -- reshard on load ----------------------------------------------------------------------------------
def _save(path, steps=2):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt, sched, data = ck.resumable_run(cfg)
    for _ in range(steps):
        ck.train_step(model, opt, sched, data)
    dcp.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), checkpoint_id=path)
    return ck.full_state(model, opt)


def _load(path, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    model, opt, _, _ = ck.resumable_run(cfg, seed=1, mesh=mesh)
    ck.load_model_and_optimizer(model, opt, path)
    return ck.full_state(model, opt)


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("four") / "ckpt")
    return path, course_lib.run(_save, path, world_size=4)[0]


def test_saved_at_4_has_one_file_per_rank_and_metadata(saved4):
    path, full = saved4
    assert list(ck.files_on_disk(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                                            "__3_0.distcp"]
    meta = ck.read_metadata(path).state_dict_metadata
    chunks = [(c.offsets[0], c.sizes[0]) for c in meta["model.blocks.0.mlp.fc.weight"].chunks]
    assert chunks == [(0, 50), (50, 50), (100, 50), (150, 49)]      # 199 rows: torch.chunk, last rank shorter
    assert len(full) == 41 + 3 * 41                                  # weights + Adam exp_avg, exp_avg_sq, step


def test_reshard_4_to_2_to_1_and_hsdp_bit_exact(saved4):
    path, full = saved4
    assert _same(course_lib.run(_load, path, world_size=2)[0], full) == []
    assert _same(course_lib.run(_load, path, hsdp=True, world_size=4)[0], full) == []
    model, opt, _, _ = ck.resumable_run(cfg, seed=1)                # no process group here: a plain module
    ck.load_model_and_optimizer(model, opt, path)
    assert _same(ck.full_state(model, opt), full) == []


def test_consolidate_and_back(saved4, tmp_path):
    path, full = saved4
    one = tmp_path / "model.pt"
    ck.consolidate(path, one)
    whole = torch.load(one, weights_only=True)
    assert all(torch.equal(whole["model"][k[6:]], v) for k, v in full.items() if k.startswith("model."))
    ck.to_dcp(one, tmp_path / "back")
    assert list(ck.files_on_disk(tmp_path / "back")) == [".metadata", "__0_0.distcp"]
    assert _same(course_lib.run(_load, str(tmp_path / "back"), world_size=2)[0], full) == []


def test_consolidate_4_ranks_to_safetensors_bit_exact(saved4, tmp_path):
    """The FSDP2 checkpoint of 4 ranks (every shard padded, the last one shorter) -> one model.safetensors:
    the weights only, under the model's own names, bit for bit; the plain TorchGPT loaded from it too."""
    from course_lib.checkpoint import safetensors as cs
    path, full = saved4
    h = cs.from_dcp(path, tmp_path / "model.safetensors", cfg)
    assert h.source["prefix"] == "model." and h.tensors["blocks.0.mlp.fc.weight"]["shape"] == [199, 66]
    model = cs.load_torch(tmp_path / "model.safetensors", cfg)
    assert [k for k, p in model.named_parameters() if not torch.equal(p, full[f"model.{k}"])] == []


# -- exact resume, with a real crash ------------------------------------------------------------------
def _train(root, steps, save_at=None, die_at=None, resume=False, omit=None):
    import torch.distributed as dist
    r = dist.get_rank()
    torch.manual_seed(1000 + r if not resume else 7)
    model, opt, sched, data = ck.resumable_run(cfg, seed=0 if not resume else 1)
    mgr = cm.Checkpointer(root, keep=2)
    start = 0
    if resume:
        parts = dict(optimizer=opt, scheduler=sched, data=data, rng=True)
        if omit:
            parts[omit] = False if omit == "rng" else None
        start = mgr.load({"app": ck.AppState(model, **parts)}, strict=omit is None)
    losses = {}
    for step in range(start, steps):
        if step == die_at and r == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        losses[step] = ck.train_step(model, opt, sched, data)
        if step + 1 == save_at:
            mgr.save(step + 1, {"app": ck.AppState(model, opt, sched, data)})
    return losses, ck.full_state(model, opt)


def test_resume_after_a_killed_rank_is_bit_exact(tmp_path):
    straight = course_lib.run(_train, str(tmp_path / "a"), 6, world_size=2)
    with pytest.raises(course_lib.RankError, match="rank 1 was killed by SIGKILL"):
        course_lib.run(_train, str(tmp_path / "b"), 6, save_at=3, die_at=4, world_size=2)
    resumed = course_lib.run(_train, str(tmp_path / "b"), 6, resume=True, world_size=2)
    for r in range(2):
        assert sorted(resumed[r][0]) == [3, 4, 5]
        assert all(resumed[r][0][s] == straight[r][0][s] for s in (3, 4, 5))
        assert _same(resumed[r][1], straight[r][1]) == []
    # each omission changes the run: the test that the five pieces are all needed
    for piece in ("optimizer", "scheduler", "data", "rng"):
        other = course_lib.run(_train, str(tmp_path / "b"), 6, resume=True, omit=piece, world_size=2)
        assert _same(other[0][1], straight[0][1]) != [], piece


def _resume_wider(root, rng):
    model, opt, sched, data = ck.resumable_run(cfg, seed=1)
    try:
        return cm.Checkpointer(root).load({"app": ck.AppState(model, opt, sched, data, rng=rng)})
    except ck.CheckpointMismatch as e:
        return str(e)


def test_resume_at_more_ranks_fails_on_every_rank_or_loads_without_rng(tmp_path):
    course_lib.run(_train, str(tmp_path), 2, save_at=2, world_size=2)
    said = course_lib.run(_resume_wider, str(tmp_path), True, world_size=4, timeout=30)
    assert all(s.startswith("on rank(s) [2, 3]: ") and "missing from the checkpoint: ['app.rng.rank2']" in s
               and "rng=False" in s for s in said)                     # all four ranks raise: none waits in dcp.load
    assert list(course_lib.run(_resume_wider, str(tmp_path), False, world_size=4)) == [2] * 4


# -- faults -------------------------------------------------------------------------------------------
def _die_mid_save(root):
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter
    model, opt, sched, data = ck.resumable_run(cfg)
    mgr = cm.Checkpointer(root, keep=2)
    ck.train_step(model, opt, sched, data)
    mgr.save(1, {"app": ck.AppState(model, opt, sched, data)})
    ck.train_step(model, opt, sched, data)
    if dist.get_rank() == 1:
        def write_and_die(self, plan, planner):
            with open(os.path.join(self.path, "__1_0.distcp"), "wb") as f:
                f.write(bytes(100))
            os.kill(os.getpid(), signal.SIGKILL)
        FileSystemWriter.write_data = write_and_die
    mgr.save(2, {"app": ck.AppState(model, opt, sched, data)})


def test_rank_killed_mid_save_leaves_previous_loadable(tmp_path):
    with pytest.raises(course_lib.RankError, match="killed by SIGKILL"):
        course_lib.run(_die_mid_save, str(tmp_path), world_size=2)
    mgr = cm.Checkpointer(tmp_path)
    assert mgr.steps() == [1] and [p.name for p in mgr.incomplete()] == ["step_00000002.partial"]
    assert mgr.latest() == 1 and mgr.ignored() == [f"ignored {mgr.incomplete()[0]}: an unfinished save (never "
                                                   "committed)"]          # what a trainer prints at resume
    with pytest.raises(cm.CheckpointCorrupt, match=r"step_00000002.partial/.metadata does not exist"):
        cm.verify(mgr.incomplete()[0])
    model, opt, sched, data = ck.resumable_run(cfg, seed=1)
    assert mgr.load({"app": ck.AppState(model, opt, sched, data, rng=False)}, strict=False) == 1
    assert data.step == 1


def _one_process_checkpoints(root, steps=(1,), keep=2, config=cfg):
    model, opt, sched, data = ck.resumable_run(config)
    mgr = cm.Checkpointer(root, keep=keep)
    for s in steps:
        ck.train_step(model, opt, sched, data)
        mgr.save(s, {"app": ck.AppState(model, opt, sched, data)})
    return mgr, model, opt


def test_truncated_corrupted_and_metadata_errors_name_the_file(tmp_path):
    mgr, _, _ = _one_process_checkpoints(tmp_path / "ok")
    good = cm.step_dir(tmp_path / "ok", 1)
    assert cm.verify(good)["files"].keys() == {".metadata", "__0_0.distcp"}
    cases = {"truncated": (r"__0_0.distcp is truncated: [\d,]+ bytes on disk, but .metadata needs bytes up to",
                           lambda b: b[: len(b) // 3]),
             "flipped": (r"__0_0.distcp is corrupted: CRC-32 [0-9a-f]{8}, [0-9a-f]{8} at commit",
                         lambda b: b[:len(b) // 2] + bytes([b[len(b) // 2] ^ 1]) + b[len(b) // 2 + 1:])}
    for name, (says, damage) in cases.items():
        bad = tmp_path / name
        shutil.copytree(good, bad)
        f = bad / "__0_0.distcp"
        f.write_bytes(damage(f.read_bytes()))
        with pytest.raises(cm.CheckpointCorrupt, match=says):
            cm.verify(bad)
    bad = tmp_path / "meta"
    shutil.copytree(good, bad)
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:50])
    with pytest.raises(cm.CheckpointCorrupt, match=r"meta/.metadata is unreadable"):
        cm.verify(bad)
    (bad / ".metadata").unlink()
    with pytest.raises(cm.CheckpointCorrupt, match=r".metadata does not exist"):
        cm.verify(bad)


def test_wrong_shapes_and_keys_are_named(tmp_path):
    mgr, _, _ = _one_process_checkpoints(tmp_path)
    other = GPTConfig(seq_len=31, d_ff=200, n_layers=4, dropout=0.1)
    model, opt, sched, data = ck.resumable_run(other, seed=1)
    with pytest.raises(ck.CheckpointMismatch) as err:
        mgr.load({"app": ck.AppState(model, opt, sched, data)})
    text = str(err.value)
    assert "27 shape mismatch(es): app.model.blocks.0.mlp.fc.weight: checkpoint [199, 66], now [200, 66]" in text
    assert "missing from the checkpoint: ['app.model.blocks.3.attn.proj.bias'" in text
    smaller = GPTConfig(seq_len=31, d_ff=199, n_layers=2, dropout=0.1)
    model, opt, sched, data = ck.resumable_run(smaller, seed=1)
    with pytest.raises(ck.CheckpointMismatch, match=r"in the checkpoint but not in this model: \['app.model.blocks.2"):
        mgr.load({"app": ck.AppState(model, opt, sched, data)})
    other_batches = ck.ResumableBatches(TokenTask(cfg.vocab_size, cfg.seq_len), batch_size=16)
    with pytest.raises(ValueError, match=r"batch_size saved 8 vs now 16"):
        other_batches.load_state_dict({"step": 3, "seed": 0, "batch_size": 8})


def test_keep_last_k_never_deletes_the_newest_good_one(tmp_path):
    from torch.distributed.checkpoint import FileSystemWriter
    mgr, model, opt = _one_process_checkpoints(tmp_path, steps=(1, 2, 3), keep=2)
    assert mgr.steps() == [2, 3]
    real = FileSystemWriter.write_data
    FileSystemWriter.write_data = lambda self, plan, planner: (_ for _ in ()).throw(OSError("disk full"))
    try:
        with pytest.raises(BaseException):
            mgr.save(4, {"app": ck.AppState(model, opt, None, None)})
    finally:
        FileSystemWriter.write_data = real
    assert mgr.steps() == [2, 3]                                       # a failed save deletes nothing
    f = cm.step_dir(tmp_path, 3) / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-10])                               # the newest is damaged after its commit
    assert mgr.latest() == 2
    mgr.save(5, {"app": ck.AppState(model, opt, None, None)})
    assert mgr.steps() == [2, 5] and mgr.latest() == 5                 # the damaged 3 went, the good 2 stayed
    with pytest.raises(ValueError, match="keep=0 must be an int >= 1"):
        cm.Checkpointer(tmp_path, keep=0)


# -- async save on its own group ----------------------------------------------------------------------
def _async(root):
    import torch.distributed.checkpoint as dcp
    model, opt, sched, data = ck.resumable_run(cfg)
    ck.train_step(model, opt, sched, data)
    app = {"app": ck.AppState(model, opt, sched, data)}
    try:
        dcp.async_save(app, checkpoint_id=os.path.join(root, "refused"))
        refused = ""
    except AssertionError as e:
        refused = str(e)
    mgr = cm.Checkpointer(root)
    before = ck.full_state(model, opt)
    mgr.save(1, app, blocking=False)
    ck.train_step(model, opt, sched, data)                             # changes the tensors being written
    assert mgr.steps() == [] or mgr.steps() == [1]
    mgr.wait()
    m2, o2, s2, d2 = ck.resumable_run(cfg, seed=1)
    mgr.load({"app": ck.AppState(m2, o2, s2, d2)})
    return refused, mgr.steps(), _same(ck.full_state(m2, o2), before)


def test_async_save_needs_its_own_group_and_snapshots_the_state(tmp_path):
    refused, steps, diff = course_lib.run(_async, str(tmp_path), world_size=2)[0]
    assert "A CPU backend must be enabled for async save" in refused
    assert steps == [1] and diff == []                                 # the state as it was at save()
