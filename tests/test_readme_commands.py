"""Every command a user is told to type is run by some test.

``documented()`` reads README.md and the markdown of solutions/*.ipynb and collects each ``make TARGET`` (a
real Makefile target) and each ``python -m course_lib ...`` verb or script (``torchrun ... -m course_lib.X``
counts as ``python -m course_lib.X``; ``bench WHAT`` means every benchmark). :data:`RUNS` says which test
runs each one; ``test_every_documented_command_is_run_by_a_named_test`` fails when the docs name a command
that is not in the table, or when the named test does not exist or never mentions the command. The rest of
this file holds the quick runs no other test did: the tiniest size of each benchmark, ``make`` targets in a
scratch copy of the checkout, the capstone scripts' ``--help`` and a two-step run.

``make lab``, ``make test`` and ``make install`` are only dry-run here (``make -n``): the first starts a
server, the second is this suite, the third installs packages.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course_lib.apps import cli

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
HERE = "tests/test_readme_commands.py::"
# `make` without reinstalling: the stamp that stands for "installed" is taken as up to date, and the
# interpreter running the tests is the one the recipes use
MAKE = ["make", "-o", ".venv/.installed", f"PY={PY}"]

#: command as the docs write it -> (the test that runs it, a word that test's source must contain)
RUNS = {
    "make lab": (HERE + "test_make_lab_test_install_recipes_dry_run", '"lab"'),
    "make test": (HERE + "test_make_lab_test_install_recipes_dry_run", '"test"'),
    "make install": (HERE + "test_make_lab_test_install_recipes_dry_run", '"install"'),
    "make labs": (HERE + "test_make_labs_solutions_clean_in_a_scratch_checkout", '"labs"'),
    "make solutions": (HERE + "test_make_labs_solutions_clean_in_a_scratch_checkout", '"solutions"'),
    "make clean": (HERE + "test_make_labs_solutions_clean_in_a_scratch_checkout", '"clean"'),
    "make doctor": (HERE + "test_make_doctor_and_make_bench_launch", '"doctor"'),
    "make bench": (HERE + "test_make_doctor_and_make_bench_launch", '"bench"'),
    "python -m course_lib": ("tests/test_authoring.py::test_help_lists_every_subcommand", '"--help"'),
    "python -m course_lib doctor": (HERE + "test_make_doctor_and_make_bench_launch", '"doctor"'),
    "python -m course_lib make-labs": (HERE + "test_make_labs_solutions_clean_in_a_scratch_checkout", '"make-labs"'),
    "python -m course_lib validate": (HERE + "test_make_labs_solutions_clean_in_a_scratch_checkout", "# validate"),
    "python -m course_lib run-solutions": (HERE + "test_make_labs_solutions_clean_in_a_scratch_checkout", "# run-solutions"),
    "python -m course_lib bench launch": (HERE + "test_make_doctor_and_make_bench_launch", "WHAT=launch"),
    "python -m course_lib bench fsdp": (HERE + "test_bench_fsdp_tiniest", '"fsdp"'),
    "python -m course_lib bench step-time": (HERE + "test_bench_step_time_tiniest", '"step-time"'),
    "python -m course_lib bench timeline": (HERE + "test_bench_timeline_tiniest", '"timeline"'),
    "python -m course_lib bench labs": (HERE + "test_bench_labs_tiniest", '"labs"'),
    "python -m course_lib.bench.host": (HERE + "test_bench_host_calibrates", "course_lib.bench.host"),
    "python -m course_lib bench two-node": ("tests/test_netns.py::test_torchrun_two_agents_fsdp_vs_hsdp",
                                            '"two-node"'),
    # the worker torchrun starts on each "node" of `bench two-node` (the test asserts the report it feeds)
    "python -m course_lib bench two-node-worker": ("tests/test_netns.py::test_torchrun_two_agents_fsdp_vs_hsdp",
                                                   "format_report"),
    "python -m course_lib.bench.offload": (HERE + "test_bench_offload_says_it_needs_a_gpu", "course_lib.bench.offload"),
    "python -m course_lib bench offload": (HERE + "test_bench_offload_says_it_needs_a_gpu", '"offload"'),
    "python -m course_lib bench gpu-mfu": (HERE + "test_gpu_mfu_quick", '"gpu-mfu"'),
    "python -m course_lib.bench.gpu_mfu": (HERE + "test_gpu_mfu_quick", "course_lib.bench.gpu_mfu"),
    "python -m course_lib.torchrun_demo": ("tests/test_torchrun.py::test_run_under_torchrun_two_processes",
                                           "course_lib.torchrun_demo"),
    "python -m course_lib.torchrun": ("tests/test_train_cli.py::test_sigterm_to_the_agent_saves_resumes_exactly_and_exits_143",
                                      "course_lib.torchrun"),
    "make site": (HERE + "test_make_site_and_grade_a_stub", '"site"'),
    "python -m course_lib site": (HERE + "test_make_site_and_grade_a_stub", '"site"'),
    "python -m course_lib grade": (HERE + "test_make_site_and_grade_a_stub", '"grade"'),
    "python -m course_lib.train": (HERE + "test_capstone_help_and_a_two_step_run", "course_lib.train"),
    "python -m course_lib.train_jax": (HERE + "test_capstone_help_and_a_two_step_run", "course_lib.train_jax"),
    # a GPU benchmark: on CPU its test checks the plan printed before each run and the runs it would start
    "python -m course_lib bench frameworks": ("tests/test_planner.py::test_frameworks_bench_prices_each_run_before_it_runs",
                                              "frameworks"),
    # the sbatch scripts' preflight, run before srun
    "python -m course_lib.apps.slurm": ("tests/test_slurm.py::test_preflight_refuses_in_one_line_without_a_cluster",
                                        "SLURM_JOB_ID"),
}


# -- what the docs tell a user to type ------------------------------------------------------------------
def _doc_texts():
    yield "README.md", (ROOT / "README.md").read_text()
    for nb in sorted((ROOT / "solutions").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                yield f"solutions/{nb.name} cells[{i}]", "".join(cell["source"])


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def documented() -> dict[str, str]:
    """Each command the docs name -> where it is first named."""
    targets, verbs = _make_targets(), {a.dest for a in _subcommands()}
    benches = cli.bench_modules()
    found: dict[str, str] = {}
    for where, text in _doc_texts():
        for m in re.finditer(r"\bmake ([a-z][a-z-]*)", text):   # prose ("make it") is not a target
            if m.group(1) in targets:
                found.setdefault(f"make {m.group(1)}", where)
        # the CLI table names verbs alone, in backticks: `make-labs`, `validate`, `bench WHAT`
        for m in re.finditer(r"`([a-z][a-z-]*)(?: WHAT)?`", text):
            if m.group(1) in verbs:
                for cmd in ([f"bench {b}" for b in benches] if m.group(1) == "bench" else [m.group(1)]):
                    found.setdefault(f"python -m course_lib {cmd}", where)
        for m in re.finditer(r"-m (course_lib[\w.]*)((?:[ \t]+(?:[a-z][\w-]*|WHAT)){0,2})", text):
            module, words = m.group(1).rstrip("."), m.group(2).split()
            if module != "course_lib" or not words or words[0] not in verbs:
                found.setdefault(f"python -m {module}", where)
                continue
            if words[0] != "bench":
                found.setdefault(f"python -m course_lib {words[0]}", where)
                continue
            named = words[1:] and words[1] in benches
            for b in ([words[1]] if named else benches):   # `bench` / `bench WHAT`: every benchmark
                found.setdefault(f"python -m course_lib bench {b}", where)
    for b in benches:   # README: "`bench WHAT` ... run course_lib/bench/WHAT.py"
        found.setdefault(f"python -m course_lib bench {b}", "README.md (bench WHAT)")
    return found


def _subcommands():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return [type("Verb", (), {"dest": name}) for name in sub.choices]


def _test_source(test_id: str) -> str | None:
    path, name = test_id.split("::")
    tree = ast.parse((ROOT / path).read_text())
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        return None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])   # parametrize names the scripts
    return "\n".join((ROOT / path).read_text().splitlines()[first - 1:node.end_lineno])


def test_the_docs_are_read_as_a_user_would():
    docs = documented()
    for cmd in ("make lab", "make test", "make bench", "python -m course_lib doctor",
                "python -m course_lib bench two-node", "python -m course_lib.train", "python -m course_lib validate"):
        assert cmd in docs, cmd
    assert not any(c.startswith(("make it", "make a ")) for c in docs)


def test_every_documented_command_is_run_by_a_named_test():
    problems = []
    for cmd, where in sorted(documented().items()):
        if cmd not in RUNS:
            problems.append(f"{where} names `{cmd}`, which no test runs: add a quick run and a row to RUNS")
            continue
        test_id, needle = RUNS[cmd]
        src = _test_source(test_id)
        if src is None:
            problems.append(f"RUNS[{cmd!r}] names {test_id}, which does not exist")
        elif needle not in src:
            problems.append(f"RUNS[{cmd!r}] names {test_id}, whose source never mentions {needle}")
    assert problems == [], "\n".join(problems)


# -- quick runs -----------------------------------------------------------------------------------------
def _run(argv, timeout=300, cwd=ROOT, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=ENV, **kw)
    assert out.returncode == 0, f"{' '.join(map(str, argv))} exited {out.returncode}:\n{out.stdout[-2000:]}\n" \
                                f"{out.stderr[-3000:]}"
    return out.stdout


def test_make_lab_test_install_recipes_dry_run(tmp_path):
    lab = _run(["make", "-n", "-o", ".venv/.installed", "lab"])
    assert "-m jupyter lab --ServerApp.root_dir=labs --ServerApp.ip=127.0.0.1" in lab
    test = _run(["make", "-n", "-o", ".venv/.installed", "test"])
    assert "-m pytest -n 2 --dist loadfile" in test and "scripts/system-deps.sh" in test
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):   # no .venv there: the full install recipe
        shutil.copy(ROOT / name, tmp_path / name)
    install = _run(["make", "-n", "install"], cwd=tmp_path)
    assert "-m venv .venv" in install and '-c constraints.txt -e ".[test]"' in install
    assert install.count("--no-compile") == 2 and "-m compileall -q -j 0" in install   # compiled on every core


def test_make_site_and_grade_a_stub(tmp_path):
    """`make site` (dry run: `python -m course_lib site` below builds two pages for real), and `grade` on an
    empty class folder: one named error, exit 1 (tests/test_grade.py grades a real class)."""
    assert "-m course_lib site" in _run(MAKE[:1] + ["-n", "-o", ".venv/.installed", "site"])
    out = tmp_path / "site"
    _run([sys.executable, "-m", "course_lib", "site", "--out", str(out), "--pattern", "0[01]_*.ipynb"])
    assert (out / "index.html").is_file() and len(list((out / "solutions").glob("*.html"))) == 2
    (tmp_path / "class").mkdir()
    res = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(tmp_path / "class"), "--out",
                          str(tmp_path / "grades")], capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert res.returncode != 0 and "empty" in (res.stdout + res.stderr).lower(), res.stdout + res.stderr


def test_make_doctor_and_make_bench_launch():
    doctor = _run(MAKE + ["doctor"])
    assert "course_lib doctor" in doctor and "backend (4 ranks)" in doctor
    bench = _run(MAKE + ["bench", "WHAT=launch", "ARGS=--ranks 2 --cold 1 --warm 1 --fresh 1"])
    assert "cold start (new interpreter -> first all-reduce on 2 ranks)" in bench and "failures 0/1" in bench
    for stage in ("interpreter", "imports", "fork server", "forks", "rendezvous", "first collective"):
        assert f"  {stage} " in bench, stage


def test_make_labs_solutions_clean_in_a_scratch_checkout(tmp_path):
    """A checkout with one tiny solution: `make labs`, `make-labs --check`, `make solutions` (validate, then
    run-solutions), `make clean` -- the real targets, the real CLI."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "solutions").mkdir()
    shutil.copy(ROOT / "tests" / "fixtures" / "smoke" / "00_smoke.ipynb", tmp_path / "solutions")
    (tmp_path / "course_lib").symlink_to(ROOT / "course_lib")   # the CLI's root is the folder it runs in
    assert "1 lab(s) written" in _run(MAKE + ["labs"], cwd=tmp_path)
    assert (tmp_path / "labs" / "00_smoke.ipynb").is_file()
    assert "up to date" in _run([PY, "-m", "course_lib", "make-labs", "--check"], cwd=tmp_path)
    out = _run(MAKE + ["solutions"], cwd=tmp_path)
    assert "1 notebook(s) checked, 0 problem(s)" in out                       # validate
    assert re.search(r"solutions/00_smoke\.ipynb\s+ok\b", out) and "1 ok, 0 failed" in out   # run-solutions
    (tmp_path / ".venv").mkdir()
    _run(MAKE + ["clean"], cwd=tmp_path)
    assert not (tmp_path / ".venv").exists() and (tmp_path / "solutions").is_dir()


