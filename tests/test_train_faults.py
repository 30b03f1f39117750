"""The capstones killed *during* a checkpoint save (issue 24, items 3 and 4), nothing lost:

* torch: SIGKILL of the torchrun agent (``python -m course_lib.torchrun``, 2 gloo ranks) while both workers
  are inside DCP's write of step 4. No worker outlives its agent; step 4 stays ``step_00000004.partial``,
  which ``--resume`` names and passes over; step 2 loads and the resumed losses equal a run that never stopped.
* JAX: SIGKILL of one of two ``jax.distributed`` processes while the Orbax save of step 4 is in flight (its
  part written, the commit barrier not reached): process 1 (its heartbeats stop), or process 0, the
  coordinator (it hosts the coordination service every process depends on: the nearest thing ``train_jax``
  has to a launcher -- it has no launching parent; srun, or a person, starts each process). The survivor exits
  with one course_lib line naming the vanished process and its step, status 3 (``jax_peers.PEER_LOST_EXIT``),
  before XLA's own abort (no C++ dump; for the coordinator, XLA's own E/W lines of the failed RPC come first);
  the ``4.orbax-checkpoint-tmp`` folder is named and passed over at
  ``--resume``; step 2 restores, the losses equal a run that never stopped. (Process 1's case is also issue 24's
  "a JAX process whose peer dies exits with a named error within 15 s": a save in flight or a training step, the
  survivor learns of the death the same way, from course_lib.apps.jax_peers' watch: the peer's pid gone on this
  host, its heartbeat key stale on another, or the coordinator's store silent.)

The runs that never stopped are trained once per pytest run, for this file and the others that compare with
them (``tests/reference_runs.py``).

"During" without timing luck: ``tests/fault_gate/sitecustomize.py`` (test-only, first on ``PYTHONPATH``) holds
the save of one step open forever once it has begun, and says so with a file. Each case prints one row
(``pytest -s``): case | expected | observed | time to error | leftovers.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.apps.jax_peers import PEER_LOST_EXIT
from course_lib.checkpoint import owner
from reference_runs import ENV, REPO, SMALL, free_port   # the configuration the runs that never stopped used

GATE = REPO / "tests" / "fault_gate"
TORCHRUN = [sys.executable, "-m", "course_lib.torchrun", "--standalone", "--nproc-per-node", "2", "-m",
            "course_lib.train"] + SMALL
JAX = [sys.executable, "-m", "course_lib.train_jax", "--cpu-devices", "2"] + SMALL
BOUND_S = 15   #: every process of a killed run is gone, or the survivor has said why, within this


def _gated(gate: Path, step: int) -> dict:
    gate.mkdir(parents=True, exist_ok=True)
    return {**ENV, "PYTHONPATH": f"{GATE}{os.pathsep}{REPO}", "COURSE_TEST_SAVE_GATE": str(gate),
            "COURSE_TEST_SAVE_GATE_STEP": str(step)}


def _popen(argv, env=ENV):
    return subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _curve(path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "step" in r}


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent's wait() has already stopped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_for(cond, what: str, procs, timeout=120):
    t0 = time.monotonic()
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"{what}: a process ended first ({dead[0].returncode}): {dead[0].stderr.read()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)


@contextlib.contextmanager
def _row(case: str, expected: str):
    """One line per case, printed at the end whether it passed or not: yields a dict for the test to fill in
    (``observed``: a list of what it saw, in order; ``took``; ``leftovers``)."""
    row = {"observed": [], "took": "-", "leftovers": []}
    try:
        yield row
    finally:
        print(f"\nFAULT | {case} | expected: {expected} | observed: {'; '.join(row['observed'])} | "
              f"time to error: {row['took']} | leftovers: {', '.join(map(str, row['leftovers'])) or 'none'}",
              flush=True)


def _run(argv, env=ENV, timeout=180):
    p = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


# -- torch: the torchrun agent killed during a DCP save ---------------------------------------------------------
def _kill_the_agent_during_the_save(ck, log, gate) -> tuple[int, float, list[int]]:
    """A gated run (2 ranks, checkpoints every 2 steps) whose agent is SIGKILLed while both ranks are inside the
    save of step 4: (the agent's status, seconds until its last worker was gone, workers alive after BOUND_S)."""
    agent = _popen(TORCHRUN + ["--ckpt-dir", str(ck), "--ckpt-every", "2", "--jsonl", str(log)], _gated(gate, 4))
    workers: list[int] = []
    try:
        _wait_for(lambda: len(list(gate.glob("saving.rank*"))) == 2, "both ranks inside the save of step 4", [agent])
        workers = _children(agent.pid)
        assert len(workers) == 2, workers
        os.kill(agent.pid, signal.SIGKILL)                 # the agent only: its workers are not told
        killed = time.monotonic()
        agent.wait(timeout=30)
        while any(map(_alive, workers)) and time.monotonic() - killed < BOUND_S:
            time.sleep(0.05)
        return agent.returncode, time.monotonic() - killed, [w for w in workers if _alive(w)]
    finally:
        for pid in [agent.pid] + workers:                   # torchrun starts each worker in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_of_the_torchrun_agent_during_a_dcp_save(torch_reference, tmp_path):
    from course_lib.checkpoint.manager import Checkpointer, step_dir
    ck, log, gate = tmp_path / "ck", tmp_path / "log.jsonl", tmp_path / "gate"
    with _row("torch: SIGKILL of the torchrun agent during the DCP save of step 4 (2 gloo ranks)",
                             "workers die with the agent; step_00000004.partial named and ignored at --resume; "
                             "step 2 loads; resume exact; no debris left") as row:
        status, took, left = _kill_the_agent_during_the_save(ck, log, gate)
        on_disk = sorted(p.name for p in ck.glob("step_*"))
        row.update(took=f"{took:.2f} s (agent killed -> last worker gone)", leftovers=[f"worker {w}" for w in left])
        row["observed"].append(f"agent status {status}, {2 - len(left)} of 2 workers gone; on disk {on_disk}")
        assert status == -signal.SIGKILL
        assert not left, f"workers {left} outlived their agent by {BOUND_S} s"
        mgr = Checkpointer(ck)   # in this process: no process group
        assert mgr.steps() == [2] and [p.name for p in mgr.incomplete()] == ["step_00000004.partial"], on_disk
        assert mgr.latest() == 2
        again = _run(TORCHRUN + ["--ckpt-dir", str(ck), "--jsonl", str(tmp_path / "resumed.jsonl"), "--resume"])
        named = [line for line in again.stderr.splitlines() if "ignored" in line]
        row["observed"].append(f"--resume says {named}")
        assert named == [f"course_lib.train: ignored {step_dir(ck, 4, partial=True)}: an unfinished save (never "
                         "committed)"], again.stderr[-3000:]
        want = _curve(torch_reference / "log.jsonl")          # the run that never stopped (tests/reference_runs.py)
        before, after = (_curve(tmp_path / n) for n in ("log.jsonl", "resumed.jsonl"))
        differ = [s for s in want if {**before, **after}.get(s) != want[s]]
        row["observed"].append(f"resumed at step {min(after)}; {len(differ)} of {len(want)} losses differ from the "
                               "run that never stopped")
        assert sorted(before) == list(range(4)) and sorted(after) == list(range(2, 8)), (before, after)
        assert {s: before[s] for s in (2, 3)} == {s: after[s] for s in (2, 3)} and {**before, **after} == want
        debris = Checkpointer(ck).incomplete()
        row["observed"].append(f"after --resume: steps {Checkpointer(ck).steps()}, debris {debris}")
        assert debris == []                                 # the resumed run's first commit removed it
        stray = subprocess.run(["pgrep", "-f", str(ck)], capture_output=True, text=True).stdout.split()
        row["leftovers"] += [f"process {p}" for p in stray]
        assert stray == []                                  # nothing of the run left


# -- JAX: one of two processes killed during an Orbax save ------------------------------------------------------
def _jax(extra, envs):
    port = free_port()
    return [_popen(JAX + extra + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                  str(i)], env) for i, env in enumerate(envs)]


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["process-1", "process-0-the-coordinator"])
def test_sigkill_of_a_jax_process_during_an_orbax_save(jax_reference, tmp_path, victim):
    from course_lib.checkpoint import orbax as cj
    ck, log, gate = tmp_path / "ck", tmp_path / "log.jsonl", tmp_path / "gate"
    extra = ["--ckpt-dir", str(ck), "--ckpt-every", "2"]
    envs = [_gated(gate, 4), _gated(gate, 4)]
    envs[victim]["COURSE_TEST_SAVE_GATE_PROCESS"] = str(victim)
    with _row(f"JAX: SIGKILL of process {victim} of 2 during the Orbax save of step 4",
              f"survivor exits {PEER_LOST_EXIT} within {BOUND_S} s, one course_lib line naming the vanished process "
              "and the step, no C++ dump; 4.orbax-checkpoint-tmp named and "
              "ignored at --resume; step 2 restores; resume exact; no debris left") as row:
        procs = _jax(extra + ["--jsonl", str(log)], envs)
        survivor = procs[1 - victim]
        try:
            _wait_for(lambda: (gate / f"saving.process{victim}").exists(), f"process {victim} inside the save", procs)
            os.killpg(procs[victim].pid, signal.SIGKILL)
            killed = time.monotonic()
            try:
                _, err = survivor.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                err = "(still running after 60 s)"
            took = time.monotonic() - killed
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        tmp = cj.incomplete_steps(ck)
        said = [line.rpartition("\r")[2] for line in err.splitlines() if "course_lib.train_jax: process" in line]
        row.update(took=f"{took:.2f} s (kill -> survivor exit)")
        row["observed"].append(f"survivor status {survivor.returncode}, says {said!r}; on disk "
                               f"{sorted(p.name for p in ck.iterdir())}")
        # process 0 too: XLA's fatal path is std::terminate there, which jax_peers owns (see its docstring)
        assert survivor.returncode == PEER_LOST_EXIT and took < BOUND_S, (took, err[-3000:])
        assert len(said) == 1 and said[0].startswith(f"course_lib.train_jax: process {victim} of 2 (pid "
                                                     f"{procs[victim].pid} on "), err[-3000:]
        assert " vanished (" in said[0] and "at step " in said[0] and "start every process again with " \
            "--resume" in said[0], said[0]
        assert "Traceback" not in err and "Check failure" not in err and not re.search(r"(?m)^F\d{4} ", err), \
            err[-3000:]   # no Python traceback, no XLA fatal log, no C++ stack
        if victim == 1:
            assert owner.holder(ck) is None                 # the survivor released the folder (process 0 held it)
        else:                                               # the holder was killed: its record names it, for
            assert owner.holder(ck)["pid"] == procs[0].pid  # --resume to take over
        assert tmp and tmp[0].startswith("4.orbax-checkpoint-tmp"), tmp
        resumed = tmp_path / "resumed.jsonl"
        again = _jax(extra + ["--resume", "--jsonl", str(resumed)], [ENV, ENV])
        err0 = [p.communicate(timeout=180)[1] for p in again][0]
        assert [p.returncode for p in again] == [0, 0], err0[-3000:]
        named = [line for line in err0.splitlines() if "ignored" in line]
        row["observed"].append(f"--resume says {named}")
        assert named == [f"course_lib.train_jax: ignored {ck / tmp[0]}: an unfinished save (never committed)"], \
            err0[-3000:]
        want, before, after = _curve(jax_reference / "log.jsonl"), _curve(log), _curve(resumed)
        differ = [s for s in want if {**before, **after}.get(s) != want[s]]
        row["observed"].append(f"resumed at step {min(after)}; {len(differ)} of {len(want)} losses differ from the "
                               "run that never stopped")
        assert sorted(after) == list(range(2, 8)), after
        assert {**before, **after} == want
        row["observed"].append(f"after --resume: on disk {sorted(p.name for p in ck.iterdir())}")
        assert cj.incomplete_steps(ck) == []                 # the resumed run wrote step 4 afresh: no debris left
        stray = subprocess.run(["pgrep", "-f", str(ck)], capture_output=True, text=True).stdout.split()
        row["leftovers"] += [f"process {p}" for p in stray]
        assert stray == []                                  # nothing of the run left
