"""One owner per checkpoint folder: a kernel lock on the folder itself, and a record that names who holds it.

Two runs writing one folder lose work even when no file is ever mixed: each one's saves race the other's,
and each one's "keep the last K" deletes the other's steps. So the writer takes the folder before its first
save (:func:`take`: :class:`~course_lib.checkpoint.manager.Checkpointer` and
:func:`course_lib.checkpoint.orbax.manager` do it themselves), and a second writer is refused in one
line naming the first (:class:`FolderBusy`)::

    with take(ckpt_dir, command="python -m course_lib.train") as lock:   # lock.run_id: this run's id
        ...train...

* **the lock** -- ``flock`` on the folder's own directory descriptor: the kernel's lock, not a file's existence.
  It is released by every exit path, ``SIGKILL`` and the OOM killer included (the kernel drops it with the
  process's last descriptor), and it leaves nothing in the folder. Each ``take`` opens the folder anew, so two
  writers in *one* process are refused as well (``flock`` belongs to an open file description).
* **who** -- host, pid, run id, command and start time, as JSON in the folder's extended attribute
  ``user.course_lib.owner`` (nothing appears in a listing of the folder). A filesystem without user xattrs
  (older tmpfs) keeps the record in ``<folder>/OWNER.lock`` instead. A filesystem where a directory cannot be
  locked (NFS maps ``flock`` to POSIX byte-range locks, which need a file open for writing) falls back to
  ``flock`` on ``<folder>/OWNER.lock``, which the NFS server arbitrates across hosts.
* **stale owners** -- a record whose writer is gone (a killed run leaves it behind) is taken over, and
  :attr:`Lock.stale` says whose it was, for the caller to print. A live holder is never taken over.
* **release** -- :meth:`Lock.release` removes the record while still holding the lock, then unlocks. A lock that
  is dropped without :meth:`~Lock.release` (its owner object garbage-collected) is released the same way.

Importing this module imports neither torch nor JAX.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LOCK_FILE", "XATTR", "FolderBusy", "Lock", "take", "holder", "new_run_id", "describe"]

LOCK_FILE = "OWNER.lock"          #: the record (and, where a directory cannot be locked, the lock) as a file
XATTR = "user.course_lib.owner"   #: the record, where the filesystem keeps user xattrs: no file in the folder
_NO_XATTR = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.ENOSYS)


class FolderBusy(RuntimeError):
    """Another live writer holds the checkpoint folder; the message names it (host, pid, run, command, since)."""


def new_run_id() -> str:
    """A short random id for one training run (recorded in the lock and in every step it commits)."""
    return uuid.uuid4().hex[:12]


def describe(owner: dict) -> str:
    """``python -m course_lib.train, pid 4242 on node7, run 3f2a9c01d4e5, since 2026-11-27 01:52:03 UTC``."""
    return (f"{owner.get('command', 'a trainer')}, pid {owner.get('pid', '?')} on {owner.get('host', '?')}, "
            f"run {owner.get('run_id', '?')}, since {owner.get('since', '?')}")


def _read_xattr(folder) -> dict | None:
    try:
        return json.loads(os.getxattr(folder, XATTR))
    except (OSError, ValueError):
        return None


def _read_file(folder) -> dict | None:
    try:
        return json.loads((Path(folder) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


def holder(folder) -> dict | None:
    """What the folder's owner record says (None: no record, or unreadable -- a writer killed mid-write). The
    record outlives a killed writer: whether it still runs is what :func:`take` finds out."""
    return _read_xattr(folder) or _read_file(folder)


def _busy(folder, path) -> FolderBusy:
    return FolderBusy(f"{folder} is in use by another trainer: {describe(holder(folder) or {})} (lock {path}); "
                      "wait for it to finish or stop it, or point --ckpt-dir at another folder")


def _unlock(fd: int, folder: Path, record_in: str) -> None:
    """Remove the record (still holding the lock: no one can read a half-removed owner), unlock, close."""
    with contextlib.suppress(OSError):
        if record_in == "xattr":
            os.removexattr(folder, XATTR)
        elif record_in == "file" or os.fstat(fd).st_ino == os.stat(folder / LOCK_FILE).st_ino:
            os.unlink(folder / LOCK_FILE)   # "lockfile": only if it is still the file we locked
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


@dataclass
class Lock:
    """A held folder: :attr:`run_id` names this run; :attr:`stale` is the dead owner taken over (or None)."""

    folder: Path
    run_id: str
    fd: int
    owner: dict
    stale: dict | None = None
    record_in: str = "xattr"   #: "xattr", "file" (the directory is locked) or "lockfile" (the file is the lock)
    _finalizer: object = field(default=None, repr=False)

    def __post_init__(self):
        # a lock whose holder is dropped without release() (a rank's function returned) is released, not leaked
        self._finalizer = weakref.finalize(self, _unlock, self.fd, self.folder, self.record_in)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Remove the record (still holding the lock, so no one can take the old record in between), unlock."""
        self._finalizer()

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _record(run_id: str, command: str) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id, "command": command,
            "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def take(folder, *, command: str, run_id: str | None = None) -> Lock:
    """Lock ``folder`` (created if missing) for this run, or raise :class:`FolderBusy` naming the holder.

    Never blocks: a writer that waited for another to finish would start on a folder it did not see change. Keep
    the returned :class:`Lock`: dropping it releases the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    run_id = run_id or new_run_id()
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _busy(folder, folder) from None
    except OSError:   # NFS and the like: a directory cannot be locked there; the lock file can
        os.close(fd)
        return _take_file(folder, command, run_id)
    try:
        stale = _read_xattr(folder)
        if (folder / LOCK_FILE).exists():   # a record kept in a file: by a writer on a filesystem without xattrs,
            old = _take_file(folder, "", run_id, probe_only=True)   # or by an older course_lib -- alive?
            stale = stale or old
        owner = _record(run_id, command)
        text = json.dumps(owner).encode()
        try:
            os.setxattr(folder, XATTR, text)
            record_in = "xattr"
        except OSError as e:
            if e.errno not in _NO_XATTR:
                raise
            with open(folder / LOCK_FILE, "wb") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            record_in = "file"
        return Lock(folder, run_id, fd, owner, stale, record_in)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def _take_file(folder: Path, command: str, run_id: str, probe_only: bool = False):
    """The lock on ``<folder>/OWNER.lock`` itself (where a directory cannot be locked). ``probe_only``: an old
    record file found while holding the directory -- raise :class:`FolderBusy` if a live writer still locks it,
    else remove it and return what it said (a stale owner)."""
    path = folder / LOCK_FILE
    for _ in range(20):    # a retry only when the file we locked was removed by its releasing owner meanwhile
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(folder, path) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:           # we locked a file its owner had just removed: take the new one
            os.close(fd)
            continue
        old = os.read(fd, 1 << 16)
        try:
            stale = json.loads(old) if old.strip() else None
        except ValueError:
            stale = {"command": "a trainer killed while writing its lock file"}
        if probe_only:
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.close(fd)
            return stale
        owner = _record(run_id, command)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        os.fsync(fd)
        return Lock(folder, run_id, fd, owner, stale, "lockfile")
    raise FolderBusy(f"{folder}: could not take {path} (its owners kept replacing it); try again")
