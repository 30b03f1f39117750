"""Suite-wide set-up that applies to solutions/ and labs/ as well as tests/.

1. **Two workers, and the tests that must run alone.** ``make test`` runs pytest with two
   ``pytest-xdist`` workers (``--dist loadfile``: a notebook's cells, or a test file, stay on one
   worker, in order). A multi-rank notebook leaves about a quarter of two cores idle (the kernel's
   single-threaded phases, rank round trips), which the other worker fills. A few tests must not share
   the machine: they time a slow rank against a 2 s deadline, count bytes on the machine-wide loopback
   interface, or drive a browser against timeouts. They carry ``@pytest.mark.serial`` and run *alone*:
   every item takes a shared lock, a serial item an exclusive one (two ``flock`` files, so a waiting
   serial item is never starved by the other worker's stream of shared ones). Without xdist the locks
   are not taken.
2. **Lab 06's two-node runs once.** labs/ runs every lab as learners receive it, outputs not compared;
   solutions/ runs the same cells with their outputs compared. The two-node runs of Lab 06 (two network
   namespaces, throttled link, ~30 s) are the same code in both, so they run once, in solutions/ (and in
   tests/test_netns.py): the labs/ kernels start with ``COURSE_LIB_TWO_NODE=0`` and take the lab's own
   "skipped" branch, which a learner without permission for namespaces also gets.
"""
import contextlib
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent / "labs"
_ORIGINAL = os.environ.get("COURSE_LIB_TWO_NODE")


class SerialLock:
    """``hold(alone=False)``: run beside other holders; ``hold(alone=True)``: run with no other holder.

    A turnstile lock and a room lock, both ``flock`` files shared by every worker. Everyone passes the
    turnstile (exclusive) to enter the room; a shared holder lets go of the turnstile once inside, an
    exclusive one keeps it until it leaves, so nobody new enters while it waits for the room to empty.
    """

    def __init__(self, base: Path):
        self._turnstile = open(f"{base}.turnstile", "a+")
        self._room = open(f"{base}.room", "a+")

    @contextlib.contextmanager
    def hold(self, alone: bool):
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._room, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)


_LOCK: SerialLock | None = None


def pytest_configure(config):
    global _LOCK
    if os.environ.get("PYTEST_XDIST_WORKER"):       # a worker of `pytest -n N`: share the machine politely
        tag = hashlib.sha1(str(config.rootpath).encode()).hexdigest()[:12]
        _LOCK = SerialLock(Path(tempfile.gettempdir()) / f"fsdp-course-tests-{os.getuid()}-{tag}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # tryfirst: outermost, so the wait for the lock is not counted by pytest-timeout's per-test limit.
    if _LOCK is None:
        return (yield)
    with _LOCK.hold(alone=item.get_closest_marker("serial") is not None):
        return (yield)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # tryfirst: before the notebook's kernel starts (nbval starts it in the first cell's setup), so the
    # kernel inherits the setting.
    if LABS in Path(str(item.path)).resolve().parents:
        os.environ["COURSE_LIB_TWO_NODE"] = "0"
    elif _ORIGINAL is None:
        os.environ.pop("COURSE_LIB_TWO_NODE", None)
    else:
        os.environ["COURSE_LIB_TWO_NODE"] = _ORIGINAL
