"""The capstone's Slurm batch scripts (scripts/slurm/) against a real, private Slurm (tests/slurm_cluster.py:
munged, slurmctld and slurmd on loopback, started once for this file): a torch job that runs to the end; a
torch job preempted (SIGTERM to its batch shell, as ``--signal=B:TERM@lead`` does: it saves and requeues
itself), then its node killed mid-run (SIGKILL to slurmd and every process of the job) and requeued by Slurm,
whose losses equal the uninterrupted job's, each start resuming from the newest complete checkpoint; the JAX job
requeued by ``scontrol requeue``, the same; bad arguments refused by the script's preflight in one line, before
any ``srun``. Skipped with one line where Slurm is not installed (``scripts/system-deps.sh`` installs it)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, _free_ports, available  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OK, WHY = available()
needs_slurm = pytest.mark.skipif(not OK, reason=f"no private Slurm here: {WHY}")

MODEL = ["--d-model", "24", "--n-heads", "2", "--n-layers", "1", "--d-ff", "48", "--seq-len", "12", "--batch", "4"]
STEPS = 10
#: What each case saw, for the report: case -> {states, restarts, resume_s, ...}
RECORD: dict[str, dict] = {}


def _preflight(framework, argv, env, tmp_path, capsys, monkeypatch, nproc=2):
    from course_lib.apps import slurm
    for k in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = slurm.main(["preflight", framework, "--nproc-per-node", str(nproc), "--ckpt-dir", str(tmp_path / "ck" / "7"),
                       "--", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_preflight_refuses_in_one_line_without_a_cluster(tmp_path, capsys, monkeypatch):
    """The script's check alone (no Slurm needed): outside a job, a flag the script owns, two tasks on a node for
    torchrun, a mesh that does not cover the world; and a good job's one line."""
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "2"}
    cases = [("torch", [], {}, "not inside a Slurm job (no SLURM_JOB_ID): submit the script with sbatch"),
             ("torch", ["--resume"], job, "--resume: the batch script sets these itself"),
             ("jax", ["--coordinator", "h:1"], job, "--coordinator: the batch script sets these itself"),
             ("torch", [], {**job, "SLURM_NTASKS": "4"}, "SLURM_NTASKS=4 on 2 node(s): the torch script runs one "
                                                        "torchrun agent per node"),
             ("torch", ["--shard", "3"], job, "replicate(1) * shard(3) != WORLD_SIZE(4)"),
             ("jax", ["--shard", "4", "--cpu-devices", "1"], job, "replicate(1) * shard(4) != WORLD_SIZE(2)"),
             ("torch", ["--steps", "x"], job, "bad flags: argument --steps: invalid int value: 'x'")]
    for framework, argv, env, want in cases:
        code, out, err = _preflight(framework, argv, env, tmp_path, capsys, monkeypatch)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (argv, err)
        assert want in err and err.startswith(f"capstone-{framework}: "), (want, err)
    code, out, err = _preflight("torch", ["--shard", "4"], job, tmp_path, capsys, monkeypatch)
    assert code == 0 and "job 7, start 1: 2 node(s) x 2 rank(s), world size 4" in out, err
    assert not (tmp_path / "ck").exists()      # a check writes nothing


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), kill_wait=20) as c:
        yield c
        assert not c.squeue(), c.squeue()
    assert c.leftovers() == [], c.leftovers()
    if os.environ.get("COURSE_SLURM_REPORT"):
        Path(os.environ["COURSE_SLURM_REPORT"]).write_text(json.dumps(RECORD, indent=1))


