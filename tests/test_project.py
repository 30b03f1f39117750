"""Project files agree with each other: dependencies, the torch pin, README, CI, pytest/nbval config."""
from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from course_lib import authoring

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SMOKE = ROOT / "tests" / "fixtures" / "smoke" / "00_smoke.ipynb"


def _reqs(lines) -> dict[str, Requirement]:
    reqs = [Requirement(line) for line in lines]
    return {r.name.lower(): r for r in reqs}


def pyproject_deps() -> dict[str, Requirement]:
    project = PYPROJECT["project"]
    return _reqs(project["dependencies"] + project["optional-dependencies"]["test"])


def environment_deps() -> dict[str, Requirement]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    assert any(str(d).startswith("python=3.11") for d in env["dependencies"]), "python 3.11 expected"
    return _reqs(pip)


def makefile_torch() -> str:
    m = re.search(r"^TORCH_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert m, "Makefile must set TORCH_VERSION"
    return m.group(1)


def test_environment_yml_lists_the_same_packages_as_pyproject():
    py, env = pyproject_deps(), environment_deps()
    assert sorted(env) == sorted(py)
    for name, req in py.items():
        if name != "torch":
            assert env[name].specifier == req.specifier, f"{name}: {env[name]} vs {req}"


def test_torch_is_pinned_the_same_everywhere_and_inside_the_supported_range():
    pin = makefile_torch()
    assert str(environment_deps()["torch"].specifier) == f"=={pin}"
    assert '"torch==$(TORCH_VERSION)"' in (ROOT / "Makefile").read_text()
    assert Version(pin) in pyproject_deps()["torch"].specifier


def constraints() -> dict[str, Version]:
    """``{name: pinned version}`` from constraints.txt (the tested set)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt pins exact versions, not {line!r}"
            pins[req.name.lower()] = Version(spec.version)
    return pins


def test_constraints_pin_every_dependency_inside_pyproject_ranges_and_the_makefile_uses_them():
    pins = constraints()
    for name, req in pyproject_deps().items():
        assert name in pins, f"constraints.txt does not pin {name}: regenerate it with pip freeze"
        assert pins[name] in req.specifier, f"constraints.txt pins {name}=={pins[name]}, outside {req}"
    assert pins["torch"] == Version(makefile_torch())
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_makefile_keeps_its_targets():
    text = (ROOT / "Makefile").read_text()
    for target in ("lab", "test", "solutions", "labs", "doctor", "install", "bench", "clean"):
        assert re.search(rf"^{target}:", text, re.M), target
    assert "--ServerApp.ip=127.0.0.1" in text and "token=" not in text   # token auth stays on
    assert "scripts/system-deps.sh" in text


def test_readme_gives_the_two_commands():
    text = (ROOT / "README.md").read_text()
    for needle in ("make lab", "make test", "make solutions", "python -m course_lib doctor", "torchrun"):
        assert needle in text


def test_ci_run_is_executable_strict_and_calls_make_test():
    path = ROOT / ".ci" / "run"
    assert path.stat().st_mode & stat.S_IXUSR
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert re.search(r"^make test\b", text, re.M) or "make test ||" in text


def _fake_ci(tmp_path: Path, pytest_status: int, make_status: int) -> subprocess.CompletedProcess:
    """Run a copy of .ci/run with a fake `make` that pretends pytest exited with ``pytest_status``."""
    (tmp_path / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "make").write_text(f"#!/bin/sh\necho {pytest_status} > test-artifacts/pytest-exit-status\n"
                               f"exit {make_status}\n")
    (bin_ / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}"}
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True)


def test_ci_run_turns_no_tests_collected_into_a_failure(tmp_path):
    result = _fake_ci(tmp_path, pytest_status=5, make_status=2)
    assert result.returncode == 1 and "collected no tests" in result.stderr


def test_ci_run_passes_success_and_failure_through(tmp_path):
    assert _fake_ci(tmp_path / "a", 0, 0).returncode == 0
    assert _fake_ci(tmp_path / "b", 1, 2).returncode == 2


def test_system_deps_script_is_noninteractive_and_idempotent():
    path = ROOT / "scripts" / "system-deps.sh"
    assert path.stat().st_mode & stat.S_IXUSR
    text = path.read_text()
    assert "DEBIAN_FRONTEND=noninteractive" in text and "apt-get install -y" in text
    assert "--no-install-recommends" in text     # a desktop's worth of recommends: ~20 s more of dpkg
    assert text.count("apt-get update") == 1 and "[[ -x /usr/bin/chromium ]]" in text
    # another apt holding the dpkg lock is waited for (apt's own option), on both apt-get calls, not a failure
    assert text.count('"${lock_wait[@]}"') == 2 and 'lock_wait=(-o "DPkg::Lock::Timeout=' in text


def test_sanitize_file_masks_what_varies_and_keeps_what_is_compared():
    from nbval.plugin import get_sanitize_patterns
    patterns = get_sanitize_patterns((ROOT / "tests" / "nbval_sanitize.cfg").read_text())

    def clean(s: str) -> str:
        for regex, replace in patterns:
            s = re.sub(regex, replace, s)
        return s
    varying = [  # (one run, another run): equal once sanitized
        ("step took 1.23 s.", "step took 0.9 s."), ("all-gather 123 ms", "all-gather 7 ms"),
        ("at 0x7f3a2c1b4e50", "at 0x55d0c0ffee00"), ("saved /tmp/tmpab12cd/ckpt, ok", "saved /tmp/x9/ckpt, ok"),
        ("MASTER_PORT=29517", "MASTER_PORT=41000"), ("127.0.0.1:41235", "127.0.0.1:8888"),
        (" 50%|#####     | 5/10 [00:01<00:01,  4.99it/s]", "100%|##########| 10/10 [00:02<00:00,  5.01it/s]"),
        ("2026-11-21T05:02:33", "2027-01-02T23:59:59"), ("3.2 GB/s", "12.75 GB/s"),
        ("course_lib runtime: backend=gloo ranks=4 torch=2.13.0+cpu", "course_lib runtime: backend=nccl ranks=8 torch=2.11.0 gpus=8"),
    ]
    for a, b in varying:
        assert clean(a) == clean(b), (a, clean(a), b, clean(b))
    kept = "loss 2.3456 after 3 steps; 16 MiB moved; shape (4, 8); 768 bytes; 4 shards"
    assert clean(kept) == kept


def test_pytest_runs_nbval_on_solutions_and_labs_with_sanitizing():
    opts = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert opts["testpaths"] == ["tests", "solutions", "labs"]
    for flag in ("--nbval ", "--nbval-current-env", "--nbval-cell-timeout=300",
                 "--nbval-sanitize-with=tests/nbval_sanitize.cfg"):
        assert flag in opts["addopts"] + " "
    assert opts["timeout"] > 300 and "fixtures" in opts["norecursedirs"]


def test_nbval_config_compares_a_solution_and_runs_its_lab(tmp_path):
    """The project's own pytest configuration on the smoke solution (outputs compared, after
    sanitizing an address and a timing) and on its lab (stubs: runs, nothing compared)."""
    shutil.copy(SMOKE, tmp_path / SMOKE.name)
    (tmp_path / "labs").mkdir()
    (tmp_path / "labs" / SMOKE.name).write_text(authoring.lab_text(SMOKE))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
         str(tmp_path / SMOKE.name), str(tmp_path / "labs" / SMOKE.name)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        # not one of this run's xdist workers: it would take their serial lock, and wait for a serial item that
        # waits for the test holding the lock (this one)
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.search(r"\b10 passed\b", result.stdout), result.stdout[-2000:]


def _root_conftest():
    import importlib.util
    spec = importlib.util.spec_from_file_location("root_conftest_lock", ROOT / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return conftest


def test_notebook_kernels_skip_the_two_node_runs_that_test_netns_runs(monkeypatch):
    """The root conftest turns Lab 06's two-node runs off for notebook items (tests/test_netns.py runs
    them, with assertions), and puts the caller's setting back for every other item."""
    from types import SimpleNamespace
    conftest = _root_conftest()
    monkeypatch.delenv("COURSE_LIB_TWO_NODE", raising=False)
    for where in ("labs", "solutions"):
        conftest.pytest_runtest_setup(SimpleNamespace(path=ROOT / where / "06_hybrid_sharding.ipynb"))
        assert os.environ["COURSE_LIB_TWO_NODE"] == "0"
    conftest.pytest_runtest_setup(SimpleNamespace(path=ROOT / "tests" / "test_netns.py"))
    assert "COURSE_LIB_TWO_NODE" not in os.environ


