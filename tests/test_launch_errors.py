"""Launcher fault cases from an independent check that do not race a clock: an interrupt at any moment of a
script's start leaves no rank, nothing listens beyond loopback, bad input is named in one line, a dead process's
rendezvous folder is removed. They share the machine with the other worker; the cases that time a deadline are
in tests/test_launch_faults.py and run alone."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from course_lib import launch
from course_lib.launch import RankError
from course_lib.launch import pool, results

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_procs():
    """Live processes the child left: its ranks, its fork server, multiprocessing's resource tracker.

    (A rank used to keep the fork server alive through the server's own "alive" pipe, and the server kept
    the rank's PDEATHSIG from firing: CI once saw two processes 18 s after an interrupt at 1.5 s.)"""
    out = []
    for p in psutil.process_iter(["pid", "environ"]):
        try:
            env = p.info["environ"] or {}
        except Exception:
            continue
        try:
            if env.get("COURSE_LIB_TEST_TAG") == _TAG and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


_TAG = f"faults-{os.getpid()}"

_CHILD = textwrap.dedent("""
    import sys, course_lib
    def f(x):
        import time
        time.sleep(x)
        return x
    if __name__ == "__main__":
        print("go", flush=True)
        course_lib.run(f, 2.0, world_size=4, timeout=20)
""")


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.7, 1.5])
def test_interrupt_at_any_moment_leaves_no_rank(tmp_path, delay):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, COURSE_LIB_TEST_TAG=_TAG, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    child = subprocess.Popen([PY, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "go"
    time.sleep(delay)
    child.send_signal(signal.SIGINT)
    try:
        child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
    deadline = time.monotonic() + 8.0   # a rank's exit under a loaded machine (one took > 3 s in a full run)
    while _rank_procs() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _rank_procs()
    for p in left:
        p.kill()
    assert not left, f"{len(left)} processes left {delay} s after the interrupt"


def test_a_program_read_from_stdin_is_refused_in_one_line():
    """``python - <<EOF`` has no file for the ranks to re-import: say so up front, not "ranks 0-3 exited"."""
    code = "import course_lib\nprint(course_lib.run(lambda: 1, world_size=2))\n"
    proc = subprocess.run([PY, "-"], input=code, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    assert proc.returncode == 1
    assert "run() cannot start ranks from a program read from '<stdin>'" in proc.stderr, proc.stderr[-2000:]
    assert "exited with code" not in proc.stderr


def _listening(pids):
    """(addr, port) of every TCP listening socket held by these pids, from /proc/net/tcp{,6}."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            pass
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    addr, port = cols[1].split(":")
                    found.append((addr, int(port, 16)))
    return found


def _listeners_during_call():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getpid()


def test_nothing_listens_beyond_loopback():
    pids = list(launch.run(_listeners_during_call, world_size=3, fresh=True)) + [os.getpid()]
    pids += [c.pid for c in psutil.Process().children(recursive=True)]
    found = _listening(set(pids))
    loopback = {"0100007F", "00000000000000000000000001000000"}
    public = [(a, p) for a, p in found if a not in loopback]
    assert not public, f"listening beyond loopback: {public}"


def test_world_size_beyond_the_machine_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match=r"world_size=1000 is more than this machine can run: at most \d+ ranks"):
        launch.run(_value, 1, world_size=1000)


def test_rank_lists_are_short():
    assert results.ranks_text([r for r in range(1000) if r != 7]) == "ranks 0–6,8–999"
    assert results.ranks_text([3]) == "rank 3"
    assert len(results.ranks_text(range(0, 1000, 2))) < 40


def _value(x):
    return x


def test_pickling_failures_name_the_piece():
    import threading
    with pytest.raises(TypeError, match=r"cannot send argument 0 \(lock\)"):
        launch.run(_value, threading.Lock(), world_size=2)
    with pytest.raises(RankError, match="the return value of fn on ranks 0,1 could not be sent back: lock"):
        launch.run(lambda: threading.Lock(), world_size=2)


def test_script_without_main_guard_is_named_in_one_line(tmp_path):
    script = tmp_path / "noguard.py"
    script.write_text("import course_lib\ncourse_lib.run(print, world_size=2)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    res = subprocess.run([PY, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert 'put the call under `if __name__ == "__main__":`' in last, res.stderr[-2000:]
    assert res.stderr.count("calls course_lib.run() at import time") == 1


def test_store_directories_of_gone_processes_are_removed(tmp_path, monkeypatch):
    """A process that dies without its exit handlers (a kernel the grader killed) leaves its rendezvous directory;
    the next pool's start removes it, by the pid in its name, and leaves a living process's alone."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([PY, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"course_lib-store-{gone.pid}-abc"
    living = tmp_path / f"course_lib-store-{os.getppid()}-def"        # pytest's parent: alive
    other = tmp_path / "course_lib-store-oldformat"                     # no pid: not ours to judge
    for d in (dead, living, other):
        d.mkdir()
        (d / "store").write_text("x")
    out = launch.run(_square, 3, world_size=2, fresh=True)
    assert list(out) == [9, 9]
    assert not dead.exists() and living.exists() and other.exists()
    launch.shutdown()
    assert not list(tmp_path.glob(f"course_lib-store-{os.getpid()}-*"))   # our own pool's, at shutdown


def _square(x):
    return x * x
