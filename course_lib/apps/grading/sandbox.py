"""Run one submission headless, in a box no notebook can get out of: bubblewrap, limits, every process ended.
(What the box is made of -- its command line, its uid, its scratch disk, the reaper -- is :mod:`.box`.)

:func:`run_boxed` executes a notebook (already copied into its scratch folder) with nbclient's async API, so
several submissions share one event loop (``--jobs``) and none can block the others. The kernel starts as
``limits.py ... -- bwrap ... -- python -m course_lib.apps.grading.guard ...``:

* **what it sees** (:func:`bwrap_args`) -- Debian's ``bubblewrap``: the system folders, the Python installation,
  the venv and ``course_lib`` mounted read-only at their own paths, nothing else of the disk; its scratch folder
  (writable) and a private ``/tmp``. The class folder, other submissions, the grader's output, ``solutions/``,
  the home folders are not there. A new user namespace (uid nobody), PID namespace (every process it starts dies
  with it, ``setsid`` or not), network namespace (loopback only: gloo's rendezvous works, nothing else is
  reachable), IPC and UTS namespaces; the box dies with the grader (``--die-with-parent``);
* **time** -- each cell gets ``min(cell limit, time left for the notebook)``; a cell over it is interrupted
  and recorded as an error (:data:`TIMEOUT_ENAME`), and the next cells run; past the notebook limit the
  run is cancelled outright, whatever the kernel does;
* **who it is** -- started by root, the box runs as uid/gid 65534 (nobody) outside too (:mod:`.limits` drops root
  before bubblewrap starts): root-only files (``/etc/shadow``, a mode-600 file under ``/root``) stay closed to it.
  The scratch folder, its sockets folder and the guard's pipe are then owned by that uid; the grader, root, still
  reads everything back;
* **memory and processes** -- :mod:`.limits`: RLIMIT_AS per process, a memory cgroup whose limit
  (:attr:`Limits.memory_bytes`) counts all of the submission's RAM, the files it writes to ``/tmp`` and to its
  scratch folder included (past it the kernel is killed, and :attr:`BoxedRun.stopped` names the limit), and a
  pids cgroup (or RLIMIT_NPROC) that bounds a fork bomb also when the grader runs as root;
* **disk** -- the scratch folder is a size-limited tmpfs (:attr:`Limits.scratch_bytes`) for the run, mounted by
  root: a flood fails with ENOSPC, and the cell that hit the limit says so. When the run ends its files are copied
  back into the scratch folder and the tmpfs is unmounted;
* **output** -- at most :attr:`Limits.cell_output_bytes` per cell and :attr:`Limits.notebook_output_bytes` per
  notebook are kept; the rest is dropped, with one line saying so (:attr:`BoxedRun.truncated_cells`);
* **verdicts** -- decided outside: each check's run half writes plain data to ``scratch/.outbox``, judged by the
  grader (:mod:`course_lib.checks.judge`); the kernel is :mod:`.guard`, which writes each check's printed outcome and
  anything suspicious to a pipe read here (:attr:`BoxedRun.records`), for the flags; after the last cell the guard
  is asked for its integrity report;
* **processes** -- the kernel's environment carries a fresh tag (:data:`TAG_VAR`); at the end every
  process holding that tag, descending from the kernel or left in its cgroup is killed, and counted; the cgroups
  are removed and the scratch tmpfs unmounted.

Each bound that was hit is named in :attr:`BoxedRun.bounds` ("memory limit 2 GiB reached", "scratch disk limit
1 GiB reached"). Where a bound cannot be set (the grader is not root: no memory cgroup, no mount),
:func:`missing_bounds` names it and the grader says so once, on stderr; the other bounds still hold.

Without bubblewrap (``--no-sandbox``, or a machine where it cannot run: :func:`bwrap_problem` says why in one line)
everything else still holds, but the notebook sees the disk as the grader's user does.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.apps.grading import limits as limits_script
from course_lib.apps.grading.box import (BOX_UID, LIMITS_SCRIPT, ScratchDisk, box_uid, bwrap_args, bwrap_problem,
                                         chown_tree, end_processes, missing_bounds, say_once, size_text,
                                         tagged_processes)
from course_lib.apps.grading.kernel import TAG_VAR, capped_client, GuardChannel, kernel_environment, kernel_manager_class

__all__ = ["Limits", "BoxedRun", "run_boxed", "tagged_processes", "end_processes", "bwrap_problem", "bwrap_args",
           "warm_bytecode", "missing_bounds", "box_uid", "BOX_UID",
           "TAG_VAR", "TIMEOUT_ENAME"]

TIMEOUT_ENAME = "CellTimeout"
COURSE_ROOT = Path(__file__).resolve().parents[3]          # the checkout holding course_lib


@dataclass(frozen=True)
class Limits:
    """What one submission may use. Defaults suit a 2-core laptop grading one lab."""

    cell_s: float = 300.0          #: seconds per cell (a lab's slowest cell takes well under a minute)
    notebook_s: float = 900.0      #: seconds for the whole notebook, kernel start included
    memory_bytes: int = 4 << 30    #: RLIMIT_AS per process (kernel and each rank), and the memory cgroup's limit
    scratch_bytes: int = 1 << 30   #: the scratch folder's disk (a tmpfs: its pages count in memory_bytes too)
    nproc: int = 2048              #: processes and threads of the submission (pids cgroup; RLIMIT_NPROC without one)
    cell_output_bytes: int = 1 << 20        #: output kept per cell (a lab's biggest cell keeps ~200 KB: a figure)
    notebook_output_bytes: int = 8 << 20    #: output kept per notebook
    sandbox: bool = True           #: run the kernel under bubblewrap (see the module docstring)

    def __post_init__(self):
        if not (0 < self.cell_s and 0 < self.notebook_s and self.memory_bytes > 0 and self.nproc > 0
                and self.cell_output_bytes > 0 and self.notebook_output_bytes > 0 and self.scratch_bytes > 0):
            raise ValueError(f"limits must be positive: cell_s={self.cell_s}, notebook_s={self.notebook_s}, "
                             f"memory_bytes={self.memory_bytes}, nproc={self.nproc}, cell_output_bytes="
                             f"{self.cell_output_bytes}, notebook_output_bytes={self.notebook_output_bytes}, "
                             f"scratch_bytes={self.scratch_bytes}")


@dataclass
class BoxedRun:
    """What happened to one notebook run (the executed notebook itself is ``nb``, updated in place)."""

    tag: str = ""                  #: the value of :data:`TAG_VAR` its processes carried
    stopped: str | None = None     #: why the run stopped early: None when every cell ran
    seconds: float = 0.0
    processes: int = 0             #: processes of the submission found alive at the end (kernel included)
    leftovers: int = 0             #: ... still alive after the kernel was shut down, then killed
    timed_out_cells: list[int] = field(default_factory=list)
    truncated_cells: list[int] = field(default_factory=list)   #: cells whose output passed a cap
    records: list[dict] = field(default_factory=list)          #: what the guard wrote (see :mod:`.guard`)
    nonce: str = ""                #: what the guard's integrity record must echo
    sandboxed: bool = False
    bounds: list[str] = field(default_factory=list)     #: each bound the run hit, named ("memory limit 2 GiB reached")
    missing: list[str] = field(default_factory=list)    #: each bound that could not be set here, one line each
    uid: int | None = None         #: the box's uid outside (None: the grader's own)
    memory_peak: int = 0           #: the most bytes its memory cgroup held at once (0: no cgroup, or not known)
    scratch_disk: str = ""         #: where its scratch tmpfs was mounted for the run ("" when there was none)


#: What a lab's kernel imports, whatever the lab (JAX's stack is added for the labs that use it).
KERNEL_IMPORTS = ("ipykernel.kernelapp", "ipykernel.comm", "IPython", "matplotlib.pyplot", "matplotlib_inline.backend_inline",
                  "ipywidgets", "numpy", "torch", "torch.distributed", "tqdm.auto", "course_lib", "course_lib.checks.registry")
JAX_IMPORTS = ("jax", "jax.numpy", "flax.nnx", "optax", "orbax.checkpoint")


def warm_bytecode(jax: bool = False) -> None:
    """Import what a kernel imports once, outside the box, with bytecode writing on: inside, the venv is read-only,
    so a module without its ``.pyc`` would be compiled again by every kernel (seconds each, on a fresh install).
    The grader's user owns the venv; where it does not, this writes nothing and costs one import pass."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(COURSE_ROOT)
    names = KERNEL_IMPORTS + (JAX_IMPORTS if jax else ())
    code = "import importlib\nfor n in %r:\n    try:\n        importlib.import_module(n)\n    except Exception:\n        pass" % (names,)
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=600)


