"""``python -m course_lib.train`` as a cluster runs it: torchrun, two agents x two ranks, c10d rendezvous.

Across two network namespaces when :mod:`course_lib.runtime.netns` says they are available (each agent
binds its own veth address), else two agents on localhost. One agent is SIGKILLed mid-run (a node lost),
the other stopped; both restart with ``--resume`` and the loss curve must equal an uninterrupted run's bit
for bit. A 4-rank checkpoint resumes at 2 ranks (reshard on load) onto the same curve within float noise.
Bad configurations fail before any process group exists, naming the values and the fix.
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

from course_lib.runtime import netns
from course_lib.apps.train_config import TrainConfig, write_run_record

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ARGS = ["-m", "course_lib.train", "--steps", "8", "--batch", "8", "--n-layers", "2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(REPO)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def curve(path) -> dict[int, float]:
    """step -> loss, the LAST line logged for each step (a resumed run logs the replayed steps again)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            out[row["step"]] = row["loss"]
    return out


def run(argv, timeout=120):
    p = subprocess.run(argv, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return p


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted: torchrun --standalone, 4 ranks, 8 steps, checkpoints at 4 and 8."""
    d = tmp_path_factory.mktemp("ref")
    run(TORCHRUN + ["--standalone", "--nproc-per-node", "4"] + ARGS +
        ["--ckpt-dir", str(d / "ck"), "--ckpt-every", "4", "--jsonl", str(d / "log.jsonl")])
    return d


@contextlib.contextmanager
def two_agents():
    """Yields start(extra_args, port) -> [agent0, agent1] Popen: netns nodes when available, else localhost."""
    ok, _why = netns.available()
    with (netns.TwoNodes() if ok else contextlib.nullcontext()) as net:
        procs = []

        def start(extra, port):
            host = net.nodes[0].addr if net else "127.0.0.1"
            for i in range(2):
                argv = TORCHRUN + ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
                                   f"--rdzv-endpoint={host}:{port}", "--rdzv-id=capstone", "--max-restarts=0"]
                if i == 0:
                    argv.append("--rdzv-conf=is_host=1")
                if net:
                    argv.append(f"--local-addr={net.nodes[i].addr}")
                argv += ARGS + extra
                env = {**ENV, "GLOO_SOCKET_IFNAME": net.nodes[i].iface if net else "lo"}
                if net:
                    procs.append(net.popen(net.nodes[i], argv, env=env, cwd=str(REPO), stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE))
                else:
                    procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, start_new_session=True))
            return procs[-2:]
        try:
            yield start, bool(net)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if ok:
        assert netns.ours() == [], "namespaces left behind"


def wait_for(pred, timeout, what, procs=()):
    t0 = time.monotonic()
    while not pred():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: an agent exited early ({p.returncode}): {p.stderr.read()[-3000:]}")
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_two_agents_killed_and_resumed_equal_uninterrupted(reference, tmp_path):
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    extra = ["--ckpt-dir", str(ck), "--ckpt-every", "2", "--jsonl", str(log)]
    with two_agents() as (start, _in_netns):
        agents = start(extra + ["--throttle", "0.4"], free_port())
        wait_for(lambda: (ck / "step_00000004").is_dir(), 90, "checkpoint at step 4", agents)
        os.killpg(agents[1].pid, signal.SIGKILL)      # node 1 is lost, no warning
        os.killpg(agents[0].pid, signal.SIGTERM)      # the scheduler stops the survivor
        for a in agents:
            a.wait(timeout=60)
        assert not (ck / "step_00000008").exists(), "the run finished before the kill: raise --throttle"
        done = start(extra + ["--resume"], free_port())
        for a in done:
            assert a.wait(timeout=90) == 0, a.stderr.read()[-3000:]
    got, want = curve(log), curve(reference / "log.jsonl")
    assert sorted(got) == list(range(8))
    assert got == want, f"resumed curve differs: {got} vs {want}"
    assert (ck / "step_00000008").is_dir()


def test_the_log_gives_each_step_the_rate_it_used(reference):
    """Warm-up over the default 8 steps: step s trains at lr * (s + 1) / 8, as train_jax logs it."""
    rows = [json.loads(line) for line in (reference / "log.jsonl").read_text().splitlines()]
    lrs = {row["step"]: row["lr"] for row in rows if "step" in row}
    assert lrs == pytest.approx({s: 3e-3 * min(1.0, (s + 1) / 8) for s in range(8)})


@pytest.mark.slow
def test_resume_four_ranks_at_two(reference, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(reference / "ck", ck)
    shutil.rmtree(ck / "step_00000008")              # newest complete checkpoint: step 4, written by 4 ranks
    log = tmp_path / "log.jsonl"
    out = run(TORCHRUN + ["--standalone", "--nproc-per-node", "2"] + ARGS +
              ["--ckpt-dir", str(ck), "--resume", "--jsonl", str(log)])
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["start"], summary["end"], summary["world_size"]) == (4, 8, 2)
    got, want = curve(log), curve(reference / "log.jsonl")
    assert sorted(got) == [4, 5, 6, 7]
    assert got == pytest.approx({s: want[s] for s in got}, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("world, flags, needles", [
    (4, ["--replicate", "3"], ["replicate(3) * shard(1) != WORLD_SIZE(4)", "--replicate 1 --shard 4"]),
    (4, ["--replicate", "2", "--shard", "3"], ["replicate(2) * shard(3) != WORLD_SIZE(4)", "divisors of 4"]),
    (4, ["--batch", "6"], ["batch(6) % WORLD_SIZE(4) = 2", "--batch 4 or 8"]),
    (4, ["--batch", "6", "--shard", "3"], ["shard(3) != WORLD_SIZE(4)", "batch(6) % WORLD_SIZE(4)"]),
    (2, ["--resume"], ["no --ckpt-dir"]),
])
def test_bad_configuration_fails_before_any_rank_trains(monkeypatch, capsys, world, flags, needles):
    import torch.distributed as dist
    from course_lib.apps import train
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    assert train.main(flags) == 2
    err = capsys.readouterr().err
    assert "nothing was started" in err
    for needle in needles:
        assert needle in err, err
    assert not dist.is_initialized()


def test_checkpoint_of_another_model_is_refused_up_front(monkeypatch, capsys, tmp_path):
    import torch.distributed as dist
    from course_lib.apps import train
    write_run_record(TrainConfig(world_size=4, d_model=66, n_layers=2, ckpt_dir=str(tmp_path)))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert train.main(["--ckpt-dir", str(tmp_path), "--resume", "--d-model", "60", "--n-layers", "3"]) == 2
    err = capsys.readouterr().err
    assert "d_model saved 66 vs now 60" in err and "n_layers saved 2 vs now 3" in err, err
    assert "--d-model 66 --n-layers 2" in err and "new directory" in err
    assert not dist.is_initialized()
