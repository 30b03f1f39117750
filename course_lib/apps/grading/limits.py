"""The grading kernel's launch wrapper: set resource limits, then become the sandbox (``exec``).

Run by file path, not as a module, so that nothing of course_lib is imported before the limits hold::

    python .../course_lib/apps/grading/limits.py --as-bytes 4294967296 --pids 1024 --cgroup course-grade-TAG \\
        -- bwrap ... -- python -m course_lib.apps.grading.guard --lab 02 --channel FIFO -f CONN

* ``--as-bytes``: RLIMIT_AS, the address space of each process. Rank processes forked by ``course_lib.run``
  inherit it (it is per process, not a total). A kernel importing torch and JAX peaks near 2.1 GB here, so
  the grader's default (4 GiB) leaves room for a lab and stops a runaway allocation with a MemoryError.
* ``--pids`` and ``--cgroup``: a fork-bomb brake that holds for root too. This process joins a new *pids* cgroup
  (v1 ``/sys/fs/cgroup/pids`` or a v2 hierarchy with the pids controller) whose ``pids.max`` counts every process
  and thread of the submission; a fork past it fails with EAGAIN. Where no cgroup can be made (not root, no pids
  controller), RLIMIT_NPROC is set instead: it holds for a non-root user and counts all of that user's processes,
  and the kernel ignores it for root. ``pids_cgroup`` says which brake holds.
* ``--nice``: lower the kernel's priority, so the grader's own bookkeeping stays responsive.

The process keeps its PID across ``exec``: the kernel manager's handle is the sandbox (then the kernel) itself.
"""
from __future__ import annotations

import os
import resource
import signal
import sys
import time

_V1 = "/sys/fs/cgroup/pids"
_V2 = "/sys/fs/cgroup"


def cgroup_parent() -> str | None:
    """The folder new pids cgroups are made in, or None where this process cannot make one."""
    if os.path.isdir(_V1) and os.access(_V1, os.W_OK):
        return _V1
    try:
        with open(os.path.join(_V2, "cgroup.controllers")) as f:
            has_pids = "pids" in f.read().split()
    except OSError:
        return None
    return _V2 if has_pids and os.access(_V2, os.W_OK) else None


def join_cgroup(name: str, pids: int) -> str | None:
    """Make cgroup ``name`` with ``pids.max = pids`` and move this process into it; its path, or None."""
    parent = cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, name)
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(pids))
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return None
    return path


def remove_cgroup(name: str, patience_s: float = 5.0) -> int:
    """Kill every process left in cgroup ``name`` and remove it; how many were killed (0 when there is none)."""
    parent = cgroup_parent()
    path = parent and os.path.join(parent, name)
    if not path or not os.path.isdir(path):
        return 0
    killed: set[int] = set()
    end = time.monotonic() + patience_s
    while time.monotonic() < end:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        try:
            os.rmdir(path)
            break
        except OSError:
            time.sleep(0.05)
    return len(killed)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("limits: usage: limits.py [--as-bytes N] [--pids N --cgroup NAME] [--nice N] -- CMD ...")
    split = argv.index("--")
    opts, cmd = argv[:split], argv[split + 1:]
    values = dict(zip(opts[::2], opts[1::2]))
    if "--as-bytes" in values:
        n = int(values["--as-bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (n, n))
    if "--pids" in values:
        n = int(values["--pids"])
        if not ("--cgroup" in values and join_cgroup(values["--cgroup"], n)):
            soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
            resource.setrlimit(resource.RLIMIT_NPROC, (n if hard == resource.RLIM_INFINITY else min(n, hard),) * 2)
    if "--nice" in values:
        os.nice(int(values["--nice"]))
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