async def run_boxed(nb, scratch: Path, limits: Limits, lab: str = "") -> BoxedRun:
    """Execute ``nb`` (a NotebookNode, outputs filled in place) with cwd ``scratch``, for lab ``lab``; never raises
    for a failing notebook: ``BoxedRun.stopped`` says why it stopped early, ``BoxedRun.bounds`` which bound it hit."""
    scratch = Path(scratch)
    uid = box_uid(limits.sandbox)
    out = BoxedRun(tag=uuid.uuid4().hex, nonce=uuid.uuid4().hex, sandboxed=limits.sandbox, uid=uid,
                   missing=list(missing_bounds(limits.sandbox)))
    start = time.monotonic()
    disk = None
    if not any("scratch folder's disk" in m for m in out.missing):
        try:
            disk = ScratchDisk(scratch, limits.scratch_bytes, uid)
            out.scratch_disk = str(disk.disk)
        except OSError as exc:
            out.missing.append(f"the scratch folder's disk is not bounded (its tmpfs could not be mounted: {exc})")
    for line in out.missing:
        say_once(line)
    try:
        return await _run(nb, scratch, limits, lab, out, start + limits.notebook_s, disk)
    finally:
        if disk is not None:
            await asyncio.to_thread(disk.close)
        out.seconds = time.monotonic() - start


