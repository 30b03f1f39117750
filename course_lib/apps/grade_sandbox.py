"""Run one submission headless, in a box: scratch folder, time limits, memory limit, every process ended.

:func:`run_boxed` executes a notebook (already copied into its scratch folder) with nbclient's async API,
so several submissions share one event loop (``--jobs``) and none can block the others:

* **where** -- the kernel's cwd is the scratch folder, and so are ``HOME``, ``TMPDIR`` and the caches
  (matplotlib, XDG, IPython), so a lab's files land there. This keeps honest code inside; it is not a
  security sandbox (an absolute path still reaches the disk, as the learner's own account could);
* **time** -- each cell gets ``min(cell limit, time left for the notebook)``; a cell over it is interrupted
  and recorded as an error (:data:`TIMEOUT_ENAME`), and the next cells run; past the notebook limit the
  run is cancelled outright, whatever the kernel does;
* **memory** -- the kernel starts through :mod:`course_lib.apps.grade_limits` (RLIMIT_AS per process,
  inherited by the rank processes ``course_lib.run`` forks; RLIMIT_NPROC as a fork-bomb brake);
* **processes** -- the kernel's environment carries a fresh tag (:data:`TAG_VAR`); at the end every
  process holding that tag, or descending from the kernel, is stopped then killed, until none is left
  (a fork server, its ranks, a daemon that left the session: all of them), and counted.

The kernel is this environment's Python (``sys.executable``): the course's own environment, where
``course_lib`` is importable (``PYTHONPATH`` is extended with the course checkout).
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Limits", "BoxedRun", "run_boxed", "tagged_processes", "end_processes", "TAG_VAR", "TIMEOUT_ENAME"]

TAG_VAR = "COURSE_LIB_GRADE_TAG"
TIMEOUT_ENAME = "CellTimeout"
LIMITS_SCRIPT = Path(__file__).with_name("grade_limits.py")
COURSE_ROOT = Path(__file__).resolve().parents[2]          # the checkout holding course_lib


@dataclass(frozen=True)
class Limits:
    """What one submission may use. Defaults suit a 2-core laptop grading one lab."""

    cell_s: float = 300.0          #: seconds per cell (a lab's slowest cell takes well under a minute)
    notebook_s: float = 900.0      #: seconds for the whole notebook, kernel start included
    memory_bytes: int = 4 << 30    #: RLIMIT_AS per process (kernel and each rank)
    nproc: int = 4096              #: RLIMIT_NPROC (per user; not enforced for root)

    def __post_init__(self):
        if not (0 < self.cell_s and 0 < self.notebook_s and self.memory_bytes > 0 and self.nproc > 0):
            raise ValueError(f"limits must be positive: cell_s={self.cell_s}, notebook_s={self.notebook_s}, "
                             f"memory_bytes={self.memory_bytes}, nproc={self.nproc}")


@dataclass
class BoxedRun:
    """What happened to one notebook run (the executed notebook itself is ``nb``, updated in place)."""

    tag: str = ""                  #: the value of :data:`TAG_VAR` its processes carried
    stopped: str | None = None     #: why the run stopped early: None when every cell ran
    seconds: float = 0.0
    processes: int = 0             #: processes of the submission found alive at the end (kernel included)
    leftovers: int = 0             #: ... still alive after the kernel was shut down, then killed
    timed_out_cells: list[int] = field(default_factory=list)


#: How long one wait on a kernel channel lasts before it looks again (see :func:`_client_class`).
POLL_SLICE_S = 1.0


def _client_class():
    """An async kernel client whose shell and IOPub waits are cut into :data:`POLL_SLICE_S` slices.

    Why: a single long wait can miss a message that has already arrived (the socket's wake-up is lost when
    widget comm traffic crosses the channel), and then nbclient sits out the whole cell limit beside an idle
    kernel -- seen here on Lab 02's ``interact`` cell in 2 of 30 runs, an open nbclient issue
    (jupyter/nbclient#312). Looking again every second finds the message; the limits are unchanged."""
    from queue import Empty

    from jupyter_client.asynchronous import AsyncKernelClient
    from jupyter_client.channels import AsyncZMQSocketChannel
    from traitlets import Type

    class SlicedChannel(AsyncZMQSocketChannel):
        async def get_msg(self, timeout: float | None = None):
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                left = POLL_SLICE_S if end is None else min(POLL_SLICE_S, max(0.0, end - time.monotonic()))
                try:
                    return await super().get_msg(timeout=left)
                except Empty:
                    if end is not None and time.monotonic() >= end:
                        raise

    class SlicedClient(AsyncKernelClient):
        shell_channel_class = Type(SlicedChannel)
        iopub_channel_class = Type(SlicedChannel)
    return SlicedClient


def _kernel_manager_class(limits: Limits, socket_dir: Path):
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    client = _client_class()

    class BoxedSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            spec = ipykernel.kernelspec.get_kernel_dict()
            spec["argv"] = [sys.executable, str(LIMITS_SCRIPT), "--as-bytes", str(limits.memory_bytes),
                            "--nproc", str(limits.nproc), "--", *spec["argv"]]
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES, **spec)

    class BoxedKernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            kw.setdefault("kernel_spec_manager", BoxedSpecs())
            kw.setdefault("transport", "ipc")                  # Unix sockets in the scratch folder
            kw.setdefault("ip", str(socket_dir / "kernel"))
            kw.setdefault("client_factory", client)
            super().__init__(**kw)
    return BoxedKernelManager


