"""One writer per checkpoint folder, and reading needs no write access -- through the library's own API
(issue 48), not only through ``python -m course_lib.train``:

* two runs of 2 gloo ranks each, in separate processes, different seeds, saving steps 1-6 with ``keep=2`` into
  one folder: the second :class:`~course_lib.checkpoint.manager.Checkpointer` is refused at its first
  save on both ranks with the same ``FolderBusy`` naming the owner (host, pid, run, command); the first run's
  committed steps are then exactly its own (none deleted, mixed, replaced or unreadable: every step verifies by
  CRC and loads bit-identical to the state the first run saved); the folder is free once the first run closed;
* a dead owner's record is taken over, a live one in this very process refused, ``close()`` releases;
* a read-only folder (a read-only bind mount; root only) constructs and loads bit-identically on 2 ranks,
  takes no lock, and refuses only a save, with one agreed error;
* Orbax's manager (:func:`course_lib.checkpoint.orbax.manager`) takes the folder before its first save.

The first run of the contest is this file run as a script (``python tests/test_checkpoint_owner.py ...``):
``course_lib.run`` in its own process, held open after step 1 until the test lets it go.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from read_only import read_only_view

import course_lib
from course_lib.checks.lab07 import CKPT_CONFIG
from course_lib.checkpoint import manager as cm
from course_lib.checkpoint import owner
from course_lib.checkpoint import dcp as ck

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _writer(root, seed, gate):
    """One run: steps 1-6 saved with keep=2; after step 1, rank 0 says who holds the folder and every rank waits
    for ``gate/go``. Returns the full state after each of steps 5 and 6 (what the folder must still hold)."""
    import torch
    import torch.distributed as dist
    torch.manual_seed(100 * seed + dist.get_rank())
    model, opt, sched, data = ck.resumable_run(CKPT_CONFIG, seed=seed)
    mgr = cm.Checkpointer(root, keep=2)
    states = {}
    for step in range(1, 7):
        ck.train_step(model, opt, sched, data)
        mgr.save(step, {"app": ck.AppState(model, opt, sched, data)})
        states[step] = ck.full_state(model, opt)
        if step == 1 and gate:
            if dist.get_rank() == 0:
                held = {"pid": os.getpid(), "run": mgr.run_id, "host": socket.gethostname()}
                Path(gate, "held.tmp").write_text(json.dumps(held))
                os.replace(Path(gate, "held.tmp"), Path(gate, "held"))
                while not Path(gate, "go").exists():
                    time.sleep(0.05)
            dist.barrier()
    mgr.close()
    return {s: states[s] for s in (5, 6)}


def _intruder(root, seed):
    """The second run on the same folder: it may read (the first run's step 1 loads), but its first save is
    refused. Returns what this rank saw."""
    import torch
    import torch.distributed as dist
    torch.manual_seed(100 * seed + dist.get_rank())
    model, opt, sched, data = ck.resumable_run(CKPT_CONFIG, seed=seed)
    mgr = cm.Checkpointer(root, keep=2)
    loaded = mgr.load({"app": ck.AppState(model, opt, sched, data)})
    ck.train_step(model, opt, sched, data)
    try:
        mgr.save(2, {"app": ck.AppState(model, opt, sched, data)})
        said = None
    except cm.FolderBusy as e:
        said = f"{type(e).__name__}: {e}"
    return {"loaded": loaded, "said": said, "run": mgr.run_id, "owner": mgr.owner is not None}


def _wait_for(path: Path, proc, what: str, timeout=240):
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"{what}: the first run exited {proc.returncode}: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def contest(tmp_path_factory):
    """Run A (a separate process, 2 ranks, seed 1) holds the folder after step 1; run B (this process, 2 ranks,
    seed 2) tries to save there; then A finishes steps 2-6. Returns what each saw and what A saved."""
    tmp = tmp_path_factory.mktemp("contest")
    root, gate, out = tmp / "ck", tmp / "gate", tmp / "a_states.pt"
    gate.mkdir()
    a = subprocess.Popen([sys.executable, __file__, str(root), "1", str(gate), str(out)], env=ENV, cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(gate / "held", a, "run A holding the folder after step 1")
        held = json.loads((gate / "held").read_text())
        b = course_lib.run(_intruder, str(root), 2, world_size=2)
        listing_during = sorted(p.name for p in root.iterdir())
        (gate / "go").touch()
        _, err = a.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.pid, signal.SIGKILL)
        a.wait()
    assert a.returncode == 0, err[-3000:]
    import torch
    return {"root": root, "held": held, "b": list(b), "listing_during": listing_during,
            "a_states": torch.load(out, weights_only=True)}


def test_a_second_checkpointer_is_refused_naming_the_owner_and_nothing_committed_is_touched(contest):
    root, held, b = contest["root"], contest["held"], contest["b"]
    said = [r["said"] for r in b]
    assert said[0] is not None and said[0] == said[1], said          # the same error, the same words, every rank
    assert said[0].startswith(f"FolderBusy: {root} is in use by another trainer: "), said[0]
    assert f"test_checkpoint_owner.py {root} 1 " in said[0]            # the owner's command ...
    assert f", pid {held['pid']} on {held['host']}, run {held['run']}, since " in said[0]   # ... pid, host, run
    assert [r["loaded"] for r in b] == [1, 1]                        # reading the held folder is allowed
    assert not any(r["owner"] for r in b) and b[0]["run"] != held["run"]
    assert contest["listing_during"] == ["step_00000001"]           # B wrote nothing, not even a .partial
    mgr = cm.Checkpointer(root)
    assert mgr.steps() == [5, 6] and mgr.incomplete() == []         # A's pruning kept its newest two
    for s in (5, 6):                                                 # every byte as committed, by A alone
        record = cm.verify(cm.step_dir(root, s))
        assert record["run"] == held["run"] and record["lineage"] == [held["run"]]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000006"]
    assert owner.holder(root) is None                                # A's close() released the folder
    for s in (5, 6):                                                 # loads bit-identical to what A saved
        model, opt, sched, data = ck.resumable_run(CKPT_CONFIG, seed=3)
        assert mgr.load({"app": ck.AppState(model, opt, sched, data, rng=False)}, s, strict=False) == s
        got, want = ck.full_state(model, opt), contest["a_states"][s]
        assert sorted(got) == sorted(want) and [k for k in want if not got[k].equal(want[k])] == [], s


def test_a_dead_owner_is_taken_over_a_live_one_refused_and_close_releases(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "from course_lib.checks.lab07 import CKPT_CONFIG\n"
                              "from course_lib.checkpoint import dcp as ck, manager as cm\n"
                              "m, o, s, d = ck.resumable_run(CKPT_CONFIG)\n"
                              "held = cm.Checkpointer(sys.argv[1], command='doomed')\n"
                              "held.save(1, {'app': ck.AppState(m, o, s, d)})\n"
                              "print('held', flush=True)\ntime.sleep(120)", str(tmp_path)],
                             env=ENV, cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        model, opt, sched, data = ck.resumable_run(CKPT_CONFIG)
        with pytest.raises(cm.FolderBusy, match=f"in use by another trainer: doomed, pid {child.pid} on "):
            cm.Checkpointer(tmp_path).save(2, {"app": ck.AppState(model, opt, sched, data)})
    finally:
        child.kill()
        child.wait()
    assert owner.holder(tmp_path)["pid"] == child.pid               # the record outlives SIGKILL; the lock does not
    with cm.Checkpointer(tmp_path, command="mine") as mgr:
        mgr.save(2, {"app": ck.AppState(model, opt, sched, data)})
        assert mgr.taken_over["pid"] == child.pid and mgr.taken_over["command"] == "doomed"
        assert owner.holder(tmp_path)["command"] == "mine"
        with pytest.raises(cm.FolderBusy, match=f"in use by another trainer: mine, pid {os.getpid()} on "):
            cm.Checkpointer(tmp_path).save(3, {"app": ck.AppState(model, opt, sched, data)})   # this process, too
    assert owner.holder(tmp_path) is None and sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001",
                                                                                             "step_00000002"]
    later = cm.Checkpointer(tmp_path)
    later.save(3, {"app": ck.AppState(model, opt, sched, data)})    # closed: the next writer is welcome
    assert later.taken_over is None
    del later                                                        # dropped without close(): released too
    assert owner.holder(tmp_path) is None


# -- a read-only folder constructs and loads ---------------------------------------------------------------
def _read_only(root, want):
    import torch.distributed as dist
    mgr = cm.Checkpointer(root, keep=2)                              # constructs: nothing written, nothing locked
    model, opt, sched, data = ck.resumable_run(CKPT_CONFIG, seed=5)
    step = mgr.load({"app": ck.AppState(model, opt, sched, data, rng=False)}, strict=False)
    got = ck.full_state(model, opt)
    differ = [k for k in want if not got[k].equal(want[k])]
    try:
        mgr.save(7, {"app": ck.AppState(model, opt, sched, data)})
        said = None
    except cm.CheckpointWriteError as e:
        said = str(e)
    return {"rank": dist.get_rank(), "step": step, "differ": differ, "same_keys": sorted(got) == sorted(want),
            "said": said, "owner": mgr.owner is not None}


def test_a_read_only_folder_constructs_and_loads_bit_identically_on_2_ranks(contest, tmp_path):
    src = contest["root"]
    before = {p.name: cm.crc32_file(p) for p in src.rglob("*") if p.is_file()}
    with read_only_view(src, tmp_path / "ro") as ro:
        seen = course_lib.run(_read_only, str(ro), contest["a_states"][6], world_size=2)
    for r in seen:
        assert r["step"] == 6 and r["same_keys"] and r["differ"] == [], r
        assert not r["owner"]
    assert seen[0]["said"] == seen[1]["said"] and "Read-only file system" in seen[0]["said"], seen
    assert {p.name: cm.crc32_file(p) for p in src.rglob("*") if p.is_file()} == before
    assert owner.holder(src) is None


# -- Orbax ---------------------------------------------------------------------------------------------------
def test_the_orbax_manager_takes_the_folder_before_its_first_save(tmp_path):
    import numpy as np
    from course_lib.checkpoint import orbax as cj
    state = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    first = cj.manager(tmp_path, enable_async=False, command="first")
    assert owner.holder(tmp_path) is None                            # made, not yet saved: not held
    cj.save(first, 1, state)
    assert owner.holder(tmp_path)["command"] == "first" and owner.holder(tmp_path)["pid"] == os.getpid()
    second = cj.manager(tmp_path, enable_async=False)
    assert second.latest_step() == 1                                 # reading is allowed
    with pytest.raises(owner.FolderBusy, match=f"in use by another trainer: first, pid {os.getpid()} on "):
        cj.save(second, 2, {"w": 2 * state["w"]})
    assert first.all_steps() == [1] and sorted(p.name for p in tmp_path.iterdir()) == ["1"]
    first.close()
    assert owner.holder(tmp_path) is None
    cj.save(second, 2, {"w": 2 * state["w"]})                         # the folder is free: taken now
    assert owner.holder(tmp_path)["pid"] == os.getpid()
    second.close()
    assert owner.holder(tmp_path) is None and second.all_steps() == [1, 2]


def test_a_read_only_orbax_folder_restores_and_refuses_only_a_save(tmp_path):
    import jax
    import numpy as np
    from course_lib.checkpoint import orbax as cj
    state = {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}
    mngr = cj.manager(tmp_path / "src", enable_async=False)
    cj.save(mngr, 1, state, {"data_step": 1})
    mngr.close()
    with read_only_view(tmp_path / "src", tmp_path / "ro") as ro:
        mngr = cj.manager(ro)                                        # constructs: nothing written, nothing locked
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        got, meta = cj.restore(mngr, mngr.latest_step(), {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=one)})
        assert np.array_equal(np.asarray(got["w"]), state["w"]) and meta == {"data_step": 1}
        with pytest.raises(OSError, match=f"cannot write checkpoints to {ro}: Read-only file system"):
            cj.save(mngr, 2, state)
        mngr.close()
    assert owner.holder(tmp_path / "src") is None and sorted(p.name for p in (tmp_path / "src").iterdir()) == ["1"]


if __name__ == "__main__":   # run A of the contest: python tests/test_checkpoint_owner.py ROOT SEED GATE OUT
    import torch
    root_, seed_, gate_, out_ = sys.argv[1:5]
    res = course_lib.run(_writer, root_, int(seed_), gate_, world_size=2)
    torch.save(res[0], out_)
