"""What the fork server imports, in two stages, so the first ranks start fast and later ones start warm.

The fork server (see :mod:`course_lib.launch.pool`) imports this module instead of a plain list. Stage one,
now: what a rank needs to rendezvous and run its first collective (torch, torch.distributed, the ledger).
Stage two, on a background thread once the server has been idle for a moment: the rest of
``COURSE_LIB_PRELOAD`` (FSDP2, DTensor, dynamo, the course's models -- about 1.5 s of imports on this
machine), so the ranks forked after it (a fresh pool, a pool of another size) find them imported.

Measured on the 2-core course machine: the full list before the first fork put ~1.5 s into every kernel's
first call (cold start 3.5 s); two stages bring it to the cost of importing torch alone.

Forking while another thread imports would be unsafe (the child could inherit a held import lock), so
``os.fork`` is wrapped: a fork waits for the module being imported to finish, and the importer waits until
no fork came for ``_QUIET_S`` seconds (a pool forks its ranks in a burst) before it starts the next module.
A rank forked before stage two finished imports what it needs itself, as any Python program would.
"""
from __future__ import annotations

import importlib
import os
import threading
import time

#: stage one: enough for rendezvous and a first all-reduce
FIRST = ("torch", "torch.distributed", "cloudpickle", "course_lib.comm.torch_ledger")
_QUIET_S = 0.3  # no fork for this long: the pool has all its ranks

_lock = threading.Lock()
_last_fork = [time.monotonic()]
_real_fork = os.fork


def _fork():
    with _lock:  # never while the importer thread is inside an import
        pid = _real_fork()
    if pid:
        _last_fork[0] = time.monotonic()
    return pid


def _import_rest(names):
    for name in names:
        while time.monotonic() - _last_fork[0] < _QUIET_S:
            time.sleep(_QUIET_S / 3)
        with _lock:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # as multiprocessing's own preload does; a rank that needs it gets the real error


def start(rest) -> threading.Thread | None:
    """Stage one now; stage two (``rest``) on a daemon thread. Called in the fork server only."""
    for name in FIRST:
        importlib.import_module(name)
    rest = [n for n in rest if n not in FIRST]
    if not rest:
        return None
    os.fork = _fork
    _last_fork[0] = time.monotonic()  # the pool's fork requests are usually queued already: serve them first
    t = threading.Thread(target=_import_rest, args=(rest,), name="course_lib-preload", daemon=True)
    t.start()
    # The server leaves when the notebook does (its main loop notices only between requests, and an interpreter
    # exit beside a thread that is mid-import can stall): its ranks then die with it (PR_SET_PDEATHSIG).
    threading.Thread(target=_leave_with_parent, args=(os.getppid(),), name="course_lib-orphan-watch",
                     daemon=True).start()
    return t


def _leave_with_parent(ppid: int):
    while os.getppid() == ppid:
        time.sleep(0.1)
    os._exit(0)


if os.environ.get("COURSE_LIB_PRELOAD_REST") is not None:  # set by pool._context: the fork server imports us
    start([n for n in os.environ.pop("COURSE_LIB_PRELOAD_REST").split(",") if n])
