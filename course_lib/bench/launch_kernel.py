"""Fresh Jupyter kernel -> first all-reduce result: the course's ``run`` beside accelerate's ``notebook_launcher``.

What a learner sees on a lab's first call, measured the way a learner meets it: a new kernel (jupyter_client, the
kernel JupyterLab starts), one cell that imports torch and the launcher, defines a function that all-reduces a
tensor on N gloo ranks and launches it. The clock starts when the cell is sent to a kernel that reported ready and
stops when its reply arrives (the result printed). Each cell is written as its tool's documentation writes it: the
course's with ``import course_lib`` first (every lab's first line), accelerate's with ``notebook_launcher``. Rounds alternate course / accelerate (round-robin), so both
meet the same machine load; the median of the rounds is reported, with their ratio. ``--jax``: both cells also
import ``jax.numpy`` and the function builds its tensor with it (the course's ranks then come from its jax fork
server, accelerate's are forks of a kernel that imported JAX).

accelerate is not a course dependency: install it only for this benchmark, apart from the course's venv, e.g.
``.venv/bin/python -m pip install --target /tmp/acc accelerate`` and pass ``--accelerate-target /tmp/acc`` (the
accelerate kernel gets it on ``PYTHONPATH``). Without it the comparison is skipped with one line.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

COURSE_CELL = """\
import course_lib                   # first, as in every lab: the fork server starts now, beside the imports below
import torch
import torch.distributed as dist

def first_all_reduce():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

print(course_lib.run(first_all_reduce, world_size={ranks}))
"""

#: ``--jax``: the same first call for a function that uses JAX on every rank (the kernel imports JAX too).
JAX_IMPORT = "import jax.numpy as jnp\n"
JAX_VALUE = "torch.tensor([float(jnp.ones(1).sum())])"

ACCELERATE_CELL = """\
import torch
import torch.distributed as dist
from accelerate import notebook_launcher

def first_all_reduce():
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(t.item())
    dist.destroy_process_group()

notebook_launcher(first_all_reduce, num_processes={ranks})
"""


def _env(extra_path: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    return env


def accelerate_importable(target: str | None) -> str | None:
    """accelerate's version when a kernel with ``target`` on its path can import it, else None."""
    out = subprocess.run([sys.executable, "-c", "import accelerate; print(accelerate.__version__)"],
                         capture_output=True, text=True, env=_env(target), timeout=120)
    return out.stdout.strip() if out.returncode == 0 else None


def one_cell(code: str, env: dict, timeout_s: float = 120.0) -> float:
    """Seconds from sending ``code`` to a fresh, ready kernel until its reply; the cell must succeed."""
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3", env=env, startup_timeout=60)
    try:
        t0 = time.perf_counter()
        msg_id = kc.execute(code)
        reply = kc.get_shell_msg(timeout=timeout_s)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=timeout_s)
        seconds = time.perf_counter() - t0
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the benchmark cell failed: {reply['content'].get('ename')}: "
                               f"{reply['content'].get('evalue')}")
        return seconds
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)


def cells(ranks: int, jax: bool = False) -> tuple[str, str]:
    """The course's cell and accelerate's; with ``jax`` each imports ``jax.numpy`` and its function uses it."""
    course, acc = COURSE_CELL.format(ranks=ranks), ACCELERATE_CELL.format(ranks=ranks)
    if jax:
        course = course.replace("import torch.distributed as dist\n", "import torch.distributed as dist\n" + JAX_IMPORT)
        acc = acc.replace("import torch.distributed as dist\n", "import torch.distributed as dist\n" + JAX_IMPORT)
        course, acc = (c.replace("t = torch.ones(1)", f"t = {JAX_VALUE}") for c in (course, acc))
    return course, acc


def compare(ranks: int, rounds: int, accelerate_target: str | None, jax: bool = False) -> dict:
    """Round-robin fresh-kernel first calls; returns the per-round seconds of each tool (accelerate: [] if absent)."""
    version = accelerate_importable(accelerate_target)
    course_cell, acc_cell = cells(ranks, jax)
    course, acc = [], []
    for _ in range(rounds):
        course.append(one_cell(course_cell, _env(None)))
        if version:
            acc.append(one_cell(acc_cell, _env(accelerate_target)))
    return {"course": course, "accelerate": acc, "accelerate_version": version, "jax": jax}


def report(res: dict, ranks: int) -> str:
    c = res["course"]
    what = "a function that uses JAX" if res.get("jax") else "a torch function"
    lines = [f"fresh kernel -> first all-reduce result, {what} ({ranks} gloo ranks, one cell, median of {len(c)}): "
             f"course {statistics.median(c):.2f} s  (runs: {', '.join(f'{t:.2f}' for t in c)})"]
    if res["accelerate"]:
        a = res["accelerate"]
        lines.append(f"  accelerate {res['accelerate_version']} notebook_launcher {statistics.median(a):.2f} s  "
                     f"(runs: {', '.join(f'{t:.2f}' for t in a)})")
        lines.append(f"  ratio course / accelerate: {statistics.median(c) / statistics.median(a):.2f}")
    else:
        lines.append("  accelerate: not importable, comparison skipped (pip install --target /tmp/acc accelerate; "
                     "--accelerate-target /tmp/acc)")
    return "\n".join(lines)
