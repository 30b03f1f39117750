"""FSDP2's CPU offload on one GPU, measured: step time, GPU memory, bytes over PCIe, and what ``zero_grad`` leaves.

    python -m course_lib.bench.offload [--layers 8] [--width 1024] [--batch 8] [--seq-len 1024] [--steps 6]

The FSDP2 article (*Getting Started with Fully Sharded Data Parallel (FSDP2)*) says CPU offload is "noticeably
slower" and that it "zeros out gradients instead of None". This runs the course GPT under ``fully_shard`` at world
size 1 (a group of one over NCCL) twice -- without and with ``offload_policy=CPUOffloadPolicy()`` -- in bf16
(``MixedPrecisionPolicy``), fused-free AdamW (the offloaded parameters live on the CPU, so the optimizer steps there),
and prints per run: the median step (after one warm-up), the allocator's peak, and the formula's bytes over the
host link per step: every parameter copied in for forward and again for backward (``2·Ψ·4`` bytes, fp32 shards
cast on the GPU), every gradient copied out (``Ψ·4``). After ``zero_grad(set_to_none=True)`` it reports whether the
gradients are ``None`` or tensors of zeros. Needs a CUDA GPU (Lab 04 says so and shows the formula on a laptop);
``--quick`` prints what it would run and exits 0 on a machine without one. Writes ``DIR/offload.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

__all__ = ["link_bytes_per_step", "main"]


def link_bytes_per_step(n_params: int, param_bytes: int = 4) -> int:
    """Bytes over the host link per step under CPU offload: parameters in for forward and for backward, gradients
    out (each shard of ``param_bytes`` per element; the optimizer's states never leave the CPU)."""
    return 3 * n_params * param_bytes


def _run(cfg, batch: int, steps: int, offload: bool, device) -> dict:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from course_lib.models import TokenTask, TorchGPT, fused_loss_fn, torch_init_
    torch.cuda.reset_peak_memory_stats(device)
    with torch.device("meta"):
        model = TorchGPT(cfg)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    model.to_empty(device="cpu" if offload else device)
    torch_init_(model, cfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x, y = (torch.from_numpy(a).to(device) for a in TokenTask(cfg.vocab_size, cfg.seq_len).rank_batch(0, batch, 0, 1))
    times = []
    for _ in range(steps + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fused_loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    # what zero_grad(set_to_none=True) left: None, or tensors (of zeros)
    grads = [p.grad for p in model.parameters()]
    none = sum(g is None for g in grads)
    zeros = sum(g is not None and not bool(g.to_local().count_nonzero() if hasattr(g, "to_local")
                                           else g.count_nonzero()) for g in grads)
    n = sum(p.numel() for p in model.parameters())
    out = {"offload": offload, "step_s": statistics.median(times[1:]), "peak_gpu_bytes":
           torch.cuda.max_memory_allocated(device), "params": n, "link_bytes_formula": link_bytes_per_step(n),
           "grads_none": none, "grads_zero_tensors": zeros, "grads_total": len(grads),
           "param_device": str(next(model.parameters()).device)}
    del model, opt
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib.bench.offload", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="on a machine without a GPU: say so and exit 0")
    a = ap.parse_args(argv)
    import torch
    from course_lib.models import GPTConfig
    cfg = GPTConfig(n_layers=a.layers, d_model=a.width, n_heads=max(1, a.width // 128), d_ff=4 * a.width,
                    vocab_size=32768, seq_len=a.seq_len)
    if not torch.cuda.is_available():
        print(f"course_lib.bench.offload: CPU offload moves shards between a GPU and its host; this machine has no "
              f"CUDA GPU, so nothing is measured (the model would be L{a.layers} d{a.width}, batch {a.batch}x"
              f"{a.seq_len}). Run it on a GPU machine.")
        return 0 if a.quick else 2
    import torch.distributed as dist
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    rows = []
    try:
        for offload in (False, True):
            r = _run(cfg, a.batch, a.steps, offload, device)
            rows.append(r)
            print(f"{'CPU offload' if offload else 'on the GPU '}: step {r['step_s'] * 1e3:.1f} ms, GPU peak "
                  f"{r['peak_gpu_bytes'] / 2**30:.2f} GiB, params on {r['param_device']}, after zero_grad: "
                  f"{r['grads_none']} of {r['grads_total']} grads None, {r['grads_zero_tensors']} zero tensors; "
                  f"formula: {r['link_bytes_formula'] / 2**30:.2f} GiB over the host link per step"
                  + (" (not moved: no offload)" if not offload else ""), flush=True)
    finally:
        dist.destroy_process_group()
    if len(rows) == 2:
        slow = rows[1]["step_s"] / rows[0]["step_s"]
        print(f"offload / GPU: step time {slow:.2f}x, GPU peak {rows[1]['peak_gpu_bytes'] / rows[0]['peak_gpu_bytes']:.2f}x;"
              f" the link moved >= {rows[1]['link_bytes_formula'] / rows[1]['step_s'] / 1e9:.1f} GB/s on average "
              f"(formula bytes / step)", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "offload.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                   "config": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
