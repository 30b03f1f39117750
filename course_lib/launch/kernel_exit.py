"""A Jupyter kernel that ran ranks shuts down, or restarts, at once instead of 2.5 s later.

When a kernel is asked to shut down or restart, ipykernel sends SIGTERM to every child process left in its process
group and waits for them to go before it exits (``Kernel._at_shutdown``). A kernel that called
:func:`course_lib.run` has such children: the fork servers the ranks come from (:mod:`.forkserver`), and
multiprocessing's resource tracker, which ignores SIGTERM. So the kernel never left by itself: its manager (JupyterLab's, nbclient's) waited
half of its ``shutdown_wait_time``, then terminated it. Measured on the course machine: 2.6 s per shutdown with
them left, 0.1 s with both stopped first -- once per "Restart kernel", and once per headless run of a lab that
shuts its kernel down politely (``run-solutions``, nbgrader, the wrong-answer runs; nbval and the grader kill theirs).

:func:`install` wraps the kernel's ``do_shutdown`` (the first thing ipykernel calls for a shutdown or restart
request) so that the warm ranks, then the fork servers, then the resource tracker are stopped before ipykernel
looks for children. Each of those leaves once the pipe it waits on closes: the ranks' holders go first, since
the fork servers and the tracker leave only when no process holds their pipe any more. Outside a kernel (a
script, a rank, a test) it does nothing; the processes then end with the interpreter, as before.
"""
from __future__ import annotations

import sys
from typing import Callable


def install(stop_pools: Callable[[], object]) -> bool:
    """In an IPython kernel, stop ``stop_pools()``'s ranks, the fork server and the resource tracker when the kernel
    is asked to shut down or restart. Returns whether it is (now or already) installed; idempotent."""
    if "IPython" not in sys.modules:              # a script or a rank: never import IPython
        return False
    from IPython import get_ipython
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:                           # a terminal IPython: it exits with its interpreter
        return False
    if getattr(kernel.do_shutdown, "_course_lib", False):
        return True
    original = kernel.do_shutdown

    def do_shutdown(restart):
        try:
            stop_pools()
            stop_helpers()
        except Exception:  # noqa: BLE001 - never stand in the way of a shutdown: the old 2.5 s wait is the worst case
            pass
        return original(restart)
    do_shutdown._course_lib = True
    kernel.do_shutdown = do_shutdown
    return True


def stop_helpers() -> None:
    """Stop the fork servers (:func:`.forkserver.stop_all`: the torch and the jax one, and multiprocessing's own),
    then the resource tracker, if this process started them, and reap them.

    ``_stop()`` is CPython's own way to do it (3.8+; its tests use it): close the pipe the helper watches, then
    wait for the helper to exit. The fork servers go first: they hold the tracker's pipe too."""
    from multiprocessing import forkserver as mp_forkserver, resource_tracker
    from course_lib.launch import forkserver
    forkserver.stop_all()
    for helper in (mp_forkserver._forkserver, resource_tracker._resource_tracker):
        stop = getattr(helper, "_stop", None)
        if stop is not None:
            stop()