def test_a_serial_item_runs_alone_and_is_not_starved(tmp_path):
    """The lock `make test`'s two workers share: a serial holder waits for the shared holders to leave,
    and while it waits, no new shared holder gets in ahead of it."""
    import threading
    lock = _root_conftest().SerialLock
    base = tmp_path / "lock"
    order, release = [], {k: threading.Event() for k in ("first", "serial", "late")}

    def holder(name, alone, started):
        with lock(base).hold(alone=alone):      # a lock per holder: flock is per open file, as per worker
            order.append(name)
            started.set()
            release[name].wait(10)

    started = {k: threading.Event() for k in release}
    threads = {"first": threading.Thread(target=holder, args=("first", False, started["first"]))}
    threads["first"].start()
    assert started["first"].wait(5)
    threads["serial"] = threading.Thread(target=holder, args=("serial", True, started["serial"]))
    threads["serial"].start()
    assert not started["serial"].wait(0.3), "the serial holder ran beside a shared one"
    threads["late"] = threading.Thread(target=holder, args=("late", False, started["late"]))
    threads["late"].start()
    assert not started["late"].wait(0.3), "a new shared holder got in while a serial one was waiting"
    release["first"].set()
    assert started["serial"].wait(5)
    assert not started["late"].wait(0.3), "a shared holder ran beside the serial one"
    release["serial"].set()
    assert started["late"].wait(5)
    release["late"].set()
    for t in threads.values():
        t.join(5)
    assert order == ["first", "serial", "late"]


