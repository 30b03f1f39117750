"""A real timeline: ``torch.profiler`` around FSDP2 steps, a Chrome/Perfetto trace file, and what overlapped.

    python -m course_lib bench timeline [--ranks 2] [--width 128] [--layers 4] [--steps 2] [--prefetch ...]
                                        [--out /tmp/fsdp_trace.json]

:func:`profile_on_rank` runs FSDP2 training steps under ``torch.profiler.profile`` on every rank and writes
rank 0's trace with ``export_chrome_trace`` -- a JSON file that https://ui.perfetto.dev (or
``chrome://tracing``) opens. :func:`classify` reads a trace back into two sets of intervals:

* **compute** -- CPU: the ``aten::`` ops of the thread that runs the model (the one with the most events);
  GPU: every CUDA kernel that is not NCCL's.
* **communication** -- CPU: gloo's own work (``gloo:all_gather``, ``gloo:all_reduce``, ...), which gloo runs
  on *background threads*; GPU: NCCL kernels, which FSDP2 launches on its own CUDA streams.

:func:`overlap_stats` then splits the communication time into **overlapped** (something computed at the
same moment) and **exposed** (nothing did: the step waited for the network). What CPU shows, honestly: gloo's
threads run beside the compute thread, so intervals can overlap on the clock, but they share the machine's
few cores with the compute threads of every rank -- and CPU "streams" are no-ops -- so overlap on a laptop
is small and buys little. On a GPU the NCCL kernels run on their own stream next to compute kernels (the
FSDP paper's figure of one training step: Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded
Data Parallel", VLDB 2023).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

__all__ = ["PREFETCH", "profile_on_rank", "load_events", "classify", "union", "measure_of", "intersect",
           "overlap_stats", "OverlapStats", "plot_timeline", "main"]

#: prefetch settings :func:`profile_on_rank` understands: FSDP2's default (one unit ahead in backward,
#: forward all-gathers issued as units are reached), two units ahead both ways, or none at all.
PREFETCH = ("default", "two", "none")


def _set_prefetch(model, how: str) -> None:
    blocks = list(model.blocks)
    for i, b in enumerate(blocks):
        if how == "two":
            b.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
            b.set_modules_to_backward_prefetch(blocks[max(i - 2, 0):i][::-1])
        elif how == "none":
            b.set_modules_to_forward_prefetch([])
            b.set_modules_to_backward_prefetch([])


def profile_on_rank(cfg, local_batch: int, steps: int = 2, prefetch: str = "default",
                    reshard_after_forward: bool = True, trace_path: str | None = None, warmup: int = 1,
                    dtype=None, device: str | None = None) -> dict:
    """Every rank: FSDP2 on the course GPT (bottom-up ``fully_shard``), ``warmup`` steps, then ``steps`` profiled
    steps. Rank 0 writes the Chrome trace to ``trace_path``. ``device`` overrides the rank's own device
    (``"cuda:0"`` lets two gloo ranks share one GPU: FSDP2's CUDA streams, gloo's host-side transfers). Returns ``{"stats": overlap_stats(...) as dict,
    "step_s": wall seconds per profiled step}`` from this rank's own trace."""
    import os
    import tempfile
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from course_lib.comm import torch_ledger as lt
    from course_lib.launch import rank_info
    from course_lib.models import TokenTask, TorchGPT, loss_fn, torch_init_
    from course_lib.strategies.fsdp.torch import shard_gpt
    if prefetch not in PREFETCH:
        raise ValueError(f"prefetch={prefetch!r} must be one of {PREFETCH}")
    dev = torch.device(device or rank_info().device)   # device="cuda:0": gloo ranks sharing one GPU
    r, n = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = TorchGPT(cfg)
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if dev.type == "cuda" and dist.get_backend() != "nccl":   # gloo ranks sharing a GPU: gloo for CUDA tensors too
        from torch.distributed.device_mesh import DeviceMesh
        mesh = DeviceMesh.from_group(dist.new_group(list(range(n)), backend="cpu:gloo,cuda:gloo"), "cuda")
    else:
        mesh = init_device_mesh(dev.type, (n,))
    shard_gpt(model, mesh, **kwargs)
    model.to_empty(device=dev)
    torch_init_(model, cfg, seed=0)
    _set_prefetch(model, prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = (torch.from_numpy(a).to(dev) for a in TokenTask(cfg.vocab_size, cfg.seq_len, seed=0).rank_batch(
        0, local_batch * n, r, n))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def step(k):
        lt.set_step(k)                   # the ledger's step k: warm-up steps first, then the profiled ones
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for k in range(warmup):
        step(k)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    prof = profile(activities=acts)
    with _quiet():                      # kineto prints a line at every start and stop, straight to the fds
        prof.__enter__()
    t0 = time.perf_counter()
    for k in range(warmup, warmup + steps):
        step(k)
    sync()
    wall = (time.perf_counter() - t0) / steps
    with _quiet():
        prof.__exit__(None, None, None)
    path = trace_path if (trace_path and r == 0) else os.path.join(tempfile.mkdtemp(), f"trace_rank{r}.json")
    prof.export_chrome_trace(path)
    stats = overlap_stats(classify(load_events(path), gpu=dev.type == "cuda"))
    return {"stats": stats.as_dict(), "step_s": wall}


class _quiet:
    """Silence the process's own stdout/stderr file descriptors (C++ prints bypass Python's sys.stdout)."""

    def __enter__(self):
        import os
        import sys
        sys.stdout.flush(), sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1), os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc):
        import os
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        return False


