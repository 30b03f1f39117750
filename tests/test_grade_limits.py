"""The box's resources and identity (issue 49 items 5 and 6): RAM with /tmp included stops at the memory limit,
the scratch folder's disk at its own limit, each named; root-only files stay closed when root grades; nothing is
left behind (cgroups removed, mounts unmounted, no process). Short notebooks, no lab: seconds of kernel time each.

The floods need root (a memory cgroup, a tmpfs mount) and are skipped elsewhere; the fallback's one line is
checked everywhere."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest

from course_lib.apps.grading import limits as limits_script
from course_lib.apps.grading import sandbox
from course_lib.apps.grading.sandbox import Limits, run_boxed, tagged_processes

pytestmark = pytest.mark.timeout(180)

root = pytest.mark.skipif(os.geteuid() != 0 or limits_script.cgroup_parent("memory") is None
                          or shutil.which("mount") is None, reason="needs root: a memory cgroup and mount")
boxed = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make system-deps)")


def _nb(*sources: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _nothing_left(run) -> None:
    assert tagged_processes(run.tag) == []
    for controller in ("pids", "memory"):
        assert limits_script._group(f"course-grade-{run.tag}", controller) is None, controller
    mounts = Path("/proc/mounts").read_text()
    if run.scratch_disk:
        assert f" {run.scratch_disk} " not in mounts and not Path(run.scratch_disk).exists()


FLOOD = """chunk = b'x' * (16 << 20)
n = 0
with open({path!r}, 'wb') as f:
    for _ in range({chunks}):
        f.write(chunk)
        f.flush()
        n += len(chunk)
        if n % (128 << 20) == 0:
            print(n >> 20, 'MiB', flush=True)
print('WROTE ALL', flush=True)"""


@root
@boxed
def test_a_tmp_flood_stops_at_the_memory_limit(tmp_path):
    nb = _nb("print('up')", FLOOD.format(path="/tmp/flood", chunks=3 * 64), "print('after')")   # 3 GiB to /tmp
    run = asyncio.run(run_boxed(nb, tmp_path, Limits(cell_s=120, notebook_s=170, memory_bytes=1 << 30)))
    assert run.stopped == "memory limit 1 GiB reached: the kernel was killed", run
    assert run.bounds == ["memory limit 1 GiB reached"]
    assert "WROTE ALL" not in _text(nb.cells[1]) and "after" not in _text(nb.cells[2])
    written = [int(line.split()[0]) for line in _text(nb.cells[1]).splitlines() if line.endswith("MiB")]
    assert max(written, default=0) < 1024 and run.memory_peak <= 1 << 30
    _nothing_left(run)


@root
@boxed
def test_a_scratch_flood_stops_at_the_disk_limit(tmp_path):
    nb = _nb("print('up')",
             "import os\nchunk, n = b'x' * (1 << 20), 0\ntry:\n    with open('flood.bin', 'wb') as f:\n"
             "        for _ in range(1024):\n            f.write(chunk)\n            n += len(chunk)\n"
             "except OSError as e:\n    print('stopped after', n >> 20, 'MiB, errno', e.errno)",          # 1 GiB asked
             "print('next cell ran')")
    run = asyncio.run(run_boxed(nb, tmp_path, Limits(cell_s=60, notebook_s=120, memory_bytes=2 << 30,
                                                     scratch_bytes=64 << 20)))
    assert run.stopped is None and run.bounds == ["scratch disk limit 64 MiB reached (cell 2)"], run
    said = _text(nb.cells[1])
    assert "errno 28" in said and int(said.split("stopped after ")[1].split()[0]) < 64
    assert "disk limit (64 MiB) was reached in this cell" in said
    assert _text(nb.cells[2]).startswith("next cell ran")
    assert (tmp_path / "flood.bin").stat().st_size <= 64 << 20        # the grader reads the run's files back
    _nothing_left(run)


@root
@boxed
def test_root_only_files_are_closed_to_the_box(tmp_path):
    secret = Path("/etc") / f"course-grade-secret-{os.getpid()}"         # /etc is what the box sees of the system
    secret.write_text("root only\n")
    secret.chmod(0o600)
    try:
        nb = _nb("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
                 f"for p in ['/etc/shadow', {str(secret)!r}]:\n    try:\n        print(open(p).read())\n"
                 "    except OSError as e:\n        print('closed', e.errno)\n"
                 "open('mine.txt', 'w').write('by nobody')")
        run = asyncio.run(run_boxed(nb, tmp_path, Limits(cell_s=60, notebook_s=120)))
    finally:
        secret.unlink()
    assert run.stopped is None and run.uid == sandbox.BOX_UID
    said = _text(nb.cells[0])
    assert said.splitlines()[0].startswith("65534 65534") and said.count("closed 13") == 2, said
    assert "root only" not in said
    assert (tmp_path / "mine.txt").read_text() == "by nobody"
    assert run.records and run.records[0]["kind"] == "boot"            # the guard's pipe was open to nobody
    _nothing_left(run)


def test_a_missing_bound_is_said_in_one_line(monkeypatch):
    monkeypatch.setattr(limits_script, "cgroup_parent", lambda controller="pids": None)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    lines = sandbox.missing_bounds.__wrapped__(True)
    assert len(lines) == 2 and "memory cgroup" in lines[0] and "disk is not bounded" in lines[1]
    assert sandbox.box_uid(True) is None                          # not root: the box is the grader's own user


def test_reachable_names_the_closed_folder():
    base = Path(tempfile.mkdtemp(prefix="course-grade-reach-"))      # under /tmp, which everyone may enter
    base.chmod(0o755)
    closed = base / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    owner = closed.stat().st_uid
    other = 65534 if owner != 65534 else 65533
    try:
        assert limits_script.reachable(str(closed / "inner"), owner, owner) is None
        assert limits_script.reachable(str(closed / "inner"), other, other) == str(closed)
    finally:
        shutil.rmtree(base)
