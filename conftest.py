"""Suite-wide set-up that applies to solutions/ and labs/ as well as tests/.

1. **Two workers, and the tests that must run alone.** ``make test`` runs pytest with two
   ``pytest-xdist`` workers (``--dist loadfile``: a notebook's cells, or a test file, stay on one
   worker, in order). A multi-rank notebook leaves about a quarter of two cores idle (the kernel's
   single-threaded phases, rank round trips), which the other worker fills. A few tests must not share
   the machine: they time a slow rank against a 2 s deadline or count bytes on the machine-wide
   loopback interface. They carry ``@pytest.mark.serial`` (a notebook cell: the tag ``serial``, as
   Lab 00's loopback measurement) and run *alone*:
   every item takes a shared lock, a serial item an exclusive one (two ``flock`` files, so a waiting
   serial item is never starved by the other worker's stream of shared ones), kept across the serial items
   that follow it in its file (the wait for the other worker's item to end is paid once). Without xdist the locks
   are not taken. The files are handed out longest first (a rough guess from the markers), so the
   run does not end on one long file, and the files with serial items last: each serial stretch first
   waits for the other worker's item in progress to end, and at the end of the run those are the unit
   tests' fractions of a second, not a 40 s notebook or capstone run (measured: 80 s of waiting when they
   came mid-run).
2. **Lab 06's two-node runs once, in tests/test_netns.py.** The two-node cells of Lab 06 (two network
   namespaces, a throttled link, two torchrun agents, two ``jax.distributed`` processes: ~27 s) print
   timings, so nbval cannot compare them; tests/test_netns.py runs the same functions and asserts what
   the cells show (the bytes on the cable against the formula, the report, the traffic widget) and more.
   So every notebook kernel under pytest starts with ``COURSE_LIB_TWO_NODE=0`` and takes the lab's own
   "skipped" branch, which a learner without permission for namespaces also gets.
3. **The notebooks measure less.** Every notebook kernel under pytest starts with ``COURSE_LIB_QUICK=1``: Lab 08's
   benchmarks (:mod:`course_lib.bench.step_time`) time 3 windows and 4 steps instead of 9 and 10-15 -- the same
   code, noisier numbers. Those cells' outputs are timings, tagged ``nbval-ignore-output`` in the solution and not
   compared at all in labs/ (which runs to show every cell works with the exercises' stubs in place), so the
   full count bought nothing a test reads (measured: solutions/08 alone in 28.0 s and 41 CPU-s instead of 41.7 s
   and 64 CPU-s). ``make solutions`` (``python -m course_lib run-solutions``) measures in full, and
   ``tests/test_step_time.py`` checks the two counts.
4. **One JAX compilation cache for the whole run.** The same programs are compiled again and again in
   separate processes: a lab's solution and its wrong-answer run, the JAX capstone's reference, killed and
   resumed runs. JAX's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``, a documented JAX option)
   in one fresh folder per run, which every worker, kernel and subprocess inherits, makes the second compile a
   read (measured: Lab 05 in 9.4 s instead of 12.0 s, a capstone process 3.3 instead of 4.3 CPU-s). The
   programs and their results are the same; the folder goes when the run ends. Set it yourself to keep one.
"""
import contextlib
import fcntl
import gc
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_ORIGINAL = os.environ.get("COURSE_LIB_TWO_NODE")
_ORIGINAL_QUICK = os.environ.get("COURSE_LIB_QUICK")

# Here, at import: before any conftest or test module imports JAX, which reads its options once. The controller
# of `pytest -n N` (or a plain pytest) makes the folder; the workers it starts later inherit the variable.
_JAX_CACHE_MADE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and not os.environ.get("PYTEST_XDIST_WORKER"):
    _JAX_CACHE_MADE = tempfile.mkdtemp(prefix="fsdp-course-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE_MADE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")   # the labs' programs compile fast


