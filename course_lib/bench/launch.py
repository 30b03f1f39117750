"""Benchmark the launcher: cold start (with a breakdown), warm round trip, repeated fresh launches.

    python -m course_lib bench launch [--ranks 4] [--cold 5] [--warm 50] [--fresh 50] [--kernel N] [--jax]
                                      [--accelerate-target DIR]

Cold start is measured in a new interpreter, as a learner's first call in a fresh kernel would be: from
``python`` being started to the first all-reduce returning on every rank. It is cut into stages that follow
each other (they add up to the total), each the median over ``--cold`` runs:

  interpreter        the new Python process reaches its first line
  imports            ``from course_lib import launch`` (the notebook side; with ``--torch-first`` also
                     ``import torch.distributed``, as a notebook that imported torch before its first call)
  fork server        ``run()`` asks for the torch fork server until the first rank is forked (the server imports
                     torch once, for every rank: ``launch.PRELOAD["full"]``; in a script nothing starts it earlier)
  forks              first rank forked -> last rank forked
  rendezvous         last rank forked -> every rank through the file store and ``init_process_group``
  first collective   the first call: pickle ``fn``, all-reduce on every rank, results back

Then the fresh-kernel figure (:mod:`.launch_kernel`): a new Jupyter kernel, one cell that imports torch and the
launcher and all-reduces on every rank, the course's ``run`` beside accelerate's ``notebook_launcher`` (round-robin,
``--kernel`` rounds, default ``--cold``; median and ratio; ``--jax``: a function that uses JAX). accelerate is looked for on ``--accelerate-target``
(a ``pip install --target`` folder, never the course's venv); without it that comparison is skipped in one line.

Figures are printed, not asserted: a timed test on a shared 2-core machine would be flaky.
``--cold 1 --warm 1 --fresh 1 --ranks 2`` is the tiniest run (what the test suite runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_COLD = r"""
import time
t0 = time.time()
from course_lib import launch
{torch_first}
t_imports = time.time()
def f():
    import torch
    import torch.distributed as dist
    t = torch.ones(1); dist.all_reduce(t); return t.item()
if __name__ == "__main__":
    t_run = time.time()
    r = launch.run(f, world_size={ranks})
    t_end = time.time()
    assert r == [{ranks}.0] * {ranks}, r
    import json
    print(json.dumps(dict(r.startup, t0=t0, imports=t_imports, run=t_run, end=t_end)))
"""

STAGES = ("interpreter", "imports", "fork server", "forks", "rendezvous", "first collective")


def stages(launched: float, m: dict) -> dict:
    """Seconds per stage of one cold start, from the wall-clock milestones the cold script printed."""
    return {"interpreter": m["t0"] - launched,
            "imports": m["imports"] - m["t0"],
            # run() itself (version check, backend choice) before the fork server is asked for counts here too
            "fork server": m["first_rank_forked"] - m["imports"],
            "forks": m["last_rank_forked"] - m["first_rank_forked"],
            "rendezvous": m["all_ranks_ready"] - m["last_rank_forked"],
            "first collective": m["end"] - m["all_ranks_ready"],
            "total": m["end"] - launched}


def cold_start(ranks: int, torch_first: bool = False) -> dict:
    """One cold start in a new interpreter; returns seconds per stage (and the total)."""
    code = _COLD.format(ranks=ranks, torch_first="import torch.distributed" if torch_first else "")
    launched = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        raise SystemExit(f"cold start failed (exit {out.returncode})")
    return stages(launched, json.loads(out.stdout.strip().splitlines()[-1]))


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
    ap.add_argument("--cold", type=int, default=5, help="cold starts, each in a new interpreter (median reported)")
    ap.add_argument("--torch-first", action="store_true",
                    help="the cold-start script imports torch.distributed before its first run() (the fork server's "
                         "imports then cannot overlap the notebook's)")
    ap.add_argument("--warm", type=int, default=50, help="warm round trips")
    ap.add_argument("--fresh", type=int, default=50, help="launches with fresh rank processes each time")
    ap.add_argument("--kernel", type=int, default=None,
                    help="fresh-kernel rounds, course then accelerate in each (default: --cold; 0 skips)")
    ap.add_argument("--jax", action="store_true",
                    help="fresh-kernel rounds for a function that uses JAX on every rank (both cells import JAX)")
    ap.add_argument("--accelerate-target", default=os.environ.get("COURSE_BENCH_ACCELERATE"),
                    help="folder where accelerate was pip-installed with --target (not the course's venv)")
    a = ap.parse_args(argv)
    from course_lib.bench import launch_kernel
    rounds = a.cold if a.kernel is None else a.kernel
    kernel = launch_kernel.compare(a.ranks, rounds, a.accelerate_target, a.jax) if rounds else None
    from course_lib import launch

    colds = [cold_start(a.ranks, a.torch_first) for _ in range(a.cold)]
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
    exits = launch.shutdown()
    print(f"ranks={a.ranks}  torch imported first={a.torch_first}  fork-server preload={os.environ.get('COURSE_LIB_PRELOAD', 'full')}  "
          f"cores={os.cpu_count()}  load average={os.getloadavg()[0]:.2f}")
    totals = [c["total"] for c in colds]
    print(f"cold start (new interpreter -> first all-reduce on {a.ranks} ranks): median {statistics.median(totals):.2f} s"
          f"  (runs: {', '.join(f'{t:.2f}' for t in totals)})")
    for stage in STAGES:
        vals = [c[stage] for c in colds]
        print(f"  {stage:<17} median {statistics.median(vals):6.3f} s  (min {min(vals):.3f}, max {max(vals):.3f})")
    if kernel:
        print(launch_kernel.report(kernel, a.ranks))
    print(f"warm round trip, trivial function: median {statistics.median(warm) * 1e3:.2f} ms, "
          f"max {max(warm) * 1e3:.2f} ms over {a.warm}")
    print(f"fresh launch (new rank processes + all-reduce + shutdown): median {statistics.median(fresh):.3f} s; "
          f"failures {failures}/{a.fresh}; exit codes at shutdown {exits}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
