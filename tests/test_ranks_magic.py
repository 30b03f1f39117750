"""``%%ranks`` in a real Jupyter kernel (jupyter_client, as JupyterLab drives one): variables that live on each rank
across cells, output grouped by rank, the result and ledger, and every fault -- a raise, an exit, a hang, Ctrl-C,
a kernel kill -- ends bounded in time with no process left (``ps`` of the kernel's descendants before and after)."""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import start_new_kernel

ROOT = Path(__file__).resolve().parents[1]

# Races a clock (Ctrl-C within 2 s, a 1 s hang): alone under `make test`'s workers, as test_launch_faults.
pytestmark = [pytest.mark.serial, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def kernel():
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(ROOT), startup_timeout=120)
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def _cell(kc, code: str, timeout: float = 120) -> tuple[dict, str]:
    """Run ``code``; (the reply's content, everything the cell printed or displayed)."""
    out = []

    def hook(msg):
        c = msg["content"]
        out.append(c.get("text") or c.get("data", {}).get("text/plain", "") or "")
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], "".join(x + ("" if x.endswith("\n") else "\n") for x in out if x)


def _descendants(km) -> set[int]:
    return {p.pid for p in psutil.Process(km.provisioner.process.pid).children(recursive=True)}


def _ranks_of(pids) -> set[int]:
    """The rank processes among ``pids``: not the fork server, not the resource tracker (they stay for the next start)."""
    helpers = ("forkserver", "resource_tracker")
    return {p for p in pids if psutil.pid_exists(p) and not any(h in " ".join(psutil.Process(p).cmdline()) for h in helpers)}


def _gone(pids, timeout: float = 5.0) -> list[int]:
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=timeout)
    return [p.pid for p in alive]


def test_state_lives_across_cells_output_grouped_result_and_ledger(kernel):
    km, kc = kernel
    content, _ = _cell(kc, "import course_lib")
    assert content["status"] == "ok"
    content, out = _cell(kc, "%%ranks -n 2\nimport torch, torch.distributed as dist\n"
                             "x = torch.ones(2) * (dist.get_rank() + 1)\nprint('built')")
    assert content["status"] == "ok", content
    assert "[ranks 0,1] built\n" in out and "[rank 0] built" not in out, out   # the same on every rank: once
    content, out = _cell(kc, "%%ranks -n 2\nprint('I am', dist.get_rank())")
    assert "[rank 0] I am 0\n[rank 1] I am 1\n" in out, out
    content, out = _cell(kc, "%%ranks -n 2\ndist.all_reduce(x)\nx.sum().item()")     # x from the cell before
    assert content["status"] == "ok" and "[6.0, 6.0]" in out, (content, out)
    content, out = _cell(kc, "print(type(_ranks).__name__, [r.op for r in _ranks.ledger], _ranks.ledger.ranks())")
    assert "RunResult ['all_reduce', 'all_reduce'] [0, 1]" in out, out


def test_raise_and_exit_name_the_rank_and_the_line(kernel):
    km, kc = kernel
    content, _ = _cell(kc, "%%ranks -n 2\nimport sys\nif dist.get_rank() == 1:\n    raise ValueError('bad shard 17')")
    assert content["status"] == "error" and content["ename"] == "RankError", content
    tb = "\n".join(content["traceback"])
    assert "rank 1 raised ValueError: bad shard 17" in content["evalue"], content["evalue"]
    assert '"<ranks cell' in content["evalue"] and "line 3" in content["evalue"], content["evalue"]
    assert "raise ValueError('bad shard 17')" in content["evalue"], content["evalue"]
    content, out = _cell(kc, "%%ranks -n 2\nimport sys, torch.distributed as dist\nif dist.get_rank() == 0:\n"
                             "    sys.exit(3)")
    assert content["status"] == "error" and "rank 0 raised SystemExit: 3" in content["evalue"], content
    assert "line 3" in content["evalue"] and "sys.exit(3)" in content["evalue"], content["evalue"]
    content, out = _cell(kc, "%%ranks -n 2\nimport torch, torch.distributed as dist")
    assert "variables from earlier %%ranks cells are gone" in out, out      # the faults restarted the ranks


def test_hang_ends_at_the_timeout_naming_collective_rank_and_line_and_nothing_is_left(kernel):
    km, kc = kernel
    assert _cell(kc, "%%ranks -n 2\n1")[0]["status"] == "ok"           # warm ranks (the test above started them)
    before = _descendants(km)
    t0 = time.monotonic()
    content, _ = _cell(kc, "%%ranks -n 2 --timeout 1\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))")
    took = time.monotonic() - t0
    assert content["status"] == "error" and content["ename"] == "LaunchTimeout", content
    ev = content["evalue"]
    assert "rank 0 waits in all_reduce #1 (4 B); rank 1 never issued it" in ev, ev
    assert "rank 0: <ranks cell" in ev and ":2 in <module>: dist.all_reduce(torch.ones(1))  (inside all_reduce)" in ev, ev
    assert "rank 1: finished the call (idle)" in ev, ev
    assert took < 1 + 2 + 1, took            # the timeout + 2 s, + the round trip through the kernel's channels
    assert not _gone(_ranks_of(before), 1.0), "a rank outlived the hang"


def test_ctrl_c_returns_within_2_s_and_leaves_no_rank(kernel):
    km, kc = kernel
    _cell(kc, "%%ranks -n 2\nimport time")                          # warm ranks (the hang killed the last ones)
    before = _descendants(km)
    msg_id = kc.execute("%%ranks -n 2\ntime.sleep(60)")
    time.sleep(1.0)
    t0 = time.monotonic()
    km.interrupt_kernel()
    reply = kc.get_shell_msg(timeout=10)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=10)
    took = time.monotonic() - t0
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
    assert took < 2.0, took
    assert not _gone(_ranks_of(before), 2.0), "a rank outlived Ctrl-C"


def test_kernel_kill_leaves_no_process(kernel):
    km, kc = kernel
    content, _ = _cell(kc, "%%ranks -n 2\n1")                         # ranks up, the fork server, the tracker
    if content["status"] == "aborted":     # ipykernel drops a request that arrives just after an interrupt's error
        content, _ = _cell(kc, "%%ranks -n 2\n1")
    assert content["status"] == "ok", content
    everything = _descendants(km)
    assert len(everything) >= 3, everything
    km.shutdown_kernel(now=True)                                      # SIGKILL: no shutdown handler runs
    assert not _gone(everything, 10.0), "processes outlived the killed kernel"
