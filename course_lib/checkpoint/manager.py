"""Checkpoints that survive faults: numbered DCP saves written then committed, verified, the last K kept.

What a careful trainer does around :mod:`~course_lib.checkpoint.dcp` (the words are defined there):

* **write, then commit; verify before load** -- step ``s`` is written into ``<root>/step_<s>.partial`` and, once
  every rank finished, committed by one atomic ``rename`` to ``<root>/step_<s>`` with each file's size and CRC-32
  in ``COMMIT.json``; a step is verified before it loads, and one without a readable commit record is not a
  checkpoint: :meth:`Checkpointer.latest` passes over it to the previous good step and
  :meth:`Checkpointer.ignored` says why. The protocol and its file format: :mod:`~course_lib.checkpoint.commit`.
* **one writer per folder** -- before its first save (``probe=True``: at construction) rank 0 takes the folder's
  owner lock (:mod:`~course_lib.checkpoint.owner`: the kernel's ``flock`` on the folder, a record of
  host, pid, run and command; released by :meth:`Checkpointer.close`, garbage collection or any exit, ``SIGKILL``
  included; a dead owner's record is taken over). A second Checkpointer on the folder -- another run, another
  process or this one -- is refused on every rank with the same :class:`FolderBusy`, naming the owner, before it
  writes a byte: two writers would prune each other's steps and race each other's renames. A folder held by this
  run's launcher (the same ``run_id``: ``python -m course_lib.torchrun``) is this run's.
* **fail before training, fail once, fail alike** -- where saves will happen, every rank writes a small probe
  file (``probe=True``: at construction, before any step runs; by default: before the first save): a
  read-only, missing or full folder is one :class:`CheckpointWriteError`. Constructing and loading never write
  (nor lock): a read-only folder loads.
  A save that fails on the disk is *agreed*: every rank reports what it saw in one collective, before anyone
  removes anything, and every rank then raises the same :class:`CheckpointWriteError` (one message, naming the
  ranks, the cause and the last good step) after the ``.partial`` directory is removed -- or, with
  ``on_save_error="warn"``, rank 0 prints that line and training goes on. A crash (a killed rank or launcher)
  leaves its ``.partial`` for :meth:`Checkpointer.incomplete` to name at resume; the next successful commit
  removes it (it can never load, and it is a checkpoint's size).
* **a full disk makes room first** -- when a save fails for lack of space, the steps that the new one would
  have pruned anyway (this run's, beyond ``keep`` once it is written; never the newest good one) are deleted
  and the save is tried once more; only if that fails too is it an error.
* **keep the last K of this run** -- only after a successful commit (a failed save deletes nothing), the newest
  K steps that verify are kept and the other steps *of this run* are deleted: a damaged newer step never costs
  an older good one, and a step another run wrote is never touched. "This run" is its lineage: every commit
  records the run id that wrote it and the runs it resumed from (``COMMIT.json``: ``run``, ``lineage``), and
  :meth:`Checkpointer.load` adopts the lineage of the step it loads. (Runs that follow one another share a
  folder this way; runs at the same time cannot: the owner lock.)
* **async** -- ``save(..., blocking=False)`` calls ``dcp.async_save`` on the manager's *own* gloo group:
  it needs a CPU-capable group, and its collectives (run in a background thread) must not interleave
  with the training's collectives on the default group. :meth:`Checkpointer.wait` resolves the future and
  commits.

Longer than ~300 lines: the life cycle of a step (write, commit, prune, load) and each of its failure paths (a
crash, a damaged commit record, a full or read-only disk, a second writer) read best in one place.

Reusable by a training script: ``ckpt = Checkpointer(root, keep=2)`` on every rank, then
``ckpt.save(step, {"app": AppState(model, opt, sched, data)})`` and, at start-up,
``step = ckpt.load_latest({"app": AppState(...)})``.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

from course_lib.checkpoint.commit import (COMMIT_FILE, PARTIAL, CheckpointCorrupt, commit, crc32_file, read_commit,
                                          run_of, step_dir, verify)
from course_lib.checkpoint.dcp import CheckpointMismatch, check_compatible, quiet_single_process
from course_lib.checkpoint.owner import FolderBusy
from course_lib.runtime.errors import inner_errors, rank_failures, root_cause

#: ``verify``, ``read_commit``, ``crc32_file``, ``step_dir``, ``COMMIT_FILE``, ``CheckpointCorrupt``: the commit
#: protocol's (:mod:`~course_lib.checkpoint.commit`), here too so that a trainer imports one module
__all__ = ["Checkpointer", "CheckpointCorrupt", "CheckpointMismatch", "CheckpointWriteError", "FolderBusy", "verify",
           "read_commit", "crc32_file", "step_dir", "COMMIT_FILE"]


class CheckpointWriteError(OSError):
    """Checkpoints cannot be written where asked (read-only, full, missing): one line naming the folder, the
    cause and the fix. Raised by the start-up probe, before any training time is spent, or by a failed save
    (whose ``.partial`` directory is removed first)."""


class Checkpointer:
    """Numbered checkpoints under ``root``, written then committed, the newest ``keep`` kept.

    Construct on every rank (it creates its own gloo group, a collective). ``group``: the ranks that save
    together (default: all). Every method that writes or reads is collective over them.

    Before the first save (``probe=True``: at construction, so a trainer fails before training starts) rank 0
    takes the folder's owner lock (``lock=False``: not taken -- the caller arbitrates writers itself) and every rank
    writes a probe file: a folder held by another live writer is :class:`FolderBusy` on every rank, naming it
    (:attr:`taken_over`: the dead owner whose record was taken over, or None); a read-only, missing or full
    folder is one :class:`CheckpointWriteError`, not a DCP traceback. ``probe``: ``True`` at construction;
    ``None`` (default) before the first save (a folder that is only read -- read-only media, someone else's
    checkpoints -- constructs and loads, and is not locked); ``False``: no probe file (the lock is still taken
    before the first save). ``command``: how the owner record names this program (default: ``sys.argv``).
    :meth:`close` (or ``with Checkpointer(...) as ckpt:``) finishes a save in flight and releases the folder.
    ``on_save_error``: ``"raise"`` (default) or ``"warn"`` -- print one line and keep training (the run goes on
    with the previous checkpoint as its last good one). Either way a failed save's ``.partial`` directory is
    removed. ``run_id``: this run's id (default: a new one, chosen by rank 0), recorded in every step it commits
    and in the owner record; only steps of this run and of the runs it resumed from are ever pruned.
    """

    def __init__(self, root, keep: int = 2, *, group=None, probe: bool | None = None, on_save_error: str = "raise",
                 run_id: str | None = None, lock: bool = True, command: str | None = None):
        import torch.distributed as dist
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1: the newest good checkpoint is never deleted")
        if on_save_error not in ("raise", "warn"):
            raise ValueError(f"on_save_error={on_save_error!r} must be 'raise' or 'warn'")
        self.root, self.keep, self._pending, self.on_save_error = Path(root), keep, None, on_save_error
        self.skipped: dict[int, str] = {}   #: steps latest() passed over, and why (filled by latest())
        self.distributed = dist.is_initialized()
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # async_save asserts a CPU-capable group, and runs collectives from a background thread: its own
        # gloo group keeps them apart from the training's (interleaved collectives deadlock or mix data)
        self.group = dist.new_group(ranks=ranks, backend="gloo") if self.distributed else None
        self.rank = dist.get_rank(self.group) if self.distributed else 0
        if self.rank == 0 and run_id is None:
            from course_lib.checkpoint.owner import new_run_id
            run_id = new_run_id()
        self.run_id = self._from_rank0(run_id)   # rank 0's: the ranks of one run share one id
        self.lineage: set[str] = {self.run_id}   #: runs whose steps this one may prune: itself and those it resumed
        self._probe, self._lock, self._ready = probe, lock, False
        self.command = command or " ".join([os.path.basename(sys.executable)] + sys.argv)[:300]
        self.owner = None                        #: rank 0's held lock (owner.Lock), once taken
        self.taken_over: dict | None = None      #: the dead owner whose record was taken over (rank 0), or None
        if probe:
            self._prepare_to_write()

    def _prepare_to_write(self) -> None:
        """Before the first save: take the folder (rank 0, agreed by every rank), then the write probe."""
        if self._lock:
            self._claim()
        if self._probe is not False:
            self.probe()
        self._ready = True

    def _claim(self) -> None:
        """Rank 0 takes the owner lock; every rank raises the same :class:`FolderBusy` when another writer holds
        it. A holder with this run's id is this run's launcher: the folder is already ours."""
        from course_lib.checkpoint import owner
        refused = None
        if self.rank == 0 and self.owner is None:
            for attempt in (1, 2):
                try:
                    self.owner = owner.take(self.root, command=self.command, run_id=self.run_id)
                    self.taken_over = self.owner.stale
                except FolderBusy as e:
                    held = owner.holder(self.root) or {}
                    if held.get("run_id") == self.run_id:
                        break
                    if attempt == 1 and held.get("pid") == os.getpid():
                        import gc
                        gc.collect()   # an earlier Checkpointer of this process, unreachable but in a cycle
                        continue
                    refused = str(e)
                except OSError:   # a folder that cannot be created or opened: the probe / the save names it
                    pass
                break
        refused = self._from_rank0(refused)
        if refused:
            raise FolderBusy(refused)

    def close(self) -> None:
        """Finish the save in flight (if any) and release the folder (rank 0). Collective when a save is in
        flight. The lock also goes when this object is garbage-collected, and with the process."""
        try:
            self.wait()
        finally:
            if self.owner is not None:
                self.owner.release()
                self.owner = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def probe(self, nbytes: int = 1 << 16) -> None:
        """Every rank writes ``nbytes`` into ``root``, syncs and deletes it; any failure on any rank raises
        :class:`CheckpointWriteError` on every rank (none is left waiting in a later collective)."""
        err = None
        try:
            if self.rank == 0:
                self.root.mkdir(parents=True, exist_ok=True)
            self._barrier()
            f = self.root / f".write-probe-{self.rank}-{os.getpid()}"
            try:
                with open(f, "wb") as fh:
                    fh.write(os.urandom(nbytes))
                    fh.flush()
                    os.fsync(fh.fileno())
            finally:
                f.unlink(missing_ok=True)
        except OSError as e:
            err = f"{type(e).__name__}: {e.strerror or e}"
        bad = [(r, e) for r, e in enumerate(self._gather(err)) if e]
        if bad:
            r, e = bad[0]
            where = f" (rank {r})" if self.distributed else ""
            raise CheckpointWriteError(f"cannot write checkpoints to {self.root}{where}: {e}. Fix: point the "
                                       "checkpoint folder at a writable directory with free space")

    # -- what is on disk --------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, oldest first (``.partial`` directories are not checkpoints)."""
        if not self.root.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in self.root.iterdir()
                      if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit())

    def incomplete(self) -> list[Path]:
        """Directories of saves that never committed (a crash, or one in flight)."""
        return sorted(p for p in self.root.glob(f"step_*{PARTIAL}")) if self.root.is_dir() else []

    def latest(self) -> int | None:
        """The newest committed step that passes :func:`verify`, or None. The newer steps it passed over are
        in :attr:`skipped` with the reason (see :meth:`ignored`)."""
        self.skipped = {}
        for step in reversed(self.steps()):
            try:
                verify(step_dir(self.root, step))
                return step
            except CheckpointCorrupt as e:
                self.skipped[step] = str(e)
        return None

    def ignored(self) -> list[str]:
        """One line per directory :meth:`latest` did not use: damaged or uncommitted steps newer than the
        one chosen, and saves that never committed (``.partial``). For a trainer to print at resume."""
        lines = [f"skipped step {s}: {why}" for s, why in sorted(self.skipped.items())]
        return lines + [f"ignored {p}: an unfinished save (never committed)" for p in self.incomplete()]

    # -- save ---------------------------------------------------------------------------------------------
    def save(self, step: int, state: dict, *, blocking: bool = True) -> bool:
        """Write ``state`` as step ``step``; commit now (``blocking``) or in :meth:`wait` (async).
        Blocking time of an async save: staging, i.e. copying every tensor once, in this thread. Returns False
        when the save failed and ``on_save_error="warn"`` (else it raises)."""
        self.wait()                                        # one save in flight at a time
        if not self._ready:
            self._prepare_to_write()                       # the folder's lock, then the probe: before any byte
        from torch.distributed.checkpoint.api import CheckpointException
        for attempt in (1, 2):
            try:
                self._write(step, state, blocking)
                if not blocking:
                    return True
                self._commit(step)
                self._pending = None
                break
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP raises on every rank: all are here
                self._pending = None
                verdict = self._agree(step, e)             # the one collective: every rank decides the same
                if attempt == 1 and verdict["full"] and self._make_room(step):
                    continue                               # the steps the new one would have pruned are gone: again
                return self._give_up(step, verdict, e)
        self._prune()
        return True

    def _write(self, step: int, state: dict, blocking: bool) -> None:
        import torch.distributed.checkpoint as dcp
        tmp = step_dir(self.root, step, partial=True)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)         # debris of an earlier crash at the same step
        self._barrier()
        kw = {"checkpoint_id": os.fspath(tmp), "process_group": self.group, "no_dist": not self.distributed}
        with quiet_single_process():
            if blocking:
                dcp.save(state, **kw)
                self._pending = (step, None)
            else:
                self._pending = (step, dcp.async_save(state, **kw))

    def _agree(self, step: int, exc: BaseException) -> dict:
        """Every rank's view of a failed save, gathered in one collective *before* anyone removes anything, and
        the verdict every rank then acts on: ``storage`` (the disk's fault: read-only, full...), ``full`` (no
        space), ``cause`` (one line, from the lowest rank that saw the disk's error) and the ``ranks`` that did.
        A failure that is not the disk's (a dead peer, a broken group) is re-raised: the launcher's business."""
        cause, storage = _root_cause(exc)
        full = _no_space(exc)
        try:   # torch.save reports a full disk as "unexpected pos ...": say what it means
            free = shutil.disk_usage(self.root).free
            if free < (1 << 20):
                cause, storage, full = cause + f" -- the disk is full ({free:,} bytes free)", True, True
        except OSError:
            pass
        failed = list(rank_failures(exc)) or None   # DCP names the ranks whose write failed
        try:
            views = self._gather({"cause": cause, "storage": storage, "full": full, "failed": failed})
        except BaseException:  # noqa: BLE001 - the group itself is broken (a rank died): nothing to agree on
            raise exc from None
        bad = [r for r, v in enumerate(views) if v["storage"]]
        if not bad:
            raise exc
        return {"storage": True, "full": any(v["full"] for v in views), "cause": views[bad[0]]["cause"],
                "ranks": views[bad[0]]["failed"] or bad, "world": len(views)}

    def _make_room(self, step: int) -> bool:
        """After a save ran out of space: delete the debris of crashed saves and this run's steps that committing
        ``step`` would prune anyway (all but the newest ``keep - 1`` good ones; never the newest good one). True
        when something was deleted (then the save is tried again). Collective; rank 0 deletes."""
        freed = []
        if self.rank == 0:
            shutil.rmtree(step_dir(self.root, step, partial=True), ignore_errors=True)
            for debris in self.incomplete():
                shutil.rmtree(debris, ignore_errors=True)
                freed.append(debris.name)
            for s in self._prunable(keep=max(self.keep - 1, 1)):
                shutil.rmtree(step_dir(self.root, s), ignore_errors=True)
                freed.append(f"step {s}")
            if freed:
                print(f"course_lib: no space left to save step {step} in {self.root}: removed {', '.join(freed)} "
                      f"(beyond keep={self.keep} once step {step} is written) and saving again", file=sys.stderr,
                      flush=True)
        return bool(self._from_rank0(freed))

    def _give_up(self, step: int, verdict: dict, exc: BaseException) -> bool:
        """The agreed failure: rank 0 removes the ``.partial`` directory, then every rank raises the same
        :class:`CheckpointWriteError` or, with ``on_save_error="warn"``, rank 0 prints it and all return False."""
        if self.rank == 0:
            shutil.rmtree(step_dir(self.root, step, partial=True), ignore_errors=True)
        self._barrier()
        last = self.steps()
        ranks = verdict["ranks"]
        where = "" if verdict["world"] == 1 else (" on every rank" if len(ranks) == verdict["world"] else
                                                   f" on rank(s) {ranks} of {verdict['world']}")
        msg = (f"saving step {step} to {self.root} failed{where}: {verdict['cause']}; its partial directory was "
               f"removed, the last complete checkpoint is {'step ' + str(last[-1]) if last else 'none'}")
        if self.on_save_error == "warn":
            if self.rank == 0:
                print(f"warning: {msg}; training goes on (on_save_error='warn')", file=sys.stderr, flush=True)
            return False
        fix = ("free space on that disk (or lower keep), then resume" if verdict["full"] else
               "make the folder writable or point the checkpoints elsewhere, then resume")
        raise CheckpointWriteError(f"{msg}. Fix: {fix}") from exc

    @property
    def in_flight(self):
        """The future of the async save being written (``.done()`` tells), or None."""
        return None if self._pending is None else self._pending[1]

    def wait(self) -> int | None:
        """Finish the save in flight (if any): wait for its files, commit, prune. Returns its step (None
        when nothing was in flight or, with ``on_save_error="warn"``, when the save failed). An async save that
        ran out of space makes room for the next one (its state is gone: it is not tried again)."""
        if self._pending is None:
            return None
        step, future = self._pending
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            if future is not None:
                future.result()                            # every rank's file and .metadata are written
            self._commit(step)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - e.g. no space left for COMMIT.json
            self._pending = None
            verdict = self._agree(step, e)
            if verdict["full"]:
                self._make_room(step)
            self._give_up(step, verdict, e)
            return None
        self._pending = None
        self._prune()
        return step

    def _commit(self, step: int) -> None:
        """Each rank checksums the files it wrote; rank 0 writes ``COMMIT.json`` and renames. Any rank's failure
        fails the commit on every rank (none waits in a collective the others skipped)."""
        tmp = step_dir(self.root, step, partial=True)
        try:
            mine = {f.name: [f.stat().st_size, crc32_file(f)] for f in tmp.iterdir()
                    if f.name.startswith(f"__{self.rank}_")}
        except OSError as e:
            mine = e
        every = self._gather(mine)
        err = next((e for e in every if isinstance(e, BaseException)), None)
        if self.rank == 0 and err is None:
            try:
                commit(self.root, step, every, run=self.run_id, lineage=self.lineage)
            except OSError as e:
                err = e
        err = self._from_rank0(err)                        # every rank fails alike, none waits in a barrier
        if err is not None:
            raise err

    def _prunable(self, keep: int) -> list[int]:
        """This run's committed steps beyond the newest ``keep`` that verify (sizes only), newest first. Steps of
        other runs, and steps whose commit record cannot say which run wrote them, are never listed."""
        kept, out = 0, []
        for s in reversed(self.steps()):
            if run_of(step_dir(self.root, s)) not in self.lineage:
                continue
            if kept < keep:
                try:
                    verify(step_dir(self.root, s), crc=False)
                    kept += 1
                    continue
                except CheckpointCorrupt:
                    pass
            out.append(s)
        return out

    def _prune(self) -> None:
        """Keep the newest ``keep`` steps of this run that verify; delete its other steps, and the ``.partial``
        directories that crashes left (none is in flight: one save at a time). Verified by sizes only (cheap: no
        re-reading of K checkpoints per save); :meth:`load` checks the CRCs."""
        if self.rank == 0:
            for debris in self.incomplete():
                shutil.rmtree(debris, ignore_errors=True)
            for s in self._prunable(self.keep):
                shutil.rmtree(step_dir(self.root, s), ignore_errors=True)
        self._barrier()

    # -- load ---------------------------------------------------------------------------------------------
    def load(self, state: dict, step: int | None = None, *, strict: bool = True) -> int:
        """Verify step ``step`` (default: :meth:`latest`), check it fits ``state``, load in place.
        Returns the step. Raises :class:`CheckpointCorrupt` / :class:`CheckpointMismatch` naming what.

        Collective and all-or-nothing: rank 0 chooses and verifies the step, every rank checks its own
        template, and if any rank's does not fit, every rank raises (a rank that went on into ``dcp.load``
        alone would wait there for the others forever)."""
        import torch.distributed.checkpoint as dcp
        chosen, err = step, None
        if self.rank == 0:
            try:
                if chosen is None:
                    chosen = self.latest()
                    if chosen is None:
                        raise FileNotFoundError(f"no committed, intact checkpoint under {self.root} (steps "
                                                f"{self.steps()}, incomplete {[p.name for p in self.incomplete()]})")
                verify(step_dir(self.root, chosen))
            except (FileNotFoundError, CheckpointCorrupt) as e:
                err = e
        chosen, err = self._from_rank0((chosen, err))
        if err is not None:
            raise err
        path = step_dir(self.root, chosen)
        try:
            check_compatible(state, path, strict=strict)
            mine = None
        except CheckpointMismatch as e:
            mine = str(e)
        bad = {r: e for r, e in enumerate(self._gather(mine)) if e}
        if bad:
            first = min(bad)
            where = f"on rank(s) {sorted(bad)}: " if self.distributed else ""
            raise CheckpointMismatch(where + bad[first])
        with quiet_single_process():
            dcp.load(state, checkpoint_id=os.fspath(path), process_group=self.group, no_dist=not self.distributed)
        record = read_commit(path) or {}                   # resuming a run makes its steps this run's too
        self.lineage |= set(record.get("lineage") or []) | ({record["run"]} if record.get("run") else set())
        return chosen

    def load_latest(self, state: dict, *, strict: bool = True) -> int | None:
        """:meth:`load` the newest good step and return it; None (state untouched) when there is none."""
        return None if self.latest() is None else self.load(state, strict=strict)

    def _gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _from_rank0(self, obj):
        if not self.distributed:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def _barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist
            dist.barrier(group=self.group)



def _no_space(exc: BaseException) -> bool:
    """Whether ENOSPC (or EDQUOT) is anywhere in ``exc``: its causes and contexts, or DCP's per-rank failures."""
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
               for e in inner_errors(exc, context=True))


def _root_cause(exc: BaseException) -> tuple[str, bool]:
    """The first real error inside DCP's ``CheckpointException`` (it wraps every rank's), in one line, and
    whether it is the storage's (an ``OSError`` that is not a broken connection)."""
    first = next(iter(rank_failures(exc).values()), None)   # the lowest failed rank's (exception, stack)
    seen = root_cause(first[0] if first else exc)
    storage = isinstance(seen, OSError) and not isinstance(seen, ConnectionError)
    if isinstance(seen, OSError) and seen.strerror:
        return f"{type(seen).__name__}: {seen.strerror}" + (f" ({seen.filename})" if seen.filename else ""), storage
    return f"{type(seen).__name__}: {str(seen).splitlines()[0] if str(seen) else ''}", storage
