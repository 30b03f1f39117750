"""What the grader's sandbox costs: a class of N copies of one lab, graded with and without bubblewrap.

    .venv/bin/python scripts/bench_grade.py --lab 02 --copies 30 --rounds 5 --jobs 2

The copies are the lab with every exercise solved (the solution's code in each stub). The class is split into
``--rounds`` parts; each part is graded once boxed and once with ``--no-sandbox``, alternating which goes first,
so a machine whose speed drifts within the hour (this one does, by ±6 %) charges both sides alike. Prints each
part's seconds, the totals and their ratio, and writes them as JSON (``--json``).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def solved(lab: str) -> tuple[str, nbformat.NotebookNode]:
    (path,) = sorted((ROOT / "labs").glob(f"{lab}_*.ipynb"))
    nb = nbformat.read(path, as_version=4)
    sol = nbformat.read(ROOT / "solutions" / path.name, as_version=4)
    for cell, ref in zip(nb.cells, sol.cells, strict=True):
        if "Exercise not done yet" in cell.source:
            cell.source = ref.source
    return path.name, nb


def grade(folder: Path, out: Path, jobs: int, sandbox: bool) -> float:
    cmd = [sys.executable, "-m", "course_lib", "grade", str(folder), "--out", str(out), "--jobs", str(jobs)]
    start = time.monotonic()
    done = subprocess.run(cmd + ([] if sandbox else ["--no-sandbox"]), cwd=ROOT, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        sys.exit(f"bench_grade: the grader failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab", default="02")
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    name, nb = solved(args.lab)
    base = Path(tempfile.mkdtemp(prefix="bench-grade-"))
    per = -(-args.copies // args.rounds)
    times = {"boxed": [], "unboxed": []}
    for r in range(args.rounds):
        part = base / f"part{r}"
        for i in range(r * per, min(args.copies, (r + 1) * per)):
            (part / f"learner{i:02d}").mkdir(parents=True)
            nbformat.write(nb, part / f"learner{i:02d}" / name)
        order = [True, False] if r % 2 == 0 else [False, True]
        for boxed in order:
            s = grade(part, base / f"out{r}{'b' if boxed else 'u'}", args.jobs, boxed)
            times["boxed" if boxed else "unboxed"].append(s)
            print(f"part {r + 1}/{args.rounds} ({len(list(part.iterdir()))} notebooks) "
                  f"{'boxed  ' if boxed else 'unboxed'} {s:7.1f} s", flush=True)
    boxed, unboxed = sum(times["boxed"]), sum(times["unboxed"])
    print(f"{args.copies} × lab {args.lab}, --jobs {args.jobs}: boxed {boxed:.1f} s, unboxed {unboxed:.1f} s, "
          f"ratio {boxed / unboxed:.3f}")
    if args.json:
        args.json.write_text(json.dumps({**times, "ratio": boxed / unboxed, "copies": args.copies, "lab": args.lab}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
