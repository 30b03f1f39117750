"""One owner per checkpoint folder: an ``fcntl`` lock on ``<folder>/OWNER.lock`` that names who holds it.

Two trainers writing one folder lose work even when no file is ever mixed: each one's saves race the other's,
and each one's "keep the last K" deletes the other's steps. So a trainer takes the folder before any rank
starts (:func:`take`), and a second trainer is refused in one line naming the first (:class:`FolderBusy`)::

    with take(ckpt_dir, command="python -m course_lib.train") as lock:   # lock.run_id: this run's id
        ...train...

* **who** -- the lock file holds JSON: host, pid, run id, command, start time. The lock itself is the kernel's
  (``flock``), not the file's existence: it is released by every exit path, ``SIGKILL`` and the OOM killer
  included, because the kernel drops it with the process's last open descriptor. On NFS, Linux maps ``flock`` to
  POSIX byte-range locks, which the server arbitrates across hosts.
* **stale owners** -- a file whose writer is gone (a killed trainer leaves its JSON behind) is taken over, and
  :attr:`Lock.stale` says whose it was, for the trainer to print. A live holder is never taken over.
* **release** -- :meth:`Lock.release` removes the file while still holding the lock, then closes it. A process
  that opened the old file in between and then locks it finds, by comparing inode numbers, that it locked a
  removed file, and tries again: never two owners.

Importing this module imports neither torch nor JAX.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LOCK_FILE", "FolderBusy", "Lock", "take", "holder", "new_run_id", "describe"]

LOCK_FILE = "OWNER.lock"   #: in the checkpoint folder; absent when no trainer holds the folder


class FolderBusy(RuntimeError):
    """Another live trainer holds the checkpoint folder; the message names it (host, pid, run, since when)."""


def new_run_id() -> str:
    """A short random id for one training run (recorded in the lock and in every step it commits)."""
    return uuid.uuid4().hex[:12]


def describe(owner: dict) -> str:
    """``python -m course_lib.train, pid 4242 on node7, run 3f2a9c01d4e5, since 2026-11-27 01:52:03 UTC``."""
    return (f"{owner.get('command', 'a trainer')}, pid {owner.get('pid', '?')} on {owner.get('host', '?')}, "
            f"run {owner.get('run_id', '?')}, since {owner.get('since', '?')}")


def holder(folder) -> dict | None:
    """What the lock file of ``folder`` says (None: no file, or unreadable -- a writer killed mid-write)."""
    try:
        return json.loads((Path(folder) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Lock:
    """A held folder: :attr:`run_id` names this run; :attr:`stale` is the dead owner taken over (or None)."""

    folder: Path
    run_id: str
    fd: int
    owner: dict
    stale: dict | None = None
    _released: bool = field(default=False, repr=False)

    def release(self) -> None:
        """Remove the lock file (still holding the lock, so no one can take the old file in between), unlock."""
        if self._released:
            return
        self._released = True
        with contextlib.suppress(OSError):
            if os.fstat(self.fd).st_ino == os.stat(self.folder / LOCK_FILE).st_ino:
                os.unlink(self.folder / LOCK_FILE)
        with contextlib.suppress(OSError):
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def __enter__(self) -> "Lock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def take(folder, *, command: str, run_id: str | None = None) -> Lock:
    """Lock ``folder`` (created if missing) for this process, or raise :class:`FolderBusy` naming the holder.

    Never blocks: a trainer that waited for another to finish would start on a folder it did not see change."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    run_id = run_id or new_run_id()
    for _ in range(20):    # a retry only when the file we locked was removed by its releasing owner meanwhile
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            owner = holder(folder) or {}
            raise FolderBusy(f"{folder} is in use by another trainer: {describe(owner)} (lock {path}); wait for it "
                             "to finish or stop it, or point --ckpt-dir at another folder") from None
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
        owner = {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id, "command": command,
                 "since": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(owner).encode(), 0)
        os.fsync(fd)
        return Lock(folder, run_id, fd, owner, stale)
    raise FolderBusy(f"{folder}: could not take {path} (its owners kept replacing it); try again")
