"""The same run on a real GPU: the course GPT scaled up to fill one GPU, FSDP2 + bf16 + ``torch.compile``.

    python -m course_lib bench gpu-mfu [--out DIR] [--layers 24] [--width 2048] [--batch 8] [--quick]

On one GPU (world size 1, NCCL): ``fully_shard`` bottom-up with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, AdamW, eager and then compiled (``torch.compile`` on each block *after* sharding, as
the FSDP2 tutorial says). Reports tokens/s and **MFU** = tokens/s · FLOPs per token / peak, with FLOPs per
token from :func:`course_lib.maths.flops.model_flops_per_token` (6N + attention, as PaLM's appendix B counts:
the same MFU ``course_lib.train`` reports) and the peak from the datasheet
(:func:`course_lib.maths.planner_hw.peak_flops`; H100 SXM: 989 TFLOP/s dense bf16); also against a measured
8192³ bf16 matmul.
Then profiles two eager steps (:func:`course_lib.bench.timeline.profile_on_rank`) and writes the Chrome trace.
Results go to ``DIR/gpu_results.json``. ``--quick`` runs a tiny model on whatever device there is (a smoke
test of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

__all__ = ["train_on_rank", "matmul_tflops", "main"]


def matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 matmul rate (TFLOP/s) of an ``n³`` product on random data, after 3 warm-ups."""
    import torch
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def train_on_rank(cfg, batch: int, steps: int, compile_: bool, warmup: int = 3) -> dict:
    """One rank: FSDP2 + bf16 (+ compile) on ``cfg``; median step seconds, tokens/s, peak memory, last loss."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from course_lib.launch import rank_info
    from course_lib.models import TokenTask, TorchGPT, loss_fn, torch_init_
    from course_lib.strategies.fsdp.torch import shard_gpt
    dev = torch.device(rank_info().device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TorchGPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_gpt(model, init_device_mesh(dev.type, (dist.get_world_size(),)), mp_policy=mp)
    model.to_empty(device=dev)
    with torch.no_grad():                       # numpy init of a 1B model is slow: torch's RNG instead
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_f"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if compile_:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    x, y = (torch.from_numpy(a).to(dev) for a in task.rank_batch(0, batch, 0, 1))
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    times, loss = [], None
    for s in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"median_s": med, "spread": max(times) / min(times), "tokens_per_s": batch * cfg.seq_len / med,
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else 0, "loss": loss.item()}


def main(argv=None) -> int:
    import torch

    from course_lib.bench import timeline
    from course_lib.launch import run
    from course_lib.maths.planner_hw import peak_flops
    from course_lib.maths.step_model import train_flops
    from course_lib.models.config import GPTConfig, param_count
    ap = argparse.ArgumentParser(prog="python -m course_lib bench gpu-mfu", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="tiny model, any device: a smoke test")
    ap.add_argument("--overlap-only", action="store_true", help="only the 2-rank timeline on one GPU")
    a = ap.parse_args(argv)
    if a.quick:
        a.layers, a.width, a.batch, a.seq_len, a.steps = 2, 64, 2, 32, 2
    cfg = GPTConfig(vocab_size=32768 if not a.quick else 67, seq_len=a.seq_len, d_model=a.width,
                    n_heads=max(1, a.width // 128), n_layers=a.layers, d_ff=4 * a.width)
    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = peak_flops(name) if cuda else None
    out = {"device": name, "torch": torch.__version__, "config": cfg.__dict__, "params": param_count(cfg),
           "peak_datasheet": peak, "flops_per_step": train_flops(cfg, a.batch * cfg.seq_len)}
    if cuda:
        out["matmul_tflops"] = matmul_tflops()
        print(f"{name}, torch {torch.__version__}: 8192^3 bf16 matmul {out['matmul_tflops']:.0f} TFLOP/s", flush=True)
    print(f"GPT {param_count(cfg) / 1e9:.2f}B parameters, {cfg}, batch {a.batch} x {cfg.seq_len}", flush=True)
    for compiled in (() if a.overlap_only else (False, True)):
        key = "compiled" if compiled else "eager"
        try:
            r = run(train_on_rank, cfg, a.batch, a.steps, compiled, world_size=1, timeout=580)[0]
        except Exception as exc:        # report, keep going: the trace is still worth having
            out[key] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(f"{key}: {out[key]['error']}", flush=True)
            continue
        r["mfu"] = out["flops_per_step"] / r["median_s"] / peak if peak else None
        r["of_matmul"] = out["flops_per_step"] / r["median_s"] / 1e12 / out["matmul_tflops"] if cuda else None
        out[key] = r
        print(f"{key:>8}: step {r['median_s'] * 1e3:.1f} ms (spread {r['spread']:.2f}), {r['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {r['mfu'] if r['mfu'] is None else format(r['mfu'], '.1%')}, peak memory "
              f"{r['peak_bytes'] / 2**30:.1f} GiB, loss {r['loss']:.3f}", flush=True)
    tcfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=cfg.n_heads,
                     n_layers=min(cfg.n_layers, 4), d_ff=cfg.d_ff)
    path = os.path.join(a.out, "gpu_trace.json")
    res = run(timeline.profile_on_rank, tcfg, max(1, a.batch // 2), 2, "default", True, path, 1,
              torch.bfloat16, world_size=1, timeout=300)[0]
    out["timeline"] = res
    s = timeline.OverlapStats(**res["stats"])
    print(f"timeline ({tcfg.n_layers} layers, eager): compute {s.compute_s * 1e3:.1f} ms, comm {s.comm_s * 1e3:.2f} ms, "
          f"overlapped {s.overlapped_s * 1e3:.2f} ms ({s.overlap_fraction:.0%}) -> {path}", flush=True)
    if cuda:   # two gloo ranks on the one GPU: FSDP2's all-gathers run on their own CUDA streams
        path2 = os.path.join(a.out, "gpu_trace_2ranks.json")
        try:
            res = run(timeline.profile_on_rank, tcfg, max(1, a.batch // 4), 2, "default", True, path2, 1,
                      torch.bfloat16, "cuda:0", world_size=2, backend="gloo", timeout=300)[0]
            out["timeline_2ranks"] = res
            s = timeline.OverlapStats(**res["stats"])
            print(f"timeline, 2 gloo ranks on one GPU: GPU compute {s.compute_s * 1e3:.1f} ms, gloo {s.comm_s * 1e3:.2f} ms, "
                  f"overlapped {s.overlapped_s * 1e3:.2f} ms ({s.overlap_fraction:.0%}) -> {path2}", flush=True)
        except Exception as exc:
            out["timeline_2ranks"] = {"error": f"{type(exc).__name__}: {str(exc)[:800]}"}
            print("2-rank timeline:", out["timeline_2ranks"]["error"], flush=True)
    with open(os.path.join(a.out, "gpu_results.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