async def _run(nb, scratch: Path, limits: Limits, lab: str, out: BoxedRun, deadline: float,
               disk: ScratchDisk | None) -> BoxedRun:
    """:func:`run_boxed` once its scratch disk is mounted (``disk``, None without one)."""
    import nbformat       # here, not at the top: `python -m course_lib` reads Limits to build its parser
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from course_lib.authoring.run import without_output_widget_mirror

    tag, uid = out.tag, out.uid
    memory, disk_limit = size_text(limits.memory_bytes), size_text(limits.scratch_bytes)

    def cell_timeout(cell) -> int:
        return max(1, int(min(limits.cell_s, deadline - time.monotonic())))

    sockets = scratch / ".sockets"
    sockets.mkdir(exist_ok=True)
    channel = GuardChannel(sockets / "guard", out)
    cgroup = f"course-grade-{tag}"
    cmd = [sys.executable, str(LIMITS_SCRIPT), "--as-bytes", str(limits.memory_bytes), "--memory-bytes",
           str(limits.memory_bytes), "--pids", str(limits.nproc), "--cgroup", cgroup]
    if uid is not None:
        cmd += ["--user", str(uid)]
    cmd += ["--"]
    if limits.sandbox:
        cmd += bwrap_args(scratch) + ["--"]
    # -c, not -m: the guard must be the module `course_lib.apps.grading.guard` that finish() is later asked of, not __main__
    cmd += [sys.executable, "-c", "import sys; from course_lib.apps.grading.guard import main; main(sys.argv[1:])",
            "--lab", lab, "--channel", str(sockets / "guard")]
    env = kernel_environment(scratch, tag, limits.sandbox)
    base_manager = kernel_manager_class(limits, sockets, cmd)
    if uid is not None:            # the box is nobody outside too: its folders, its pipe and its connection file
        chown_tree(scratch, uid)

        class OwnedManager(base_manager):
            def write_connection_file(self, **kw):
                result = super().write_connection_file(**kw)
                os.chown(self.connection_file, uid, uid)
                return result
        manager = OwnedManager
    else:
        manager = base_manager
    client_cls = capped_client(NotebookClient, limits, out)
    client = without_output_widget_mirror(client_cls(
        nb, kernel_manager_class=manager, kernel_name="python3",
        timeout_func=cell_timeout, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
        error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": "interrupted at the cell limit", "traceback": []},
        shutdown_kernel="immediate", resources={"metadata": {"path": str(scratch)}}))
    kernel_pid: list[int | None] = [None]
    running: list[int | None] = [None]             # the cell running now (for the disk watch)
    full_cells: list[int] = []                     # the cells in which the scratch disk became full
    was_full = [False]

    log = open(sockets / "kernel.log", "wb")          # the kernel's own stdout/stderr (its banner, a crash)

    def disk_full(index) -> None:
        if disk is None or index is None:
            return
        full = disk.full()
        if full and not was_full[0] and index not in full_cells:
            full_cells.append(index)
        was_full[0] = full

    async def watch_disk():
        while True:
            await asyncio.sleep(0.2)
            disk_full(running[0])

    async def execute():
        async with client.async_setup_kernel(env=env, cwd=str(scratch), stdout=log, stderr=log):
            kernel_pid[0] = getattr(getattr(client.km, "provisioner", None), "pid", None)
            try:
                for index, cell in enumerate(client.nb.cells):
                    if time.monotonic() >= deadline - 1:
                        raise asyncio.TimeoutError
                    allowed, t0 = cell_timeout(cell), time.monotonic()
                    running[0] = index
                    await client.async_execute_cell(cell, index)
                    disk_full(index)
                    running[0] = None
                    if index in full_cells:
                        cell.outputs.append(nbformat.v4.new_output("stream", name="stderr", text=(
                            f"\n[the grader: the scratch folder's disk limit ({disk_limit}) was reached in this cell]\n")))
                    if cell.cell_type == "code" and time.monotonic() - t0 >= allowed:   # nbclient interrupted it
                        out.timed_out_cells.append(index)
                        cell.outputs.insert(0, nbformat.v4.new_output(
                            "error", ename=TIMEOUT_ENAME, traceback=[],
                            evalue=f"ran past the cell limit ({allowed} s) and was interrupted"))
                        if allowed < limits.cell_s:          # the notebook's limit, not the cell's, cut it short
                            raise asyncio.TimeoutError
                report = nbformat.v4.new_code_cell(      # the guard's integrity report, then the cell is dropped
                    f"__import__('course_lib.apps.grading.guard', fromlist=['finish']).finish({out.nonce!r})")
                client.nb.cells.append(report)
                try:
                    await client.async_execute_cell(report, len(client.nb.cells) - 1)
                finally:
                    client.nb.cells.pop()
            finally:       # counted while the kernel still runs (before the context shuts it down)
                out.processes = len(tagged_processes(tag, kernel_pid[0]))

    watcher = asyncio.ensure_future(watch_disk())
    try:
        await asyncio.wait_for(execute(), timeout=limits.notebook_s + 10)
    except asyncio.TimeoutError:
        out.stopped = f"stopped at the notebook's time limit ({limits.notebook_s:g} s)"
    except DeadKernelError:
        out.stopped = "the kernel died (out of memory, a crash, or os._exit)"
    except Exception as exc:  # a kernel that would not start, ...
        out.stopped = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    finally:
        watcher.cancel()
    used = limits_script.memory_report(cgroup)
    out.memory_peak = used.get("peak", 0)
    if used.get("oom_kills"):
        out.bounds.append(f"memory limit {memory} reached")
        if out.stopped and out.stopped.startswith("the kernel died"):
            out.stopped = f"memory limit {memory} reached: the kernel was killed"
    if full_cells or (disk is not None and disk.full()):
        where = f" (cell {', '.join(str(i + 1) for i in full_cells)})" if full_cells else ""
        out.bounds.append(f"scratch disk limit {disk_limit} reached{where}")
    out.leftovers = end_processes(tag, kernel_pid[0]) + limits_script.remove_cgroup(cgroup)
    channel.close()
    log.close()
    return out
