"""``python -m course_lib``: the course's command line (authoring, instructor runs, diagnosis).

    make-labs       derive labs/ from solutions/ (``--check``: fail if labs/ is stale; ``--nbgrader DIR``:
                    nbgrader source notebooks instead, :mod:`course_lib.authoring.nbgrader`)
    validate        check solutions/ against the notebook conventions
    run-solutions   execute every solution (or ``--labs``) headless; print a one-screen table
    doctor          versions, cores, GPUs, the backend 4 ranks would use, JAX's devices
    bench WHAT      run ``course_lib.bench.<WHAT>.main(argv)`` (``step-time`` -> ``bench/step_time.py``)
    grade PATHS     grade learners' labs with the course's checks (:mod:`course_lib.apps.grading`)
    site            the course as a static website (:mod:`course_lib.apps.site`)
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import shutil
import sys
from pathlib import Path



def _root() -> Path:
    """The course checkout: the current folder if it is one, else the one holding course_lib."""
    cwd = Path.cwd()
    if (cwd / "solutions").is_dir() and (cwd / "course_lib").is_dir():
        return cwd
    return Path(__file__).resolve().parents[2]   # course_lib/apps/cli.py -> the checkout


def cmd_make_labs(args) -> int:
    from course_lib import authoring
    try:
        if args.nbgrader is not None:
            written = authoring.write_nbgrader_sources(args.src, args.nbgrader)
            for path in written:
                print(f"wrote {path}")
            print(f"{len(written)} nbgrader source notebook(s) in {args.nbgrader}: put them in the course's "
                  "source/<assignment>/ and run `nbgrader generate_assignment <assignment>`")
            return 0
        if args.check:
            stale = authoring.stale_labs(args.src, args.dst)
            if stale:
                print(f"{args.dst} is stale (run `make labs`):", *stale, sep="\n  ")
                return 1
            print(f"{args.dst} is up to date with {args.src}")
            return 0
        written = authoring.write_labs(args.src, args.dst)
    except authoring.AuthoringError as err:
        print("authoring errors:", *err.problems, sep="\n  ", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    print(f"{len(written)} lab(s) written, the rest unchanged")
    return 0


def cmd_validate(args) -> int:
    from course_lib import authoring
    paths = sorted(Path(args.dir).glob("*.ipynb"))
    problems = [p for path in paths for p in authoring.validate_notebook(path)]
    for problem in problems:
        print(problem)
    print(f"{len(paths)} notebook(s) checked, {len(problems)} problem(s)")
    return 1 if problems else 0


def cmd_run_solutions(args) -> int:
    from course_lib import authoring
    folder = Path(args.dir) if args.dir else _root() / ("labs" if args.labs else "solutions")
    paths = sorted(folder.glob(args.pattern))
    if not paths:
        print(f"no notebooks match {folder / args.pattern}: nothing ran", file=sys.stderr)
        return 1
    results = authoring.run_all(paths, timeout=args.timeout, write=args.write)
    print(authoring.format_table(results))
    return 0 if all(r.ok for r in results) else 1


def cmd_doctor(args) -> int:
    from course_lib.runtime import devices
    jax_line = ""
    try:
        devs = devices.setup_jax(args.jax_devices)   # before describe(), so JAX's line is real
        sim = devs[0].platform == "cpu" and len(devs) > 1
        jax_line = f"{len(devs)} x {devs[0].platform}" + (" (simulated CPU devices)" if sim else "")
    except Exception as exc:  # doctor reports problems, it does not crash on them
        jax_line = f"unavailable: {exc}"
    d = devices.describe(args.ranks)
    try:
        devices.check_torch_version(d["torch"])
        torch_ok = f"ok (>= {'.'.join(map(str, devices.MIN_TORCH))})"
    except Exception as exc:
        torch_ok = f"REFUSED: {exc}"
    rows = [("python", d["python"]), ("torch", f"{d['torch']}  {torch_ok}")]
    rows += [(m, d.get(m) or "not installed") for m in ("jax", "flax", "optax")]
    rows += [("CPU cores", d["cpu_cores"]),
             ("GPUs", ", ".join(d.get("gpu_names", [])) or d["gpus"]),
             (f"backend ({args.ranks} ranks)", f"{d['backend']}: {d['backend_reason']}"),
             ("JAX devices", jax_line),
             ("chromium", shutil.which("chromium") or "missing (browser tests skip): run scripts/system-deps.sh")]
    width = max(len(k) for k, _ in rows)
    print("course_lib doctor")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0


def bench_modules() -> list[str]:
    """Benchmarks are the modules of ``course_lib/bench/`` that define ``main(argv)`` (read, not imported)."""
    from course_lib import bench
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(bench.__path__)
                  if "\ndef main(" in (Path(bench.__path__[0]) / f"{m.name}.py").read_text())


def cmd_bench(args) -> int:
    available = bench_modules()
    if args.what not in available:
        print(f"no benchmark {args.what!r} (course_lib/bench/{args.what.replace('-', '_')}.py has no main()). "
              f"Available: {', '.join(available) or 'none yet'}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"course_lib.bench.{args.what.replace('-', '_')}")
    return int(module.main(list(args.args)) or 0)


def build_parser() -> argparse.ArgumentParser:
    root = _root()
    p = argparse.ArgumentParser(prog="python -m course_lib",
                                description="The course's command line: authoring, instructor runs, diagnosis.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("make-labs", help="derive labs/ from solutions/")
    s.add_argument("--check", action="store_true", help="write nothing; exit 1 listing stale labs")
    s.add_argument("--src", type=Path, default=root / "solutions", help="solutions folder")
    s.add_argument("--dst", type=Path, default=root / "labs", help="labs folder")
    s.add_argument("--nbgrader", type=Path, metavar="DIR", default=None,
                   help="instead, write each lab as an nbgrader source notebook into DIR")
    s.set_defaults(func=cmd_make_labs)

    s = sub.add_parser("validate", help="check solutions/ against the notebook conventions")
    s.add_argument("--dir", type=Path, default=root / "solutions")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("run-solutions", help="execute every solution headless and print a table")
    s.add_argument("--pattern", default="*.ipynb", help="glob inside the folder (default *.ipynb)")
    s.add_argument("--timeout", type=float, default=600, help="seconds per cell (default 600)")
    s.add_argument("--labs", action="store_true", help="run labs/ (as learners receive them)")
    s.add_argument("--dir", type=Path, default=None, help="run this folder instead")
    s.add_argument("--write", action="store_true",
                   help="save each notebook that ran without error, with its new outputs (then: make labs)")
    s.set_defaults(func=cmd_run_solutions)

    s = sub.add_parser("doctor", help="versions, devices and the backend a run would use")
    s.add_argument("--ranks", type=int, default=4)
    s.add_argument("--jax-devices", type=int, default=8)
    s.set_defaults(func=cmd_doctor)

    s = sub.add_parser("bench", help="run course_lib.bench.<WHAT>.main(argv)")
    s.add_argument("what", help=f"one of: {', '.join(bench_modules()) or 'none yet'}")
    s.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the benchmark")
    s.set_defaults(func=cmd_bench)

    from course_lib.apps.grading.sandbox import Limits   # light: the grader's own imports wait for the command
    s = sub.add_parser("grade", help="grade learners' labs with the course's checks (grades.csv, report.html)")
    s.add_argument("submissions", nargs="+", type=Path,
                   help="notebooks or folders: CLASS/LEARNER/NN_name.ipynb or CLASS/LEARNER_NN_name.ipynb")
    s.add_argument("--jobs", type=int, default=2, help="notebooks graded at once (default 2)")
    s.add_argument("--cell-timeout", type=float, default=Limits.cell_s, help="seconds per cell (default %(default)g)")
    s.add_argument("--timeout", type=float, default=Limits.notebook_s, help="seconds per notebook (default %(default)g)")
    s.add_argument("--memory-gb", type=float, default=Limits.memory_bytes / 2**30,
                   help="memory limit per submission, GiB: each process's address space, and (run as root) "
                        "all of its RAM, /tmp and scratch files included (default %(default)g)")
    s.add_argument("--scratch-gb", type=float, default=Limits.scratch_bytes / 2**30,
                   help="disk for a submission's scratch folder, GiB (run as root: a size-limited tmpfs; "
                        "default %(default)g)")
    s.add_argument("--out", type=Path, default=Path("."), help="where grades.csv, report.html, notebooks/ go")
    s.add_argument("--labs", type=Path, default=root / "labs", help="the labs as shipped (default: the course's)")
    s.add_argument("--processes", type=int, default=Limits.nproc,
                   help="processes and threads one submission may have at once (default %(default)d)")
    s.add_argument("--no-sandbox", action="store_true",
                   help="run the kernels without bubblewrap (where it cannot run): they then see the disk and network")
    s.set_defaults(func=_imported_when_run("grade", "course_lib.apps.grading.grade"))

    s = sub.add_parser("site", help="build the course as a static website (index, solutions, labs to download)")
    s.add_argument("--out", type=Path, default=root / "site", help="output folder, emptied first (default site/)")
    s.add_argument("--pattern", default="[0-9][0-9]_*.ipynb", help="which solutions (default: all)")
    s.add_argument("--solutions", type=Path, default=root / "solutions")
    s.add_argument("--labs", type=Path, default=root / "labs")
    s.add_argument("--docs", type=Path, default=root / "docs", help="the docs pages, one per NAME.md (default docs/)")
    s.add_argument("--repo", default=None,
                   help="the address `git clone` takes, named in the Start block (default: git's remote 'origin')")
    s.set_defaults(func=_imported_when_run("site"))
    return p


def _imported_when_run(verb: str, module_name: str | None = None):
    """``course_lib.apps.<verb>.cmd_<verb>``, imported when the command runs: the notebook tools it needs (nbformat,
    nbclient, nbconvert; ~1 s to import) are not loaded for ``bench`` or ``doctor``, and a machine without them
    (a GPU box's own image, where ``bench gpu-mfu`` runs) gets one line that says what to install."""
    def run(args) -> int:
        try:
            module = importlib.import_module(module_name or f"course_lib.apps.{verb}")
        except ModuleNotFoundError as err:
            if (err.name or "").startswith("course_lib"):
                raise                    # the course's own module is missing: a bug to see, not a package to install
            return _needs(verb, err.name)
        return getattr(module, f"cmd_{verb}")(args)
    return run


def _needs(verb: str, missing: str) -> int:
    print(f"course_lib {verb}: needs the Python package {missing}, which is not installed here. Fix: `make install` "
          f"(or pip install -e '.[test]') in the course's folder.", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
