"""The grading kernel's launch wrapper: set resource limits, drop root, then become the sandbox (``exec``).

Run by file path, not as a module, so that nothing of course_lib is imported before the limits hold::

    python .../course_lib/apps/grading/limits.py --as-bytes 4294967296 --memory-bytes 4294967296 --pids 1024 \\
        --cgroup course-grade-TAG --user 65534 -- bwrap ... -- python -m course_lib.apps.grading.guard --lab 02 ...

* ``--as-bytes``: RLIMIT_AS, the address space of each process. Rank processes forked by ``course_lib.run``
  inherit it (it is per process, not a total). A kernel importing torch and JAX peaks near 2.1 GB here, so
  the grader's default (4 GiB) leaves room for a lab and stops a runaway allocation with a MemoryError.
* ``--memory-bytes`` and ``--cgroup``: the submission's RAM as a whole. This process joins a new *memory* cgroup
  (v1 ``/sys/fs/cgroup/memory``, made under the grader's own group, or a v2 hierarchy with the memory controller)
  whose limit counts every page its processes use, the pages of files they write to a tmpfs included (the box's
  ``/tmp`` and the scratch folder): past it the kernel's out-of-memory killer ends the largest process of the
  group, the notebook's kernel. :func:`memory_report` says afterwards whether it did.
* ``--pids`` and ``--cgroup``: a fork-bomb brake that holds for root too. This process joins a new *pids* cgroup
  (v1 ``/sys/fs/cgroup/pids`` or a v2 hierarchy with the pids controller) whose ``pids.max`` counts every process
  and thread of the submission; a fork past it fails with EAGAIN. Where no cgroup can be made (not root, no pids
  controller), RLIMIT_NPROC is set instead: it holds for a non-root user and counts all of that user's processes,
  and the kernel ignores it for root.
* ``--user UID``: started by root, become ``UID`` (group ``UID`` too, no supplementary groups) before the command
  runs, so that bubblewrap's "nobody" is nobody outside the box as well: a root-only file stays closed. Folders
  the box needs (the Python installation, say under ``/root``) that ``UID`` could not reach are first made
  reachable in a private mount namespace of this process (:func:`reveal`): a tmpfs covers the closed folder
  there and only the needed folder is bound back into it. Nothing of this is seen outside the box.
* ``--nice``: lower the kernel's priority, so the grader's own bookkeeping stays responsive.

The process keeps its PID across ``exec``: the kernel manager's handle is the sandbox (then the kernel) itself.
"""
from __future__ import annotations

import os
import resource
import signal
import stat
import sys
import time

_V1 = {"pids": "/sys/fs/cgroup/pids", "memory": "/sys/fs/cgroup/memory"}
_V2 = "/sys/fs/cgroup"
_LIMIT_FILE = {("pids", 1): "pids.max", ("pids", 2): "pids.max",
               ("memory", 1): "memory.limit_in_bytes", ("memory", 2): "memory.max"}


def _own_group(controller: str) -> str:
    """This process's group in the v1 hierarchy of ``controller`` ("/" when it cannot tell)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, names, path = line.rstrip("\n").split(":", 2)
                if controller in names.split(","):
                    return path or "/"
    except OSError:
        pass
    return "/"


def cgroup_parent(controller: str = "pids") -> tuple[str, int] | None:
    """(the folder new ``controller`` cgroups are made in, the cgroup version), or None where this process cannot
    make one. In v1 the new group goes under the process's own group (its limits still hold above it)."""
    root = _V1[controller]
    if os.path.isdir(root):
        for parent in (os.path.normpath(root + _own_group(controller)), root):
            if os.path.isdir(parent) and os.access(parent, os.W_OK):
                return parent, 1
        return None
    try:
        with open(os.path.join(_V2, "cgroup.controllers")) as f:
            has = controller in f.read().split()
    except OSError:
        return None
    return (_V2, 2) if has and os.access(_V2, os.W_OK) else None


def join_cgroup(name: str, limit: int, controller: str = "pids") -> str | None:
    """Make cgroup ``name`` of ``controller`` with its limit set to ``limit`` and move this process into it;
    its path, or None."""
    found = cgroup_parent(controller)
    if found is None:
        return None
    parent, version = found
    path = os.path.join(parent, name)
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, _LIMIT_FILE[controller, version]), "w") as f:
            f.write(str(limit))
        if controller == "memory":            # no swap to spill into (where there is swap)
            swap = "memory.memsw.limit_in_bytes" if version == 1 else "memory.swap.max"
            if os.path.exists(os.path.join(path, swap)):
                try:
                    with open(os.path.join(path, swap), "w") as f:
                        f.write(str(limit) if version == 1 else "0")
                except OSError:
                    pass
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return None
    return path


def _group(name: str, controller: str) -> str | None:
    found = cgroup_parent(controller)
    path = found and os.path.join(found[0], name)
    return path if path and os.path.isdir(path) else None