# -- reading a trace -----------------------------------------------------------------------------------
def load_events(path: str) -> list[dict]:
    """The complete ("X") events of a Chrome trace file: name, thread, start and duration in µs."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _is_comm(name: str) -> bool:
    low = name.lower()
    return low.startswith("gloo:") or "nccl" in low


def classify(events: list[dict], gpu: bool = False) -> dict[str, list[tuple[float, float]]]:
    """``{"compute": [(start_us, end_us), ...], "comm": [...]}`` from trace events (see the module doc)."""
    out = {"compute": [], "comm": []}
    if gpu:   # compute: kernels; comm: NCCL kernels, or gloo's host-side work when gloo carries CUDA tensors
        for e in events:
            if e.get("cat") == "kernel" or e["name"].lower().startswith("gloo:"):
                out["comm" if _is_comm(e["name"]) else "compute"].append((e["ts"], e["ts"] + e["dur"]))
        return out
    counts: dict = {}
    for e in events:
        if e.get("cat") == "cpu_op":
            counts[e.get("tid")] = counts.get(e.get("tid"), 0) + 1
    main_tid = max(counts, key=counts.get) if counts else None
    for e in events:
        iv = (e["ts"], e["ts"] + e["dur"])
        if _is_comm(e["name"]):
            out["comm"].append(iv)
        elif e.get("tid") == main_tid and e["name"].startswith("aten::"):
            out["compute"].append(iv)
    return out


def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals`` (nested ops merge)."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def measure_of(intervals) -> float:
    """Total time covered (each instant once)."""
    return sum(e - s for s, e in union(intervals))


def intersect(a, b) -> list[tuple[float, float]]:
    """The instants in both ``a`` and ``b``."""
    a, b, out, i, j = union(a), union(b), [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class OverlapStats:
    """Seconds, from one trace: how much communication compute hid."""

    compute_s: float
    comm_s: float
    overlapped_s: float
    span_s: float             #: first event to last

    @property
    def exposed_s(self) -> float:
        return self.comm_s - self.overlapped_s

    @property
    def overlap_fraction(self) -> float:
        return self.overlapped_s / self.comm_s if self.comm_s else 0.0

    def as_dict(self) -> dict:
        return {"compute_s": self.compute_s, "comm_s": self.comm_s, "overlapped_s": self.overlapped_s,
                "span_s": self.span_s}


def overlap_stats(iv: dict) -> OverlapStats:
    """Compute time, communication time, and their intersection (all unions, in seconds)."""
    allv = iv["compute"] + iv["comm"]
    span = (max(e for _, e in allv) - min(s for s, _ in allv)) if allv else 0.0
    return OverlapStats(measure_of(iv["compute"]) / 1e6, measure_of(iv["comm"]) / 1e6,
                        measure_of(intersect(iv["compute"], iv["comm"])) / 1e6, span / 1e6)


def plot_timeline(iv: dict, title: str = "", ax=None):
    """Two lanes on one time axis: compute, and communication coloured by exposed (red) or overlapped (green)."""
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.8))
    allv = iv["compute"] + iv["comm"]
    t0 = min(s for s, _ in allv) if allv else 0.0
    ms = lambda ivs: [((s - t0) / 1e3, (e - s) / 1e3) for s, e in union(ivs)]  # noqa: E731
    over = intersect(iv["compute"], iv["comm"])
    ax.broken_barh(ms(iv["compute"]), (10, 8), color="#1f77b4")
    ax.broken_barh(ms(iv["comm"]), (0, 8), color="#d62728")
    ax.broken_barh(ms(over), (0, 8), color="#2ca02c")
    ax.set_yticks([4, 14], ["comm", "compute"])
    ax.set_xlabel("ms (red: exposed communication, green: overlapped with compute)")
    ax.set_title(title, fontsize=10)
    return ax


def main(argv=None) -> int:
    from course_lib.launch import run
    from course_lib.models.config import GPTConfig
    ap = argparse.ArgumentParser(prog="python -m course_lib bench timeline", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2, help="profiled steps (after one warm-up step)")
    ap.add_argument("--prefetch", nargs="+", choices=PREFETCH, default=list(PREFETCH), help="which variants to run")
    ap.add_argument("--out", default="/tmp/fsdp_trace.json", help="each variant writes OUT with _<prefetch> before .json")
    a = ap.parse_args(argv)
    cfg = GPTConfig(vocab_size=67, seq_len=64, d_model=a.width, n_heads=4, n_layers=a.layers, d_ff=4 * a.width)
    for how in a.prefetch:
        path = a.out.replace(".json", f"_{how}.json")
        res = run(profile_on_rank, cfg, a.batch, a.steps, how, True, path, world_size=a.ranks, timeout=300)
        s = OverlapStats(**res[0]["stats"])
        print(f"prefetch={how:<8} step {res[0]['step_s'] * 1e3:6.1f} ms: compute {s.compute_s * 1e3:6.1f} ms, comm "
              f"{s.comm_s * 1e3:6.1f} ms, overlapped {s.overlapped_s * 1e3:6.1f} ms ({s.overlap_fraction:.0%}), "
              f"exposed {s.exposed_s * 1e3:6.1f} ms  -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