def _environment(scratch: Path, tag: str) -> dict[str, str]:
    home = scratch / ".home"
    for sub in ("tmp", "cache", "config", "mpl", "ipython"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({TAG_VAR: tag, "HOME": str(home), "TMPDIR": str(home / "tmp"), "XDG_CACHE_HOME": str(home / "cache"),
                "XDG_CONFIG_HOME": str(home / "config"), "MPLCONFIGDIR": str(home / "mpl"),
                "IPYTHONDIR": str(home / "ipython"), "COURSE_LIB_STRICT_CHECKS": "0",   # lab mode: ❌, never raise
                "PYTHONPATH": os.pathsep.join(p for p in (str(COURSE_ROOT), os.environ.get("PYTHONPATH")) if p),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    env.pop("JPY_PARENT_PID", None)
    return env


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


async def run_boxed(nb, scratch: Path, limits: Limits) -> BoxedRun:
    """Execute ``nb`` (a NotebookNode, outputs filled in place) with cwd ``scratch``; never raises for a
    failing notebook: ``BoxedRun.stopped`` says why it stopped early."""
    import nbformat       # here, not at the top: `python -m course_lib` reads Limits to build its parser
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from course_lib.authoring.run import without_output_widget_mirror

    scratch = Path(scratch)
    tag = uuid.uuid4().hex
    out = BoxedRun(tag=tag)
    start = time.monotonic()
    deadline = start + limits.notebook_s

    def cell_timeout(cell) -> int:
        return max(1, int(min(limits.cell_s, deadline - time.monotonic())))

    sockets = scratch / ".sockets"
    sockets.mkdir(exist_ok=True)
    client = without_output_widget_mirror(NotebookClient(
        nb, kernel_manager_class=_kernel_manager_class(limits, sockets), kernel_name="python3",
        timeout_func=cell_timeout, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
        error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": "interrupted at the cell limit", "traceback": []},
        shutdown_kernel="immediate", resources={"metadata": {"path": str(scratch)}}))
    kernel_pid: list[int | None] = [None]

    async def execute():
        async with client.async_setup_kernel(env=_environment(scratch, tag)):
            kernel_pid[0] = getattr(getattr(client.km, "provisioner", None), "pid", None)
            try:
                for index, cell in enumerate(client.nb.cells):
                    if time.monotonic() >= deadline - 1:
                        raise asyncio.TimeoutError
                    allowed, t0 = cell_timeout(cell), time.monotonic()
                    await client.async_execute_cell(cell, index)
                    if cell.cell_type == "code" and time.monotonic() - t0 >= allowed:   # nbclient interrupted it
                        out.timed_out_cells.append(index)
                        cell.outputs.insert(0, nbformat.v4.new_output(
                            "error", ename=TIMEOUT_ENAME, traceback=[],
                            evalue=f"ran past the cell limit ({allowed} s) and was interrupted"))
                        if allowed < limits.cell_s:          # the notebook's limit, not the cell's, cut it short
                            raise asyncio.TimeoutError
            finally:       # counted while the kernel still runs (before the context shuts it down)
                out.processes = len(tagged_processes(tag, kernel_pid[0]))

    try:
        await asyncio.wait_for(execute(), timeout=limits.notebook_s + 10)
    except asyncio.TimeoutError:
        out.stopped = f"stopped at the notebook's time limit ({limits.notebook_s:g} s)"
    except DeadKernelError:
        out.stopped = "the kernel died (out of memory, a crash, or os._exit)"
    except Exception as exc:  # a kernel that would not start, ...
        out.stopped = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    out.leftovers = end_processes(tag, kernel_pid[0])
    out.seconds = time.monotonic() - start
    return out
