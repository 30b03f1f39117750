"""What the grader's box is made of, outside the kernel: its bubblewrap command line, who it is, its scratch disk,
which bounds this machine cannot set, and the reaper that ends its processes. :mod:`.sandbox` runs a notebook in it.

* :func:`bwrap_args` / :func:`bwrap_problem` -- the ``bwrap`` command line, and one line saying why it cannot run
  here (probed as the box's own uid);
* :func:`box_uid` -- started by root, the box is uid/gid :data:`BOX_UID` (nobody) outside too: :mod:`.limits` drops
  root before bubblewrap, and :func:`chown_tree` hands the scratch folder (its sockets, the guard's pipe) to it;
* :class:`ScratchDisk` -- the scratch folder on a size-limited tmpfs for the run (root only), copied back after;
* :func:`missing_bounds` -- each bound that cannot be set here, one line each (:func:`say_once` prints it);
* :func:`tagged_processes` / :func:`end_processes` -- every process of a submission, found and ended.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

from course_lib.apps.grading import limits as limits_script
from course_lib.apps.grading.kernel import TAG_VAR

__all__ = ["bwrap_args", "bwrap_problem", "box_uid", "BOX_UID", "chown_tree", "ScratchDisk", "missing_bounds",
           "say_once", "size_text", "tagged_processes", "end_processes", "BWRAP", "LIMITS_SCRIPT"]

LIMITS_SCRIPT = Path(limits_script.__file__)
COURSE_ROOT = Path(__file__).resolve().parents[3]          # the checkout holding course_lib
BWRAP = os.environ.get("COURSE_LIB_BWRAP", "bwrap")        # a test points it elsewhere to try the refusal
BOX_UID = 65534                                            # nobody: who the box is, outside too, when root grades


# ------------------------------------------------------------------------------------------------ bubblewrap
def _python_roots() -> list[str]:
    """What the kernel needs to read: the venv, the Python it was made from, the library."""
    roots = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), str(COURSE_ROOT / "course_lib")}
    return sorted(r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots))


def bwrap_args(scratch: Path) -> list[str]:
    """The ``bwrap`` command line (up to its ``--``) that boxes a kernel working in ``scratch``."""
    args = [BWRAP]
    for top in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    for root in _python_roots():
        args += ["--ro-bind", root, root]
    if os.path.isdir("/sys"):
        args += ["--ro-bind", "/sys", "/sys"]           # CPU counts and topology (torch, JAX, psutil read them)
    args += ["--bind", str(scratch), str(scratch), "--chdir", str(scratch),
             "--unshare-all", "--die-with-parent", "--new-session", "--uid", "65534", "--gid", "65534"]
    return args


@functools.lru_cache(maxsize=1)
def bwrap_problem() -> str | None:
    """None when bubblewrap can box a kernel here; else one line saying what is missing."""
    if shutil.which(BWRAP) is None:
        return (f"bubblewrap ({BWRAP}) is not installed: `make system-deps` (Debian: apt-get install bubblewrap), or "
                f"grade with --no-sandbox")
    probe = Path(__import__("tempfile").mkdtemp(prefix="course-grade-probe-"))
    uid = box_uid(True)
    try:
        if uid is not None:
            os.chown(probe, uid, uid)
        cmd = (_wrapper(uid) + bwrap_args(probe) + ["--", sys.executable, "-c", "import os; print(os.getuid())"])
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap could not start here ({exc}); grade with --no-sandbox"
        if got.returncode != 0 or got.stdout.strip() != "65534":
            why = (got.stderr.strip().splitlines() or ["no output"])[-1]
            who = f" as uid {uid}" if uid is not None else ""
            return (f"bubblewrap cannot make its namespaces{who} here ({why}): user namespaces may be off "
                    f"(sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces); grade with --no-sandbox")
        return None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def box_uid(sandbox: bool) -> int | None:
    """The uid the box runs as outside: :data:`BOX_UID` when root grades under bubblewrap, else None (the grader's)."""
    return BOX_UID if sandbox and os.geteuid() == 0 else None


def _wrapper(uid: int | None) -> list[str]:
    """The launch wrapper alone (no limits): used by the probe, which must drop root as a kernel does."""
    return [] if uid is None else [sys.executable, str(LIMITS_SCRIPT), "--user", str(uid), "--"]


@functools.lru_cache(maxsize=None)
def missing_bounds(sandbox: bool = True) -> tuple[str, ...]:
    """One line per bound the box cannot set on this machine (empty when all hold)."""
    out = []
    if limits_script.cgroup_parent("memory") is None:
        out.append("no memory cgroup can be made here (needs root or a delegated cgroup): RAM, /tmp included, is "
                   "bounded per process only (RLIMIT_AS), not per submission")
    if os.geteuid() != 0 or shutil.which("mount") is None:
        out.append("the scratch folder's disk is not bounded (a size-limited tmpfs needs root and mount)")
    return tuple(out)


_said: set[str] = set()


def say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(f"course_lib grade: {line}", file=sys.stderr)


def chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid)
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lchown(os.path.join(folder, name), uid, uid)


