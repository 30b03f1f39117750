"""The same GPT, the same flags, three ways on one GPU: torch eager, torch compiled, JAX -- with the
planner's prediction printed before each run.

    python -m course_lib bench frameworks [--out DIR] [--sizes L12-d1024-b16-s1024,...] [--steps 12] [--profile]

Each run is the capstone a learner runs (``python -m course_lib.train --bf16 [--compile]`` and
``python -m course_lib.train_jax --bf16``) on one device, with identical model flags (head dim 128,
``d_ff = 4d``, vocabulary 32,768); tokens/s is the median step after the first, memory the allocator's peak
(``max_memory_allocated`` / ``peak_bytes_in_use``). Before the runs: the measured ceilings of this GPU (an
8192³ bf16 matmul, a device copy, SDPA's causal attention forward + backward and the kernel it picks), and for
every run the planner's prediction (:func:`course_lib.maths.planner_course_runs.plan_capstone`, published rates
and this host's seconds per CUDA dispatch, calibrated first by :func:`course_lib.bench.host.calibrate`) -- written
down before the run starts. The compiled run sets ``TORCH_LOGS=graph_breaks,recompiles`` and counts both.
``--profile`` then times the kernels of two eager and two compiled steps of the first size, by family.
Writes ``DIR/frameworks.json`` after every run (a run cut short keeps what finished) and prints a table.
``--quick`` runs a tiny model on whatever device there is: a smoke test, not a measurement.

Longer than ~300 lines: one lent GPU session runs it once, so the ceilings, predictions, runs, profile and table
sit in one script that either finishes or leaves its JSON behind.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from course_lib.maths.planner_course_runs import parse_size, plan_capstone

__all__ = ["parse_size", "predict", "main"]

DEFAULT_SIZES = "L12-d1024-b16-s1024,L12-d1024-b2-s8192,L16-d2560-b8-s2048"
RUNS = ("torch", "compiled", "jax")


def planner_gpu(device_name: str):
    """The planner's GPU for a CUDA device name (None: no prediction)."""
    from course_lib.maths import planner
    return next((g for key, g in (("H200", planner.H200), ("H100", planner.H100), ("A100", planner.A100_80GB))
                 if key in device_name), None)


#: the planner's plan of one run (one home: maths/planner_course_runs)
predict = plan_capstone