class SerialLock:
    """``hold(alone=False)``: run beside other holders; ``hold(alone=True)``: run with no other holder.

    A turnstile lock and a room lock, both ``flock`` files shared by every worker. Everyone passes the
    turnstile (exclusive) to enter the room; a shared holder lets go of the turnstile once inside, an
    exclusive one keeps it until it leaves, so nobody new enters while it waits for the room to empty.
    """

    def __init__(self, base: Path):
        self._turnstile = open(f"{base}.turnstile", "a+")
        self._room = open(f"{base}.room", "a+")

    def enter(self, alone: bool) -> None:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def leave(self, alone: bool) -> None:
        fcntl.flock(self._room, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def hold(self, alone: bool):
        self.enter(alone)
        try:
            yield
        finally:
            self.leave(alone)


_LOCK: SerialLock | None = None


def _lock_base(config) -> Path:
    """The lock files' path without suffix: one pair per checkout, shared by the workers of a run."""
    tag = hashlib.sha1(str(config.rootpath).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"fsdp-course-tests-{os.getuid()}-{tag}"


def pytest_configure(config):
    global _LOCK
    if os.environ.get("PYTEST_XDIST_WORKER"):       # a worker of `pytest -n N`: share the machine politely
        _LOCK = SerialLock(_lock_base(config))


def pytest_collection_finish(session):
    # Collection imported torch, JAX, nbformat and every test module: millions of objects that live until the
    # end. Frozen (gc.freeze, as course_lib.runtime.imports does), the collections of the next ten minutes skip
    # them instead of walking them all each time.
    gc.freeze()


def pytest_unconfigure(config):
    if _JAX_CACHE_MADE is not None:
        shutil.rmtree(_JAX_CACHE_MADE, ignore_errors=True)
    if not os.environ.get("PYTEST_XDIST_WORKER") and getattr(config.option, "numprocesses", None):
        for suffix in (".turnstile", ".room"):     # the controller, after its workers: the lock files go too
            Path(f"{_lock_base(config)}{suffix}").unlink(missing_ok=True)


def runs_alone(item) -> bool:
    """A test marked ``serial``, or a notebook cell tagged ``serial`` (nbval's item keeps its cell)."""
    cell = getattr(item, "cell", None)
    tags = cell.metadata.get("tags", []) if cell is not None else []
    return item.get_closest_marker("serial") is not None or "serial" in tags


def _cost(item) -> float:
    """A rough guess of an item's seconds on 2 cores: a notebook cell ~2, a test marked slow ~20."""
    if item.path.suffix == ".ipynb":
        return 2.0
    return 20.0 if item.get_closest_marker("slow") else 0.3


def pytest_collection_modifyitems(config, items):
    # Under xdist (Makefile: --no-loadscope-reorder) files are handed to the workers in collection order:
    # the longest first, so the run does not end with one worker on a 40 s file while the other idles, and
    # the files with serial items last (the module docstring says why). Each file keeps its own order; the
    # sort is stable, so both workers collect the same order.
    _mark_last_cells_of_labs(items)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(str(item.path), []).append(item)
    order = sorted(files.values(), key=lambda g: (any(map(runs_alone, g)), -sum(map(_cost, g))))
    items[:] = [i for group in order for i in group]


def _is_lab(item) -> bool:
    """A cell of one of this course's labs/ notebooks (not a copy elsewhere, as tests/test_project.py's smoke lab)."""
    root = getattr(getattr(item, "config", None), "rootpath", None)
    return root is not None and item.path.suffix == ".ipynb" and item.path.parent == root / "labs"


def _mark_last_cells_of_labs(items) -> None:
    last = {}
    for item in items:
        if _is_lab(item):
            last[item.path] = item
    for item in last.values():
        item.last_of_lab = True


#: 5. **A lab as received credits no prediction and keeps its stated run time.** In each labs/ notebook nbval runs
#: (untouched), a cell whose output scores a prediction ("🎯 ...: you predicted ...") fails: a prediction is the
#: learner's or absent, never the lab's own number or a reference fallback's. And the notebook's seconds (its cells'
#: setup, call and teardown: the kernel's start included) are compared with the time its first cell states when
#: its last cell ends (course_lib/authoring/lab_time.py says how, and with what margin); that cell fails only when the lab
#: ran far slower than stated, never when it ran faster (a fast machine is not a bug).
_LAB_SECONDS: dict[Path, float] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _is_lab(item):
        _LAB_SECONDS[item.path] = _LAB_SECONDS.get(item.path, 0.0) + call.duration
        shown = "".join(str(o.get("text", "")) for o in (getattr(item, "test_outputs", None) or []))
        if call.when == "call" and report.passed and "you predicted" in shown:
            report.outcome = "failed"
            report.longrepr = (f"{item.path.name}, untouched, scored a prediction nobody wrote:\n"
                               + "\n".join(line for line in shown.splitlines() if "you predicted" in line))
        if call.when == "call" and getattr(item, "last_of_lab", False) and report.passed:
            from course_lib.authoring import lab_time
            why = lab_time.problem(item.path, _LAB_SECONDS[item.path])   # an upper bound only, with a wide margin
            if why:
                report.outcome, report.longrepr = "failed", why
    return report


_ALONE = False     #: this worker holds the room alone, from a serial item to the last of the serial items after it


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # tryfirst: outermost, so the wait for the lock is not counted by pytest-timeout's per-test limit.
    # Serial items in a row (a file of them) hold the room once: each wait for it is a wait for the other
    # worker's item in progress to end (a notebook cell, or a 40 s test), and it is paid once, not per item.
    global _ALONE
    if _LOCK is None:
        return (yield)
    if not runs_alone(item):
        with _LOCK.hold(alone=False):
            return (yield)
    if not _ALONE:
        _LOCK.enter(alone=True)
        _ALONE = True
    try:
        return (yield)
    finally:
        if nextitem is None or not runs_alone(nextitem):
            _LOCK.leave(alone=True)
            _ALONE = False


def _set(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # tryfirst: before the notebook's kernel starts (nbval starts it in the first cell's setup), so the
    # kernel inherits the settings; every other item gets the ones the run started with.
    notebook = item.path.suffix == ".ipynb"
    _set("COURSE_LIB_TWO_NODE", "0" if notebook else _ORIGINAL)
    _set("COURSE_LIB_QUICK", "1" if notebook else _ORIGINAL_QUICK)   # timings nbval never compares: time fewer


#: labs/ notebooks that nbval does not collect: tests/test_labs_wrong_answers.py runs each of them top to bottom
#: as shipped, exercise cells aside (a wrong answer there, and the fallback a stub would take too), so a second,
#: plain run would repeat ~200 s of the suite. labs/07 and 08 have no whole-lab wrong-answer run: nbval runs them.
LABS_RUN_ELSEWHERE = tuple(f"{n:02d}_" for n in (*range(7), 9, 10))


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".ipynb" and collection_path.parent.name == "labs" \
            and collection_path.parent.parent == config.rootpath \
            and collection_path.name.startswith(LABS_RUN_ELSEWHERE):
        return True
    return None
