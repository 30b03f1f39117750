"""Run one submission headless, in a box no notebook can get out of: bubblewrap, limits, every process ended.

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
* **memory and processes** -- :mod:`.limits`: RLIMIT_AS per process, and a pids cgroup (or RLIMIT_NPROC) that
  bounds a fork bomb also when the grader runs as root;
* **output** -- at most :attr:`Limits.cell_output_bytes` per cell and :attr:`Limits.notebook_output_bytes` per
  notebook are kept; the rest is dropped, with one line saying so (:attr:`BoxedRun.truncated_cells`);
* **verdicts** -- decided outside: each check's run half writes plain data to ``scratch/.outbox``, judged by the
  grader (:mod:`course_lib.checks.judge`); the kernel is :mod:`.guard`, which writes each check's printed outcome and
  anything suspicious to a pipe read here (:attr:`BoxedRun.records`), for the flags; after the last cell the guard
  is asked for its integrity report;
* **processes** -- the kernel's environment carries a fresh tag (:data:`TAG_VAR`); at the end every
  process holding that tag, descending from the kernel or left in its cgroup is killed, and counted.

Without bubblewrap (``--no-sandbox``, or a machine where it cannot run: :func:`bwrap_problem` says why in one line)
everything else still holds, but the notebook sees the disk as the grader's user does.
"""
from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.apps.grading import limits as limits_script
from course_lib.apps.grading.kernel import TAG_VAR, capped_client, GuardChannel, kernel_environment, kernel_manager_class

__all__ = ["Limits", "BoxedRun", "run_boxed", "tagged_processes", "end_processes", "bwrap_problem", "bwrap_args",
           "warm_bytecode",
           "TAG_VAR", "TIMEOUT_ENAME"]

TIMEOUT_ENAME = "CellTimeout"
LIMITS_SCRIPT = Path(limits_script.__file__)
COURSE_ROOT = Path(__file__).resolve().parents[3]          # the checkout holding course_lib
BWRAP = os.environ.get("COURSE_LIB_BWRAP", "bwrap")        # a test points it elsewhere to try the refusal


@dataclass(frozen=True)
class Limits:
    """What one submission may use. Defaults suit a 2-core laptop grading one lab."""

    cell_s: float = 300.0          #: seconds per cell (a lab's slowest cell takes well under a minute)
    notebook_s: float = 900.0      #: seconds for the whole notebook, kernel start included
    memory_bytes: int = 4 << 30    #: RLIMIT_AS per process (kernel and each rank)
    nproc: int = 2048              #: processes and threads of the submission (pids cgroup; RLIMIT_NPROC without one)
    cell_output_bytes: int = 1 << 20        #: output kept per cell (a lab's biggest cell keeps ~200 KB: a figure)
    notebook_output_bytes: int = 8 << 20    #: output kept per notebook
    sandbox: bool = True           #: run the kernel under bubblewrap (see the module docstring)

    def __post_init__(self):
        if not (0 < self.cell_s and 0 < self.notebook_s and self.memory_bytes > 0 and self.nproc > 0
                and self.cell_output_bytes > 0 and self.notebook_output_bytes > 0):
            raise ValueError(f"limits must be positive: cell_s={self.cell_s}, notebook_s={self.notebook_s}, "
                             f"memory_bytes={self.memory_bytes}, nproc={self.nproc}, cell_output_bytes="
                             f"{self.cell_output_bytes}, notebook_output_bytes={self.notebook_output_bytes}")


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
    try:
        cmd = bwrap_args(probe) + ["--", sys.executable, "-c", "import os; print(os.getuid())"]
        try:
            got = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap could not start here ({exc}); grade with --no-sandbox"
        if got.returncode != 0 or got.stdout.strip() != "65534":
            why = (got.stderr.strip().splitlines() or ["no output"])[-1]
            return (f"bubblewrap cannot make its namespaces here ({why}): user namespaces may be off "
                    f"(sysctl kernel.unprivileged_userns_clone / user.max_user_namespaces); grade with --no-sandbox")
        return None
    finally:
        shutil.rmtree(probe, ignore_errors=True)


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


async def run_boxed(nb, scratch: Path, limits: Limits, lab: str = "") -> BoxedRun:
    """Execute ``nb`` (a NotebookNode, outputs filled in place) with cwd ``scratch``, for lab ``lab``; never raises
    for a failing notebook: ``BoxedRun.stopped`` says why it stopped early."""
    import nbformat       # here, not at the top: `python -m course_lib` reads Limits to build its parser
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    from course_lib.authoring.run import without_output_widget_mirror

    scratch = Path(scratch)
    tag = uuid.uuid4().hex
    out = BoxedRun(tag=tag, nonce=uuid.uuid4().hex, sandboxed=limits.sandbox)
    start = time.monotonic()
    deadline = start + limits.notebook_s

    def cell_timeout(cell) -> int:
        return max(1, int(min(limits.cell_s, deadline - time.monotonic())))

    sockets = scratch / ".sockets"
    sockets.mkdir(exist_ok=True)
    channel = GuardChannel(sockets / "guard", out)
    cgroup = f"course-grade-{tag}"
    cmd = [sys.executable, str(LIMITS_SCRIPT), "--as-bytes", str(limits.memory_bytes), "--pids", str(limits.nproc),
           "--cgroup", cgroup, "--"]
    if limits.sandbox:
        cmd += bwrap_args(scratch) + ["--"]
    # -c, not -m: the guard must be the module `course_lib.apps.grading.guard` that finish() is later asked of, not __main__
    cmd += [sys.executable, "-c", "import sys; from course_lib.apps.grading.guard import main; main(sys.argv[1:])",
            "--lab", lab, "--channel", str(sockets / "guard")]
    client_cls = capped_client(NotebookClient, limits, out)
    client = without_output_widget_mirror(client_cls(
        nb, kernel_manager_class=kernel_manager_class(limits, sockets, cmd), kernel_name="python3",
        timeout_func=cell_timeout, allow_errors=True, interrupt_on_timeout=True, record_timing=False,
        error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": "interrupted at the cell limit", "traceback": []},
        shutdown_kernel="immediate", resources={"metadata": {"path": str(scratch)}}))
    kernel_pid: list[int | None] = [None]

    log = open(sockets / "kernel.log", "wb")          # the kernel's own stdout/stderr (its banner, a crash)

    async def execute():
        async with client.async_setup_kernel(env=kernel_environment(scratch, tag, limits.sandbox), cwd=str(scratch),
                                             stdout=log, stderr=log):
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
                report = nbformat.v4.new_code_cell(      # the guard's integrity report, then the cell is dropped
                    f"__import__('course_lib.apps.grading.guard', fromlist=['finish']).finish({out.nonce!r})")
                client.nb.cells.append(report)
                try:
                    await client.async_execute_cell(report, len(client.nb.cells) - 1)
                finally:
                    client.nb.cells.pop()
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
    out.leftovers = end_processes(tag, kernel_pid[0]) + limits_script.remove_cgroup(cgroup)
    channel.close()
    log.close()
    out.seconds = time.monotonic() - start
    return out