def memory_report(name: str) -> dict:
    """What cgroup ``name``'s memory controller saw: ``oom_kills`` (processes the limit killed), ``peak`` (bytes
    at most in use, v1 only: 0 elsewhere), ``limit``; empty when there is no such group."""
    path = _group(name, "memory")
    if path is None:
        return {}
    out = {"oom_kills": 0, "peak": 0, "limit": 0}

    def read(file):
        try:
            with open(os.path.join(path, file)) as f:
                return f.read()
        except OSError:
            return ""
    for file in ("memory.oom_control", "memory.events"):          # v1, v2: "oom_kill N"
        for line in read(file).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                out["oom_kills"] = max(out["oom_kills"], int(value))
    for key, file in (("peak", "memory.max_usage_in_bytes"), ("limit", "memory.limit_in_bytes"), ("limit", "memory.max")):
        value = read(file).strip()
        if value.isdigit():
            out[key] = int(value)
    return out


def remove_cgroup(name: str, patience_s: float = 5.0) -> int:
    """Kill every process left in cgroup ``name`` (pids and memory) and remove it; how many were killed (0 when
    there is none)."""
    killed: set[int] = set()
    for controller in ("pids", "memory"):
        path = _group(name, controller)
        if path is None:
            continue
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


# ------------------------------------------------------------------------------------------------ dropping root
def reachable(path: str, uid: int, gid: int) -> str | None:
    """None when ``uid``/``gid`` (no other groups) can reach ``path``; else the first folder on the way it cannot
    enter."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    for i in range(len(parts)):
        folder = os.sep + os.sep.join(parts[:i])
        try:
            st = os.stat(folder)
        except OSError:
            return folder
        bits = (stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH)
        if not st.st_mode & bits:
            return folder
    return None


def _libc():
    import ctypes
    import ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

    def check(result, what):
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
    return libc, check


_CLONE_NEWNS, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20000, 0x1000, 0x4000, 1 << 18


def reveal(paths: list[str], uid: int, gid: int) -> list[str]:
    """Make each of ``paths`` reachable by ``uid`` in a new, private mount namespace of this process (root only):
    the closed folder above it is covered by a tmpfs, and the path alone bound back. What was revealed."""
    closed = {p: reachable(p, uid, gid) for p in paths}
    closed = {p: c for p, c in closed.items() if c is not None and os.path.isdir(p)}
    if not closed:
        return []
    libc, check = _libc()
    check(libc.unshare(_CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    # opened in the new namespace (a bind's source must be of it), before the tmpfs hides them
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in closed}
    covered: set[str] = set()
    for path, top in sorted(closed.items(), key=lambda pc: len(pc[1])):
        if not any(top == c or top.startswith(c + os.sep) for c in covered):
            check(libc.mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=0755,size=1m"), f"mount tmpfs {top}")
            covered.add(top)
        os.makedirs(path, mode=0o755, exist_ok=True)
        check(libc.mount(f"/proc/self/fd/{fds[path]}".encode(), path.encode(), None, _MS_BIND | _MS_REC, None),
              f"bind {path}")
        os.close(fds[path])
    return sorted(closed)


def _bind_sources(cmd: list[str]) -> list[str]:
    """The host folders a bwrap command line binds."""
    return [cmd[i + 1] for i, a in enumerate(cmd[:-2]) if a in ("--bind", "--ro-bind", "--bind-try", "--ro-bind-try")]


def drop_to(uid: int, cmd: list[str]) -> None:
    """Become ``uid`` (group ``uid``, no other groups), the folders ``cmd`` binds made reachable first."""
    reveal(_bind_sources(cmd), uid, uid)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("limits: usage: limits.py [--as-bytes N] [--memory-bytes N] [--pids N] [--cgroup NAME] [--user UID] "
                 "[--nice N] -- CMD ...")
    split = argv.index("--")
    opts, cmd = argv[:split], argv[split + 1:]
    values = dict(zip(opts[::2], opts[1::2]))
    if "--as-bytes" in values:
        n = int(values["--as-bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (n, n))
    if "--memory-bytes" in values and "--cgroup" in values:
        if not join_cgroup(values["--cgroup"], int(values["--memory-bytes"]), "memory"):
            print("limits: no memory cgroup could be made: RAM is bounded per process only", file=sys.stderr)
    if "--pids" in values:
        n = int(values["--pids"])
        if not ("--cgroup" in values and join_cgroup(values["--cgroup"], n)):
            soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
            resource.setrlimit(resource.RLIMIT_NPROC, (n if hard == resource.RLIM_INFINITY else min(n, hard),) * 2)
    if "--nice" in values:
        os.nice(int(values["--nice"]))
    if "--user" in values and os.geteuid() == 0:
        drop_to(int(values["--user"]), cmd)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
