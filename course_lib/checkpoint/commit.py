"""The commit protocol of a DCP step: written into ``step_<s>.partial``, committed by one ``rename``, verified.

A step of :class:`~course_lib.checkpoint.manager.Checkpointer` is a directory of DCP files (the vocabulary is
:mod:`~course_lib.checkpoint.dcp`'s). Its life on disk:

* **written** into ``<root>/step_<s>.partial`` (:func:`step_dir` with ``partial=True``): no one mistakes it for a
  checkpoint, whatever it holds;
* **committed** by :func:`commit` once every rank finished (DCP wrote ``.metadata``, its own commit): rank 0
  records each file's size and CRC-32 in ``COMMIT.json``, with the run that wrote the step and the runs it resumed
  from, then renames the directory to ``<root>/step_<s>`` -- one atomic ``rename`` -- and syncs the folder. A crash
  at any moment leaves the previous committed step or a ``.partial``. Orbax does the same
  (``<step>.orbax-checkpoint-tmp`` -> ``<step>`` and ``commit_success.txt``);
* **verified** before it is loaded (:func:`verify`): ``.metadata`` present and as committed, every file it
  points into present and long enough, every byte with the CRC-32 recorded at commit. DCP itself would fail on a
  truncated file with an unpickling error, and would load a corrupted one silently. A directory whose
  ``COMMIT.json`` is missing, damaged or names another step (:func:`read_commit`) is not a checkpoint.

Files and ``os.rename`` only: no process group (the manager gathers the ranks' records and calls :func:`commit`
on rank 0).
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from pathlib import Path

from course_lib.checkpoint.dcp import read_metadata

__all__ = ["COMMIT_FILE", "PARTIAL", "CheckpointCorrupt", "crc32_file", "step_dir", "read_commit", "run_of",
           "verify", "commit"]

COMMIT_FILE = "COMMIT.json"   #: written last inside the directory, just before the rename that commits it
PARTIAL = ".partial"          #: suffix of a directory being written (or abandoned by a crash)
_CHUNK = 1 << 20              # CRC in 1 MiB pieces: a checkpoint file may not fit in memory twice


class CheckpointCorrupt(RuntimeError):
    """A checkpoint directory that must not be loaded; the message names the file and what is wrong."""


def crc32_file(path) -> int:
    """CRC-32 of a file's bytes (zlib's; a checksum against accidents, not an attacker)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def step_dir(root, step: int, partial: bool = False) -> Path:
    """``<root>/step_00000012`` (or ``...partial``): zero-padded so that names sort as numbers."""
    return Path(root) / (f"step_{step:08d}" + (PARTIAL if partial else ""))


def read_commit(path) -> dict | None:
    """The commit record of a step directory (None when it has none); :class:`CheckpointCorrupt` naming the
    file when it is there but unreadable, truncated or not a commit record of this step."""
    f = Path(path) / COMMIT_FILE
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
        files = record["files"]
        if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 for v in files.values()):
            raise ValueError("'files' is not a map of name -> [size, crc]")
    except Exception as e:  # noqa: BLE001 - JSONDecodeError, KeyError, TypeError: all mean "damaged"
        raise CheckpointCorrupt(f"{f} is damaged ({type(e).__name__}: {e}): the commit record of this step "
                                "cannot be trusted, so neither can the step") from None
    name = Path(path).name
    if name.startswith("step_") and name[5:].isdigit() and record.get("step") != int(name[5:]):
        raise CheckpointCorrupt(f"{f} records step {record.get('step')!r}, but the directory is step "
                                f"{int(name[5:])}: a commit record copied from another step or run")
    return record


