"""Benchmark the launcher: cold start, warm round trip, and repeated fresh launches.

    python -m course_lib bench launch [--ranks 4] [--warm 50] [--fresh 50]

Cold start is measured in a new interpreter (fork server included), as a learner's first call
in a fresh kernel would be. Figures are printed, not asserted: a timed test on a shared 2-core
machine would be flaky.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

_COLD = r"""
import time
t0 = time.perf_counter()
from course_lib import launch
import torch.distributed as dist
def f():
    import torch
    t = torch.ones(1); dist.all_reduce(t); return t.item()
if __name__ == "__main__":
    r = launch.run(f, world_size={ranks})
    assert r == [{ranks}.0] * {ranks}, r
    print(time.perf_counter() - t0)
"""


def _trivial():
    return 0


def _allreduce():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m course_lib bench launch", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--cold", type=int, default=3, help="cold starts, each in a new interpreter")
    ap.add_argument("--warm", type=int, default=50, help="warm round trips")
    ap.add_argument("--fresh", type=int, default=50, help="launches with fresh rank processes each time")
    a = ap.parse_args(argv)
    from course_lib import launch

    colds = []
    for _ in range(a.cold):
        out = subprocess.run([sys.executable, "-c", _COLD.format(ranks=a.ranks)], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            print(out.stderr[-2000:])
            raise SystemExit(f"cold start failed (exit {out.returncode})")
        colds.append(float(out.stdout.strip().splitlines()[-1]))
    launch.run(_trivial, world_size=a.ranks)
    warm = []
    for _ in range(a.warm):
        t = time.perf_counter()
        launch.run(_trivial, world_size=a.ranks)
        warm.append(time.perf_counter() - t)
    fresh, failures = [], 0
    for _ in range(a.fresh):
        t = time.perf_counter()
        try:
            assert launch.run(_allreduce, world_size=a.ranks, fresh=True) == [float(a.ranks)] * a.ranks
        except Exception as exc:  # counted, not hidden
            failures += 1
            print("launch failed:", exc)
        fresh.append(time.perf_counter() - t)
    exits = launch._POOLS[(a.ranks, "gloo")].stop() if (a.ranks, "gloo") in launch._POOLS else []
    import os
    print(f"ranks={a.ranks}  fork-server preload={os.environ.get('COURSE_LIB_PRELOAD', 'full')}")
    print(f"cold start (new interpreter, import + fork server + {a.ranks} ranks + first all-reduce): "
          f"median {statistics.median(colds):.2f} s  (runs: {', '.join(f'{c:.2f}' for c in colds)})")
    print(f"warm round trip, trivial function: median {statistics.median(warm) * 1e3:.2f} ms, "
          f"max {max(warm) * 1e3:.2f} ms over {a.warm}")
    print(f"fresh launch (new rank processes + all-reduce + shutdown): median {statistics.median(fresh):.3f} s; "
          f"failures {failures}/{a.fresh}; last exit codes {exits}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
