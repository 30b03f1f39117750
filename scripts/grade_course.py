"""Grade the whole course as one class: a solved copy and an untouched copy of every lab, boxed.

    .venv/bin/python scripts/grade_course.py [--labs '0[0-9]'] [--jobs 2] [--out DIR]

``solved`` hands in every lab with each stub replaced by the solution's code; ``untouched`` hands in the labs as
shipped. Every exercise of ``solved`` must be graded solved by its judge (outside the box) and every exercise of
``untouched`` not attempted; the script prints the grader's table and one line per exercise that is not, and exits 1
when any is not. (Too slow for the test suite -- every lab runs twice -- so it is a script; the closing note of the
verdicts issue quotes its run.)
"""
from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def solved_copy(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    sol = nbformat.read(ROOT / "solutions" / path.name, as_version=4)
    for cell, ref in zip(nb.cells, sol.cells, strict=True):
        if "Exercise not done yet" in cell.source:
            cell.source = ref.source
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labs", default="0[0-9]", help="glob of the labs' two digits")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="grade-course-"))
    cls, out = base / "class", args.out or base / "out"
    labs = sorted((ROOT / "labs").glob(f"{args.labs}_*.ipynb"))
    for learner in ("solved", "untouched"):
        (cls / learner).mkdir(parents=True)
        for path in labs:
            nbformat.write(solved_copy(path) if learner == "solved" else nbformat.read(path, as_version=4),
                           cls / learner / path.name)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "course_lib", "grade", str(cls), "--out", str(out),
                           "--jobs", str(args.jobs), "--cell-timeout", "600", "--timeout", "1800"],
                          cwd=ROOT, capture_output=True, text=True)
    print(done.stdout[-6000:])
    print(f"{len(labs)} labs × 2 learners graded in {time.monotonic() - start:.0f} s (--jobs {args.jobs}); out: {out}")
    want = {"solved": "solved", "untouched": "not attempted"}
    bad = [r for r in csv.DictReader(open(out / "grades.csv", encoding="utf-8"))
           if r["kind"] == "exercise" and r["verdict"] != want.get(r["learner"])]
    flags = [r for r in csv.DictReader(open(out / "grades.csv", encoding="utf-8")) if r["kind"] == "flag"]
    for r in bad + flags:
        print(f"  {r['learner']} {r['lab']} {r['item']}: {r['verdict']} {r['detail'][:200]}")
    n = sum(1 for r in csv.DictReader(open(out / "grades.csv", encoding="utf-8")) if r["kind"] == "exercise")
    print(f"{n - len(bad)} of {n} exercises as expected (solved copy: solved; untouched copy: not attempted), "
          f"{len(flags)} flag(s)")
    return 1 if bad or flags or done.returncode not in (0,) else 0


if __name__ == "__main__":
    sys.exit(main())