def _copy_plain(src: Path, dst: Path) -> None:
    """Copy folders, regular files and links from ``src`` into ``dst`` (sockets and pipes are left behind)."""
    for folder, dirs, files in os.walk(src):
        rel = os.path.relpath(folder, src)
        target = dst / rel if rel != "." else dst
        target.mkdir(parents=True, exist_ok=True)
        for name in dirs + files:
            s, d = os.path.join(folder, name), target / name
            st = os.lstat(s)
            try:
                if stat.S_ISLNK(st.st_mode):
                    if d.is_symlink() or d.exists() and not d.is_dir():
                        d.unlink()
                    os.symlink(os.readlink(s), d)
                elif stat.S_ISREG(st.st_mode):
                    shutil.copy2(s, d)
            except OSError:
                pass


class ScratchDisk:
    """The scratch folder on a size-limited tmpfs for the run: mounted by root on a folder of its own, filled with
    what the scratch folder holds, bound over it; :meth:`close` copies its files back and unmounts both."""

    def __init__(self, scratch: Path, size: int, uid: int | None):
        import tempfile
        self.scratch, self.size = Path(scratch), size
        self.disk = Path(tempfile.mkdtemp(prefix="course-grade-disk-"))
        owner = os.getuid() if uid is None else uid
        self.mounted = self.bound = False
        try:
            self._run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700,uid={owner},gid={owner},nosuid,nodev",
                      "course-grade-scratch", str(self.disk))
            self.mounted = True
            _copy_plain(self.scratch, self.disk)
            self._run("mount", "--bind", str(self.disk), str(self.scratch))
            self.bound = True
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _run(*cmd: str) -> None:
        got = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if got.returncode != 0:
            raise OSError(f"{' '.join(cmd[:2])}: {(got.stderr.strip().splitlines() or ['failed'])[-1]}")

    def full(self) -> bool:
        """Whether the tmpfs is (all but) full: the last write into it failed, or would."""
        try:
            st = os.statvfs(self.disk)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < min(256 << 10, self.size // 16)

    def close(self) -> None:
        """Copy the run's files back into the scratch folder, unmount, remove the mount point (idempotent)."""
        if self.bound:
            try:
                self._run("umount", str(self.scratch))
            except OSError:
                self._run("umount", "-l", str(self.scratch))
            self.bound = False
        if self.mounted:
            _copy_plain(self.disk, self.scratch)
            try:
                self._run("umount", str(self.disk))
            except OSError:
                self._run("umount", "-l", str(self.disk))
            self.mounted = False
        try:
            self.disk.rmdir()
        except OSError:
            pass


def tagged_processes(tag: str, root_pid: int | None = None) -> list:
    """psutil.Process for every live process carrying ``tag`` in its environment or under ``root_pid``."""
    import psutil
    found: dict[int, psutil.Process] = {}
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            found.update({p.pid: p for p in [root, *root.children(recursive=True)]})
        except psutil.Error:
            pass
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid in found or p.pid == me:
            continue
        try:
            if p.environ().get(TAG_VAR) == tag:
                found[p.pid] = p
        except psutil.Error:               # gone, a zombie, or not ours to read
            continue
    return [p for p in found.values() if _alive(p)]


def _alive(p) -> bool:
    import psutil
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_processes(tag: str, root_pid: int | None = None, rounds: int = 20) -> int:
    """Stop, then kill, every process of the submission until none is left; how many were ended."""
    import psutil
    ended: set[int] = set()
    for _ in range(rounds):
        procs = tagged_processes(tag, root_pid)
        if not procs:
            break
        for p in procs:                      # freeze first: a fork bomb cannot outrun the kills
            try:
                p.send_signal(signal.SIGSTOP)
            except psutil.Error:
                pass
        for p in procs:
            try:
                p.kill()
                ended.add(p.pid)
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=2)
    return len(ended)


def size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g} {unit}"
    return f"{n} B"