def verify(path, *, crc: bool = True, committed: bool = True) -> dict:
    """Raise :class:`CheckpointCorrupt` unless the DCP checkpoint at ``path`` is complete and intact.

    Checks, naming the first bad file: ``.metadata`` present (else the save never finished); ``COMMIT.json``
    present and readable (else the step was never committed -- a deleted commit record means "not a
    checkpoint", whatever the data files say; ``committed=False`` checks an uncommitted directory);
    ``.metadata`` as recorded at commit (else it was replaced, e.g. by another run's); every file the
    metadata points into present and at least as long as the furthest byte it needs (else truncated); every
    file's size and CRC-32 as recorded at commit (else the bytes changed after the save; CRCs skipped with
    ``crc=False``). Returns the commit record (``{}`` for an uncommitted directory)."""
    path, check_crc = Path(path), crc
    try:
        meta = read_metadata(path)
    except FileNotFoundError as e:
        raise CheckpointCorrupt(str(e)) from None
    except Exception as e:  # noqa: BLE001 - an unreadable .metadata is as bad as a missing one
        raise CheckpointCorrupt(f"{path / '.metadata'} is unreadable ({type(e).__name__}: {e}); "
                                "the file is truncated or corrupted") from None
    record = read_commit(path)
    if record is None and committed:
        raise CheckpointCorrupt(f"{path / COMMIT_FILE} is missing: this step was never committed (a save that "
                                "crashed before its commit, or a deleted commit record), so it is not a checkpoint")
    if record and ".metadata" in record["files"]:
        size, want = record["files"][".metadata"]
        m = path / ".metadata"
        if m.stat().st_size != size or (check_crc and crc32_file(m) != want):
            raise CheckpointCorrupt(f"{m} is not the .metadata this step was committed with (size or CRC-32 "
                                    "differ): replaced after the save, e.g. by another run's or another step's")
    need: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(need.items()):
        f = path / name
        if not f.is_file():
            raise CheckpointCorrupt(f"{f} is missing: .metadata places tensor data in it")
        if (size := f.stat().st_size) < end:
            raise CheckpointCorrupt(f"{f} is truncated: {size:,} bytes on disk, but .metadata needs bytes up to "
                                    f"{end:,}")
    if record is None:
        return {}
    for name, (size, crc) in sorted(record["files"].items()):
        f = path / name
        if not f.is_file():
            raise CheckpointCorrupt(f"{f} is missing (it was there at commit)")
        if f.stat().st_size != size:
            raise CheckpointCorrupt(f"{f} has {f.stat().st_size:,} bytes, {size:,} at commit: truncated or rewritten")
        if check_crc and (got := crc32_file(f)) != crc:
            raise CheckpointCorrupt(f"{f} is corrupted: CRC-32 {got:08x}, {crc:08x} at commit (same size, "
                                    "different bytes)")
    return record


def run_of(path) -> str | None:
    """The run that committed the step at ``path`` (None: no readable commit record, or an older one without)."""
    try:
        return (read_commit(path) or {}).get("run")
    except CheckpointCorrupt:
        return None


def commit(root, step: int, every: list[dict], *, run: str | None, lineage) -> Path:
    """Commit ``<root>/step_<step>.partial``: write ``COMMIT.json`` (``every``: each rank's ``{file: [size, crc]}``,
    in rank order; ``.metadata`` is added here; ``run`` and ``lineage``: the run that wrote the step and the runs it
    resumed from), rename the directory to ``<root>/step_<step>`` and make the rename durable. Saving a step again
    replaces it only if a run of ``lineage`` wrote it: another run's step is an ``OSError`` (``EEXIST``) naming
    that run. Returns the committed directory."""
    tmp, final = step_dir(root, step, partial=True), step_dir(root, step)
    files = {k: v for d in every for k, v in d.items()}
    files[".metadata"] = [(tmp / ".metadata").stat().st_size, crc32_file(tmp / ".metadata")]
    record = {"step": step, "world_size": len(every), "files": files, "run": run, "lineage": sorted(lineage)}
    with open(tmp / COMMIT_FILE, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():                             # saving a step again replaces it: only one of this run's
        owner = run_of(final)
        if owner is not None and owner not in lineage:
            raise OSError(errno.EEXIST, f"step {step} already exists, written by run {owner} (not this one), "
                                        "and is not replaced", os.fspath(final))
        shutil.rmtree(final)
    os.rename(tmp, final)                          # the commit: atomic on one filesystem
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)                               # make the rename itself durable
    finally:
        os.close(fd)
    return final