def test_make_test_runs_two_workers_and_the_timing_tests_alone(monkeypatch, tmp_path):
    from types import SimpleNamespace
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^TEST_WORKERS \?= 2$", text, re.M)
    assert "-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder" in text
    assert "pytest-xdist" in " ".join(PYPROJECT["project"]["optional-dependencies"]["test"])
    for name in ("test_launch_faults.py", "test_wire.py"):
        assert re.search(r"^pytestmark = pytest.mark.serial$", (ROOT / "tests" / name).read_text(), re.M), name
    launch_tests = re.findall(r"^(@serial\n)?def (test_\w+)", (ROOT / "tests" / "test_launch.py").read_text(), re.M)
    beside = [name for mark, name in launch_tests if not mark]
    assert len(launch_tests) > 5 and beside == [], beside
    flakes = (ROOT / "tests" / "test_launch_flakes.py").read_text()      # a flake count: welcome beside the other
    assert "def test_fifty_fresh_launches_in_a_row_no_flakes" in flakes and "serial" not in flakes.split('"""')[2]
    import nbformat
    conftest = _root_conftest()
    lab00 = nbformat.read(ROOT / "solutions" / "00_collectives.ipynb", as_version=4)
    alone = [c.source.split("(")[0] for c in lab00.cells if c.cell_type == "code" and conftest.runs_alone(
        SimpleNamespace(cell=c, get_closest_marker=lambda name: None))]
    assert alone == ["measured = wire.measure_wire"]   # counts loopback bytes: nbval compares the next cell's verdict
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    conftest.pytest_configure(SimpleNamespace(rootpath=tmp_path))
    assert conftest._LOCK is None                 # one process: no lock to take
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    config = SimpleNamespace(rootpath=tmp_path)
    conftest.pytest_configure(config)
    assert isinstance(conftest._LOCK, conftest.SerialLock)
    for suffix in (".turnstile", ".room"):        # this test's own pair of lock files, not the run's: remove them
        Path(f"{conftest._lock_base(config)}{suffix}").unlink()


def test_files_are_handed_out_longest_first_each_in_its_own_order(monkeypatch):
    from types import SimpleNamespace
    conftest = _root_conftest()

    def item(path, slow=False):
        return SimpleNamespace(path=Path(path), name=f"{path}#{id(object())}",
                               get_closest_marker=lambda name: object() if (slow and name == "slow") else None)
    items = ([item("tests/test_small.py") for _ in range(3)]
             + [item("tests/test_slow.py"), item("tests/test_slow.py", True)]
             + [item("labs/06.ipynb") for _ in range(4)])
    before = list(items)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    conftest.pytest_collection_modifyitems(None, items)
    assert items == before                         # one process: pytest's own order
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_collection_modifyitems(None, items)
    assert items == before[3:5] + before[5:] + before[:3]    # 20.3 s, then 8 s, then 0.9 s
