"""Each lab's run time against the time its first cell states: where the stated times come from.

    python -m course_lib bench labs [--pattern '0[3-5]_*.ipynb'] [--solutions | --dir DIR] [--timeout S]

Runs every lab in ``labs/`` exactly as a learner receives it (stubs, no outputs), one after another in a fresh
kernel each, and prints its seconds beside the stated range (:mod:`course_lib.authoring.lab_time`):

    lab                            seconds  stated     verdict
    labs/02_memory.ipynb              24.1  20–60 s    in range

``faster`` and ``SLOWER`` name a sentence to restate: run this on a quiet machine (nothing else busy; say the load
when you quote it), then write the measured figure into the lab's first cell ("measured: 24 s"). The test suite
never fails a lab for being fast; it fails one only far above its stated high end (``lab_time.SLOW_MARGIN``).
Figures are printed, not asserted. The exit status is non-zero only when a notebook failed to run.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from course_lib.authoring import lab_time
from course_lib.authoring.run import run_notebook

ROOT = Path(__file__).resolve().parents[2]


def _stated(path: Path) -> str:
    rng = lab_time.stated_seconds(path)
    if rng is None:
        return "-"
    lo, hi = rng
    return f"{lo:g}–{hi:g} s" if hi < 120 else f"{lo / 60:g}–{hi / 60:g} min"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib bench labs", description=__doc__.split("\n\n")[0])
    p.add_argument("--pattern", default="[0-9][0-9]_*.ipynb", help="glob inside the folder")
    p.add_argument("--solutions", action="store_true", help="time solutions/ instead (every exercise solved)")
    p.add_argument("--dir", type=Path, default=None, help="time the notebooks of this folder instead")
    p.add_argument("--timeout", type=float, default=600, help="seconds per cell (default 600)")
    args = p.parse_args(argv)
    folder = args.dir or ROOT / ("solutions" if args.solutions else "labs")
    paths = sorted(folder.glob(args.pattern))
    if not paths:
        print(f"no notebooks match {folder / args.pattern}")
        return 1
    rows, failed = [("lab", "seconds", "stated", "verdict")], 0
    for path in paths:
        r = run_notebook(path, timeout=args.timeout)
        failed += not r.ok
        stated = path if args.dir else ROOT / "labs" / path.name       # a lab's sentence is in its first cell
        verdict = lab_time.verdict(stated, r.seconds) if r.ok else r.status
        rows.append((r.notebook, f"{r.seconds:.1f}", _stated(stated), verdict))
        print(f"  {r.notebook}: {r.seconds:.1f} s, {verdict}", flush=True)
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  ".join(f"{c:>{w}}" if i == 1 else f"{c:<{w}}" for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    print("faster: fine, but the sentence overstates; SLOWER: restate it (on a quiet machine).")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