def test_bench_fsdp_tiniest():
    out = subprocess.run([PY, "-m", "course_lib", "bench", "fsdp", "--ranks", "2", "--steps", "1", "--warmup", "1",
                          "--layers", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=ENV)
    rows = {w[0]: w for w in map(str.split, out.stdout.splitlines())
            if w[:1] in (["ours"], ["fsdp2"], ["ddp"]) and len(w) > 2 and w[1][0].isdigit()}
    assert set(rows) == {"ours", "fsdp2", "ddp"}, out.stdout + out.stderr[-3000:]
    assert rows["ours"][-1] == rows["fsdp2"][-1] == "1.000"              # ledger / formula, FSDP's two
    # --warmup 1: DDP still warms up past its second step, where its reducer rebuilds the buckets and broadcasts
    # their order (it was timed once: 86 B over the ring formula, and the bench exited 1)
    assert rows["ddp"][-1] == "1.000" and "after 2 warm-up (--warmup 1 asked" in out.stdout, out.stdout
    losses = re.search(r"ours ([\d.]+), FSDP2 ([\d.]+), DDP ([\d.]+)", out.stdout).groups()
    assert float(losses[0]) == pytest.approx(float(losses[2]), rel=1e-4), out.stdout   # the same step's loss
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


@pytest.mark.slow
def test_bench_step_time_tiniest():
    # --ranks 3: a world size that divides none of the payloads evenly (it used to crash), one calibration
    out = subprocess.run([PY, "-m", "course_lib", "bench", "step-time", "--ranks", "3", "--repeats", "1", "--steps", "1",
                          "--rounds", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "round 1 ratios" in out.stdout and "hsdp" not in out.stdout, out.stdout[-2000:]     # 3 has no divisor


def test_bench_timeline_tiniest(tmp_path):
    out = _run([PY, "-m", "course_lib", "bench", "timeline", "--ranks", "2", "--width", "16", "--batch", "2",
                "--layers", "1", "--steps", "1", "--prefetch", "default", "--out", str(tmp_path / "trace.json")])
    assert "prefetch=default" in out and "overlapped" in out
    assert json.loads((tmp_path / "trace_default.json").read_text())["traceEvents"]


def test_gpu_mfu_quick(tmp_path):
    """`python -m course_lib.bench.gpu_mfu` (= `bench gpu-mfu`): its flags here; the --quick run (a tiny model)
    on a GPU only -- on this CPU machine it takes minutes and its profiling step expects a GPU trace."""
    assert "--quick" in _run([PY, "-m", "course_lib.bench.gpu_mfu", "--help"])
    assert "--overlap-only" in _run([PY, "-m", "course_lib", "bench", "gpu-mfu", "--help"])
    import torch
    if not torch.cuda.is_available():
        pytest.skip("the --quick run needs a GPU here (help checked above)")
    _run([PY, "-m", "course_lib", "bench", "gpu-mfu", "--quick", "--out", str(tmp_path)])
    assert (tmp_path / "gpu_results.json").is_file()


def test_bench_offload_says_it_needs_a_gpu(tmp_path):
    """`python -m course_lib.bench.offload` (Lab 04's CPU-offload figures): without a GPU it measures nothing and says
    so, exit 0 with --quick and 2 without; its formula is the one Lab 04 prints."""
    import torch
    from course_lib.bench.offload import link_bytes_per_step
    assert link_bytes_per_step(1000) == 12000 and link_bytes_per_step(7, param_bytes=2) == 42
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the real run is scripts/gpu_session.sh's")
    out = _run([PY, "-m", "course_lib.bench.offload", "--quick", "--out", str(tmp_path)])
    assert "no CUDA GPU" in out and "nothing is measured" in out
    p = subprocess.run([PY, "-m", "course_lib", "bench", "offload"], capture_output=True, text=True, cwd=ROOT,
                       env=ENV)
    assert p.returncode == 2, p.stdout + p.stderr


@pytest.mark.parametrize("script, extra", [("course_lib.train", []),
                                           ("course_lib.train_jax", ["--cpu-devices", "2"])])
def test_capstone_help_and_a_two_step_run(tmp_path, script, extra):
    assert "--resume" in _run([PY, "-m", script, "--help"])
    log = tmp_path / "log.jsonl"
    _run([PY, "-m", script, "--steps", "2", "--batch", "4", "--n-layers", "1", "--jsonl", str(log), *extra],
         timeout=300)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r] == [0, 1] and rows[-1].get("summary") is True


def test_bench_labs_tiniest(tmp_path):
    """``bench labs`` on a two-cell notebook that states its time: its seconds beside the stated range, a verdict."""
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A lab\n\nRun untouched, the notebook takes 0.5–60 s on 2 CPU cores."),
        nbformat.v4.new_code_cell("x = 1 + 1")])
    nbformat.write(nb, tmp_path / "00_tiny.ipynb")
    done = subprocess.run([PY, "-m", "course_lib", "bench", "labs", "--dir", str(tmp_path)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("00_tiny") or "00_tiny.ipynb " in line)
    assert "0.5–60 s" in row and ("in range" in row or "faster" in row), done.stdout


def test_bench_host_calibrates():
    """``python -m course_lib.bench.host`` (Lab 08 names it): this machine's seconds per dispatch, from a tiny run."""
    done = subprocess.run([PY, "-m", "course_lib.bench.host"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DISPATCH_S =" in done.stdout and "FSDP_UNIT_S =" in done.stdout, done.stdout