def _submit(c, tmp, script, args, *, ntasks=1, extra_env=None, jsonl="log.jsonl"):
    env = {"PYTHON": sys.executable, "CKPT_ROOT": str(tmp / "ck"), "OMP_NUM_THREADS": "1",
           "RDZV_PORT": str(_free_ports(1)[0]), "JAX_COORDINATOR_PORT": str(_free_ports(1)[0]),
           "PYTHONPATH": str(ROOT), **(extra_env or {})}
    r = c.sbatch(["--nodes=1", f"--ntasks={ntasks}", f"--cpus-per-task={2 // ntasks}", f"--output={tmp}/%j.out",
                  f"--chdir={ROOT}", f"scripts/slurm/{script}", *MODEL, "--steps", str(STEPS),
                  "--jsonl", str(tmp / jsonl), *args], env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    return r.stdout.strip()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_rows(path: Path, pred, timeout=60, what=""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = _rows(path)
        if pred(rows):
            return rows
        time.sleep(0.1)
    raise TimeoutError(f"{path}: no {what} after {timeout} s; rows {_rows(path)[-3:]}")


def _starts(rows):
    """The rows split at each summary: one list per start that reached its end."""
    out, cur = [], []
    for r in rows:
        cur.append(r)
        if r.get("summary"):
            out.append(cur)
            cur = []
    return out, cur


def _losses(rows):
    return {r["step"]: r["loss"] for r in rows if "step" in r}


def _complete_steps(folder: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if p.name[5:].isdigit() and (p / ".metadata").exists())


@pytest.fixture(scope="module")
def torch_reference(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch_ref")
    t0 = time.monotonic()
    job = _submit(cluster, tmp, "train_torch.sbatch", ["--shard", "2"], extra_env={"NPROC_PER_NODE": "2"})
    info = cluster.wait(job, {"COMPLETED", "FAILED"}, 120)
    out = (tmp / f"{job}.out").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", out[-2000:]
    rows = _rows(tmp / "log.jsonl")
    RECORD["torch runs to the end"] = {"states": ["PENDING", "RUNNING", "COMPLETED"], "restarts": info["Restarts"],
                                       "exit": info["ExitCode"], "wall_s": round(time.monotonic() - t0, 1),
                                       "final_loss": rows[-2]["loss"]}
    return tmp, job, rows


@needs_slurm
@pytest.mark.slow
def test_torch_job_runs_to_the_end(cluster, torch_reference):
    tmp, job, rows = torch_reference
    starts, rest = _starts(rows)
    assert len(starts) == 1 and not rest and starts[0][-1]["start"] == 0 and starts[0][-1]["end"] == STEPS
    assert [r["step"] for r in starts[0][:-1]] == list(range(STEPS)) and starts[0][-1]["world_size"] == 2
    assert _complete_steps(tmp / "ck" / job) == [STEPS]          # saved at the end, in the job's own folder
    assert "capstone-torch: job" in (tmp / f"{job}.out").read_text(errors="replace")


@needs_slurm
@pytest.mark.slow
def test_torch_job_preempted_then_node_killed_resumes_exactly(cluster, torch_reference, tmp_path):
    """Start 1 is stopped as at its time limit (SIGTERM to the batch shell: save, requeue itself); start 2 loses
    its node (slurmd and every process of the job SIGKILLed: no save); Slurm requeues it; start 3 ends it."""
    _, _, ref = torch_reference
    log = tmp_path / "log.jsonl"
    job = _submit(cluster, tmp_path, "train_torch.sbatch", ["--shard", "2", "--ckpt-every", "1", "--throttle", "0.3"],
                  extra_env={"NPROC_PER_NODE": "2"})
    ck = tmp_path / "ck" / job
    _wait_rows(log, lambda rows: len(rows) >= 3, what="3 steps")
    t_signal = time.monotonic()
    cluster.run(["scancel", "--signal=TERM", "--batch", job])
    cluster.release(job, 1)
    t_running2 = time.monotonic()
    first, _ = _starts(_rows(log))
    assert len(first) == 1 and first[0][-1]["stopped_by_signal"] == 15, _rows(log)
    stopped_at = first[0][-1]["end"]
    assert _complete_steps(ck)[-1] == stopped_at      # the save on SIGTERM is the newest checkpoint
    _wait_rows(log, lambda rows: _starts(rows)[1] and max(r["step"] for r in _starts(rows)[1]) >= stopped_at + 2,
               what="2 steps after the first resume")
    killed = cluster.kill_node()
    t_kill = time.monotonic()
    assert killed, "the job's processes should have carried SLURM_CONF"
    steps_at_kill = _complete_steps(ck)
    in_flight = _starts(_rows(log))[1]
    last_logged = max(r["step"] for r in in_flight)
    down_s = cluster.wait_node_down()
    states = [cluster.job(job).get("JobState")]
    cluster.start_slurmd(wait=True)
    t_back = time.monotonic()
    cluster.release(job, 2)
    t_running3 = time.monotonic()
    info = cluster.wait(job, "COMPLETED", 120)
    rows = _rows(log)
    starts, rest = _starts(rows)
    assert not rest and len(starts) == 2, rows        # start 1 (stopped) and start 3 (to the end); start 2 died
    third = starts[1][-1]
    assert third["start"] == steps_at_kill[-1] >= last_logged, (third, steps_at_kill, last_logged)
    assert third["end"] == STEPS and info["Restarts"] == "2"
    want = _losses(ref)
    assert all(want[r["step"]] == r["loss"] for r in rows if "step" in r), "a resumed step's loss differs"
    assert sorted(_losses(rows)) == list(range(STEPS))
    RECORD["torch preempted (SIGTERM to batch shell) then node killed"] = {
        "states": ["RUNNING", "REQUEUED (self: scontrol requeue)", "RUNNING", f"node down after {down_s:.1f} s: "
                   f"{states[0]}", "RUNNING", info["JobState"]],
        "restarts": info["Restarts"], "stopped_at": stopped_at, "signal_to_running_s": round(t_running2 - t_signal, 1),
        "kill_to_running_s": round(t_running3 - t_kill, 1), "slurmd_back_to_running_s": round(t_running3 - t_back, 1),
        "resumed_at_after_kill": third["start"], "last_logged_before_kill": last_logged,
        "losses_equal": True, "final_loss": rows[-2]["loss"], "ref_final_loss": ref[-2]["loss"],
        "jobcomp": [r.get("JobState") for r in cluster.jobcomp() if r.get("JobId") == job]}


@needs_slurm
@pytest.mark.slow
def test_bad_arguments_refused_in_one_line_before_srun(cluster, tmp_path):
    job = _submit(cluster, tmp_path, "train_torch.sbatch", ["--shard", "3"], extra_env={"NPROC_PER_NODE": "2"})
    info = cluster.wait(job, {"FAILED", "COMPLETED"}, 60)
    out = (tmp_path / f"{job}.out").read_text(errors="replace").splitlines()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0"
    assert out == [out[0]] and "replicate(1) * shard(3) != WORLD_SIZE(2)" in out[0], out
    assert not (tmp_path / "ck").exists() and not (tmp_path / "log.jsonl").exists()   # nothing started
    job = _submit(cluster, tmp_path, "train_jax.sbatch", ["--ckpt-dir", "elsewhere"], ntasks=2)
    info = cluster.wait(job, {"FAILED", "COMPLETED"}, 60)
    out = (tmp_path / f"{job}.out").read_text(errors="replace").splitlines()
    assert info["ExitCode"] == "2:0" and len(out) == 1 and "--ckpt-dir: the batch script sets" in out[0], out
    RECORD["bad arguments"] = {"states": ["RUNNING", info["JobState"]], "exit": info["ExitCode"], "line": out[0]}


@needs_slurm
@pytest.mark.slow
def test_jax_job_requeued_by_slurm_resumes_exactly(cluster, tmp_path):
    """The JAX script, one process per task (2 tasks, one CPU device each: jax.distributed from Slurm's variables):
    an uninterrupted job, then one requeued by ``scontrol requeue`` mid-run (Slurm SIGTERMs every step; the
    processes save within KillWait), which resumes from that save to the same losses."""
    args = ["--shard", "2", "--cpu-devices", "1"]
    ref_job = _submit(cluster, tmp_path, "train_jax.sbatch", args, ntasks=2, jsonl="ref.jsonl")
    ref_info = cluster.wait(ref_job, {"COMPLETED", "FAILED"}, 120)
    assert ref_info["JobState"] == "COMPLETED", (tmp_path / f"{ref_job}.out").read_text(errors="replace")[-2000:]
    ref = _rows(tmp_path / "ref.jsonl")
    assert ref[-1]["processes"] == 2 and ref[-1]["end"] == STEPS
    log = tmp_path / "log.jsonl"
    job = _submit(cluster, tmp_path, "train_jax.sbatch", [*args, "--throttle", "0.3"], ntasks=2)
    _wait_rows(log, lambda rows: len(rows) >= 3, what="3 steps")
    t_requeue = time.monotonic()
    cluster.run(["scontrol", "requeue", job])
    cluster.release(job, 1)
    t_running = time.monotonic()
    info = cluster.wait(job, {"COMPLETED", "FAILED"}, 120)
    assert info["JobState"] == "COMPLETED", (tmp_path / f"{job}.out").read_text(errors="replace")[-2000:]
    rows = _rows(log)
    starts, rest = _starts(rows)
    assert not rest and len(starts) == 2, rows
    assert starts[0][-1]["stopped_by_signal"] == 15 and starts[1][-1]["start"] == starts[0][-1]["end"] < STEPS
    want = _losses(ref)
    assert all(want[r["step"]] == r["loss"] for r in rows if "step" in r), "a resumed step's loss differs"
    assert sorted(_losses(rows)) == list(range(STEPS))
    RECORD["jax requeued by scontrol requeue"] = {
        "states": ["RUNNING", "REQUEUED", "PENDING (BeginTime, released)", "RUNNING", info["JobState"]],
        "restarts": info["Restarts"], "stopped_at": starts[0][-1]["end"],
        "requeue_to_running_s": round(t_running - t_requeue, 1), "losses_equal": True,
        "final_loss": rows[-2]["loss"], "ref_final_loss": ref[-2]["loss"],
        "jobcomp": [r.get("JobState") for r in cluster.jobcomp() if r.get("JobId") == job]}