def ceilings() -> dict:
    """This GPU's measured ceilings: bf16 matmul, device copy, SDPA causal fwd+bwd (and its kernel's name)."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    def timed(fn, reps=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / reps

    out = {}
    n = 8192
    x, y = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out["matmul_tflops"] = 2 * n ** 3 / timed(lambda: x @ y) / 1e12
    big = torch.randn(2 ** 28, device="cuda")           # 1 GiB of fp32
    dst = torch.empty_like(big)
    out["copy_tb_s"] = 2 * big.numel() * 4 / timed(lambda: dst.copy_(big)) / 1e12
    del x, y, big, dst
    for s, b in ((1024, 16), (8192, 2)):
        q, k, v = (torch.randn(b, 8, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, 8, s, 128, device="cuda", dtype=torch.bfloat16)

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        flops = 3.5 * 2 * s * 1024 * b * s             # the papers' count: fwd 2·s·d per token causal, bwd 2.5x
        out[f"sdpa_tflops_s{s}"] = flops / timed(step) / 1e12
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        out[f"sdpa_kernels_s{s}"] = sorted({e.key for e in prof.key_averages() if "flash" in e.key.lower()
                                            or "cudnn" in e.key.lower() or "fmha" in e.key.lower()
                                            or "attention" in e.key.lower()})[:6]
        del q, k, v, g
    torch.cuda.empty_cache()
    names = " ".join(out["sdpa_kernels_s1024"]).lower()
    out["sdpa_backend"] = "cudnn" if "cudnn" in names or "sm90" in names and "fmha" in names else "flash2"
    return out


def _flags(size: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in size.items()] + ["--bf16", "--lr", "1e-4"]


def run_one(size: dict, run: str, steps: int, out_dir: str, tag: str, timeout: float) -> dict:
    """One capstone run in a fresh process; its summary line, plus the compile logs' counts."""
    module = "course_lib.train_jax" if run == "jax" else "course_lib.train"
    argv = [sys.executable, "-m", module, *_flags(size), f"--steps={steps}"]
    argv += ["--compile"] if run == "compiled" else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if run == "compiled":
        env["TORCH_LOGS"] = "graph_breaks,recompiles"
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    log = os.path.join(out_dir, f"log_{tag}_{run}.txt")
    with open(log, "w") as f:
        f.write(" ".join(argv) + "\n--- stdout\n" + p.stdout[-20000:] + "\n--- stderr\n" + p.stderr[-40000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{") and '"summary"' in ln]
    if p.returncode or not lines:
        return {"error": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:] or p.stdout[-300:]}",
                "wall_s": wall}
    r = json.loads(lines[-1])
    r["wall_s"] = wall
    if run == "compiled":
        r["graph_breaks"] = p.stderr.count("Graph break")
        r["recompiles"] = p.stderr.count("Recompiling function")
    return r


def profile_on_rank(size: dict, compile_: bool, steps: int = 2) -> dict:
    """One rank, as ``course_lib.train --bf16 [--compile]`` builds it at world size 1 (the plain module under bf16
    autocast, the chunked loss): GPU kernel time of ``steps`` steps by family."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from course_lib.launch import rank_info
    from course_lib.models import GPTConfig, TokenTask, TorchGPT, fused_loss_fn
    dev = torch.device(rank_info().device)
    cfg = GPTConfig(**{k: v for k, v in size.items() if k != "batch"})
    torch.manual_seed(0)
    model = TorchGPT(cfg).to(dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    if compile_:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x, y = (torch.from_numpy(a).to(dev) for a in TokenTask(cfg.vocab_size, cfg.seq_len, seed=0).rank_batch(
        0, size["batch"], 0, 1))

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(x)
        fused_loss_fn(logits, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    fam: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if not us or e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        k = e.key.lower()
        f = ("attention" if any(w in k for w in ("flash", "fmha", "cudnn", "attention")) else
             "matmul" if any(w in k for w in ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas")) else
             "triton (fused)" if "triton" in k else
             "optimizer" if "adam" in k else
             "loss/softmax" if any(w in k for w in ("softmax", "nll", "cross")) else
             "copy/cast" if any(w in k for w in ("copy", "cat", "memcpy", "memset", "fill")) else "other pointwise")
        fam[f] = fam.get(f, 0.0) + us / 1e3 / steps
        top.append((us / 1e3 / steps, e.key[:90], e.count // steps))
    top.sort(reverse=True)
    return {"wall_ms": wall * 1e3, "gpu_ms": sum(fam.values()), "by_family_ms": fam, "top": top[:12],
            "peak_bytes": torch.cuda.max_memory_allocated(dev)}


def _table(rows: list[dict]) -> str:
    head = (f"{'size':<22}{'run':<10}{'pred tok/s':>12}{'meas tok/s':>12}{'ratio':>7}"
            f"{'pred GiB':>10}{'meas GiB':>10}{'ratio':>7}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        m = r.get("measured") or {}
        p = r.get("predicted") or {}
        tps, gib = m.get("tokens_per_s"), (m.get("peak_bytes") or 0) / 2**30
        pt, pg = p.get("tokens_per_s"), p.get("allocated_gib")
        ratio = lambda a, b: f"{a / b:>7.2f}" if a and b else f"{'':>7}"    # noqa: E731 predicted / measured
        note = m.get("error", "")[:60] or (f"breaks {m['graph_breaks']} recompiles {m['recompiles']}"
                                            if "graph_breaks" in m else "")
        lines.append(f"{r['size']:<22}{r['run']:<10}{(pt or 0):>12,.0f}{(tps or 0):>12,.0f}{ratio(pt, tps)}"
                     f"{(pg or 0):>10.1f}{gib:>10.1f}{ratio(pg, gib)}  {note}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib bench frameworks", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated (default {DEFAULT_SIZES})")
    ap.add_argument("--runs", default=",".join(RUNS), help=f"which of {','.join(RUNS)}")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per run")
    ap.add_argument("--profile", action="store_true", help="kernel time by family, eager and compiled, first size")
    ap.add_argument("--quick", action="store_true", help="tiny model, any device: a smoke test")
    a = ap.parse_args(argv)
    sizes = [parse_size(s, vocab=67 if a.quick else 32768) for s in
             ("L2-d128-b2-s32" if a.quick else a.sizes).split(",")]
    runs = [r for r in a.runs.split(",") if r]
    if bad := [r for r in runs if r not in RUNS]:
        raise SystemExit(f"--runs {bad} unknown: pick from {','.join(RUNS)}")
    os.makedirs(a.out, exist_ok=True)
    import torch
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    out = {"device": name, "torch": torch.__version__, "rows": []}
    gpu = planner_gpu(name) if cuda else None
    out["planner_gpu"] = gpu.name if gpu else None
    attention = "flash2"
    if cuda:
        out["ceilings"] = c = ceilings()
        attention = c["sdpa_backend"]
        print(f"{name}, torch {torch.__version__}: matmul {c['matmul_tflops']:.0f} TFLOP/s, "
              f"copy {c['copy_tb_s']:.2f} TB/s, "
              f"SDPA causal fwd+bwd {c['sdpa_tflops_s1024']:.0f} TFLOP/s at 1K, {c['sdpa_tflops_s8192']:.0f} at 8K "
              f"({attention}: {c['sdpa_kernels_s1024'][:2]})", flush=True)
        if gpu:
            print(f"planner's rates ({gpu.name}): matmul {gpu.matmul_rate(1024) / 1e12:.0f} TFLOP/s at d=1024, "
                  f"attention {gpu.attention_rate(1024, attention) / 1e12:.0f} at 1K, "
                  f"{gpu.attention_rate(8192, attention) / 1e12:.0f} at 8K, "
                  f"HBM {gpu.stream_bytes_per_s / 1e12:.2f} TB/s",
                  flush=True)
    calibration = None
    if cuda and gpu:   # the host's seconds per dispatch on this machine, before any prediction (bench.host)
        from course_lib.bench.host import calibrate
        from course_lib.maths.planner_host import HostCalibration
        r = calibrate(device="cuda", fsdp=False)
        calibration = HostCalibration.from_calibrate(r, "cuda", source=f"bench.host.calibrate('cuda') on {name}")
        out["host_calibration"] = r
        print(f"host: {r['dispatch_s'] * 1e6:.2f} us per CUDA dispatch, {max(0.0, r['step_fixed_s']) * 1e6:.0f} us "
              "fixed per step (bench.host cuda): the planner's host term below", flush=True)
    path = os.path.join(a.out, "frameworks.json")
    for size in sizes:
        tag = "L{n_layers}-d{d_model}-b{batch}-s{seq_len}".format(**size)
        for run in runs:
            row = {"size": tag, "run": run, "config": size}
            if gpu:
                p = predict(size, run, gpu, attention, calibration)
                row["predicted"] = {"tokens_per_s": p.tokens_per_s_per_gpu, "step_s": p.step_s,
                                    "allocated_gib": p.allocated / 2**30, "total_gib": p.total / 2**30,
                                    "parts_s": p.parts, "made_at": time.time()}
                print(f"PREDICT {tag} {run}: {p.tokens_per_s_per_gpu:,.0f} tokens/s, {p.allocated / 2**30:.1f} GiB "
                      f"allocated ({p.summary()})", flush=True)
            row["measured"] = run_one(size, run, a.steps, a.out, tag, a.timeout)
            m = row["measured"]
            print(f"MEASURE {tag} {run}: " + (m["error"] if "error" in m else
                  f"{m['tokens_per_s']:,.0f} tokens/s, {m['peak_bytes'] / 2**30:.1f} GiB peak, wall {m['wall_s']:.0f} s"
                  + (f", graph breaks {m['graph_breaks']}, recompiles {m['recompiles']}" if run == "compiled" else "")),
                  flush=True)
            out["rows"].append(row)
            with open(path, "w") as f:
                json.dump(out, f, indent=1, default=str)
    if a.profile and cuda:
        from course_lib.launch import run as launch
        out["profile"] = {}
        for compiled in (False, True):
            key = "compiled" if compiled else "eager"
            try:
                r = launch(profile_on_rank, sizes[0], compiled, world_size=1, timeout=300)[0]
            except Exception as exc:
                r = {"error": f"{type(exc).__name__}: {str(exc)[-600:]}"}
            out["profile"][key] = r
            if "error" in r:
                print(f"profile {key}: {r['error']}", flush=True)
            else:
                fams = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["by_family_ms"].items(), key=lambda kv: -kv[1]))
                print(f"profile {key} ({sizes[0]['n_layers']}L d{sizes[0]['d_model']}): "
                      f"wall {r['wall_ms']:.1f} ms/step, "
                      f"GPU busy {r['gpu_ms']:.1f} ms: {fams}", flush=True)
                for ms, k, n in r["top"][:6]:
                    print(f"   {ms:7.2f} ms  x{n:<4} {k}", flush=True)
            with open(path, "w") as f:
                json.dump(out, f, indent=1, default=str)
    print(_table(out["rows"]), flush=True)
    jax_torch = [(r["size"], r["measured"]) for r in out["rows"]]
    by = {(r["size"], r["run"]): r["measured"] for r in out["rows"]}
    for tag in dict.fromkeys(t for t, _ in jax_torch):
        t, c, j = (by.get((tag, k), {}) for k in RUNS)
        if t.get("tokens_per_s"):
            bits = [f"{k}/torch: speed {m['tokens_per_s'] / t['tokens_per_s']:.2f}, memory "
                    f"{m['peak_bytes'] / t['peak_bytes']:.2f}" for k, m in (("compiled", c), ("jax", j))
                    if m.get("tokens_per_s") and t.get("peak_bytes")]
            print(f"{tag}: " + "; ".join(bits), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
