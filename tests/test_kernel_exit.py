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


def _started(code: str) -> tuple[KernelManager, list[int]]:
    km = KernelManager(kernel_name="python3", shutdown_wait_time=PATIENCE_S)
    km.start_kernel(cwd=str(ROOT))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        out = []
        reply = kc.execute_interactive(code + "\nimport os, psutil\nprint('CHILDREN', [c.pid for c in "
                                       "psutil.Process().children(recursive=True)])", timeout=120,
                                       output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        kc.stop_channels()
    line = next(l for l in "".join(out).splitlines() if l.startswith("CHILDREN"))
    return km, [int(p) for p in line.split("[", 1)[1].rstrip("]").split(",") if p.strip()]


def _shut_down(km: KernelManager) -> float:
    t0 = time.monotonic()
    km.shutdown_kernel(now=False)
    return time.monotonic() - t0


@pytest.mark.parametrize("restart", [False, True], ids=["shutdown", "restart"])
def test_a_kernel_that_ran_ranks_leaves_at_once_and_takes_them_along(restart):
    km, children = _started("import course_lib\nprint(course_lib.run(lambda: 1, world_size=2))")
    # the fork server, the resource tracker (which ignores SIGTERM) and the two warm ranks
    assert len(children) >= 4, children
    pid = km.provisioner.pid
    if restart:
        t0 = time.monotonic()
        km.restart_kernel(now=False)
        took = time.monotonic() - t0
        km.shutdown_kernel(now=True)
    else:
        took = _shut_down(km)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    left = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"processes {left} outlived their kernel"
    # it left by itself: the manager would have waited PATIENCE_S / 2 = 10 s before terminating it
    assert took < PATIENCE_S / 4, f"{'restart' if restart else 'shutdown'} took {took:.1f} s"


def test_outside_a_kernel_nothing_is_installed():
    """pytest's process (IPython may be imported, but there is no kernel): nothing to wrap."""
    assert kernel_exit.install(lambda: None) is False
