"""A Jupyter kernel that ran ranks shuts down by itself, at once, and leaves no process behind
(course_lib.launch.kernel_exit): a real kernel through jupyter_client, as JupyterLab and nbclient drive one."""
from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from jupyter_client.manager import KernelManager

from course_lib.launch import kernel_exit

ROOT = Path(__file__).resolve().parents[1]
#: the manager's patience: it waits half of this for the kernel to leave, then terminates it. Before the fix every
#: kernel that had run ranks waited that out (2.5 s with the default 5 s); 20 s makes the difference unmistakable.
PATIENCE_S = 20.0

pytestmark = pytest.mark.timeout(180)


RANKS = "import course_lib\nprint(course_lib.run(lambda: 1, world_size=2))"
CHILDREN = "\nimport psutil\nprint('CHILDREN', [c.pid for c in psutil.Process().children(recursive=True)])"


_last_output = [""]   # what the latest _children_after cell printed


def _children_after(km: KernelManager, code: str) -> list[int]:
    """Run ``code`` in the kernel; the pids of the kernel's child processes after it."""
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        out = []
        reply = kc.execute_interactive(code + CHILDREN, timeout=120,
                                       output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
    _last_output[0] = "".join(out)
    line = next(l for l in "".join(out).splitlines() if l.startswith("CHILDREN"))
    return [int(p) for p in line.split("[", 1)[1].rstrip("]").split(",") if p.strip()]


def _gone(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie has stopped: its parent just has not reaped it yet)."""
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _timed(action) -> float:
    t0 = time.monotonic()
    action()
    return time.monotonic() - t0


def test_a_kernel_that_ran_ranks_restarts_and_shuts_down_at_once_and_takes_them_along():
    km = KernelManager(kernel_name="python3", shutdown_wait_time=PATIENCE_S)
    km.start_kernel(cwd=str(ROOT))
    try:
        for what in ("restart", "shutdown"):
            children = _children_after(km, RANKS)
            assert len(children) >= 4, children      # the fork server, the resource tracker, the two warm ranks
            pid = km.provisioner.pid
            took = _timed(lambda: km.restart_kernel(now=False) if what == "restart" else km.shutdown_kernel(now=False))
            assert _gone([pid]) == [], f"the kernel outlived its {what}"
            assert _gone(children) == [], f"processes {_gone(children)} outlived their kernel's {what}"
            # it left by itself: the manager would have waited PATIENCE_S / 2 = 10 s before terminating it
            assert took < PATIENCE_S / 4, f"{what} took {took:.1f} s"
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def test_outside_a_kernel_nothing_is_installed():
    """pytest's process (IPython may be imported, but there is no kernel): nothing to wrap."""
    assert kernel_exit.install(lambda: None) is False


def _servers(pids: list[int]) -> list[int]:
    """The fork servers among ``pids`` (their ranks, forks of them, share their command line)."""
    forks = {p for p in pids if psutil.pid_exists(p) and "forkserver" in " ".join(psutil.Process(p).cmdline())}
    return [p for p in forks if psutil.Process(p).ppid() not in forks]


def test_a_kernel_with_the_torch_and_the_jax_server_leaves_nothing_behind():
    """(Issue 52 item 3.) The torch server (started at ``import course_lib``, replaced after that cell) and the jax
    server (started when the kernel imports JAX), with ranks from each: a shutdown stops them all, at once."""
    km = KernelManager(kernel_name="python3", shutdown_wait_time=PATIENCE_S)
    km.start_kernel(cwd=str(ROOT))
    try:
        _children_after(km, RANKS)     # torch alone preloaded (the cell calls run), replaced by the full list after it
        children = _children_after(km, "import jax.numpy as jnp, os\nfrom course_lib.launch import forkserver as fs\n"
                                       "print(course_lib.run(lambda: (float(jnp.ones(2).sum()), os.getppid()), "
                                       "world_size=3) == [(2.0, fs._SERVERS['jax'].pid)] * 3, sorted(fs._SERVERS), "
                                       "[(s.kind, s.used, s.pid is None) for s in fs._RETIRED])")
        out = _last_output[0]
        # the JAX ranks came from the jax server; the torch servers: the early one (its ranks live), and the full one
        # started after the first cell, stopped when JAX was imported (no rank came from it)
        assert "True ['jax'] [('torch', True, False), ('torch', False, True)]" in out, out
        assert len(_servers(children)) == 2, children     # the early torch server and the jax server
        assert len(children) >= 2 + 2 + 3, children       # ... the resource tracker, two torch ranks, three JAX ranks
        pid = km.provisioner.pid
        took = _timed(lambda: km.shutdown_kernel(now=False))
        assert _gone([pid]) == [] and _gone(children) == [], _gone([pid] + children)
        assert took < PATIENCE_S / 4, f"shutdown took {took:.1f} s"
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)


def test_a_first_cell_that_imports_jax_starts_the_jax_server_alone_and_torch_calls_run_there():
    """Every lab's first cell imports course_lib and JAX: one server starts, the jax one, with the full list (the cell
    does not call run); a torch call then runs on its ranks; nothing is left after the shutdown."""
    km = KernelManager(kernel_name="python3", shutdown_wait_time=PATIENCE_S)
    km.start_kernel(cwd=str(ROOT))
    try:
        _children_after(km, "import course_lib\nimport jax")
        children = _children_after(km, "import os\nfrom course_lib.launch import forkserver as fs\n"
                                       "print(sorted(fs._SERVERS), fs._RETIRED, fs._SERVERS['jax'].modules == "
                                       "fs.modules_for('jax'), course_lib.run(os.getppid, world_size=2) == "
                                       "[fs._SERVERS['jax'].pid] * 2)")
        assert "['jax'] [] True True" in _last_output[0], _last_output[0]
        assert len(_servers(children)) == 1, children
        km.shutdown_kernel(now=False)
        assert _gone(children) == [], _gone(children)
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
