"""Benchmark our from-scratch FSDP (:mod:`course_lib.strategies.fsdp.scratch`) against FSDP2 (``fully_shard``) and DDP.

    python -m course_lib bench fsdp [--ranks 4] [--steps 20] [--warmup 3] [--batch 8]
                                    [--d-model 66] [--layers 3] [--d-ff 199] [--seq-len 31]

The same tiny GPT (awkward sizes: every unit pads), the same data, the same AdamW on every rank. Each
strategy runs ``warmup`` steps, then ``steps`` timed steps; a step's time is the slowest rank's
(ranks meet at an unrecorded barrier before each step). Reported per rank: the median step time,
the peak of live tensor memory over 2 more steps (CPU: ``memory_meter.MemoryMeter``, which slows ops down, so
it never runs while timing; CUDA: ``max_memory_allocated``), the model
state kept between steps (parameters + gradients + AdamW state), and the ledger of one step against
the analytic formula (:func:`costs.step_cost`: ``padding="flat"`` for ours, ``"dim0"`` for FSDP2).

With DDP among them, every strategy warms up for at least 2 steps whatever ``--warmup`` says: DDP's reducer
rebuilds the gradient buckets in the *second* step, in the order the gradients arrived, and broadcasts that order
from rank 0 (two small broadcasts, 76 B at 2 ranks), once. The timed steps are the steady state, as for the FSDPs.

Both FSDPs reshard every unit after forward (FSDP2's root is told ``reshard_after_forward=True``,
its default would keep the root unsharded), so both move ``3(N-1)/N · Ψpad`` bytes per step.
4 gloo ranks on this machine; with one GPU per rank the same command runs with NCCL
(:func:`devices.choose_backend`). Timings on a shared CPU are noisy: read them, never assert them.
"""
from __future__ import annotations

import argparse
import statistics

from course_lib.maths import costs
from course_lib import launch
from course_lib.maths import memory
from course_lib.models import GPTConfig
from course_lib.strategies.fsdp.torch import IMPLEMENTATIONS, build

DDP_MIN_WARMUP = 2   #: DDP's reducer rebuilds its buckets in step 2 (a broadcast of their order): never timed


def bench_rank(strategy: str, cfg: GPTConfig, steps: int, warmup: int, batch: int, prefetch: bool = False,
               memory_steps: int = 2) -> dict:
    """Run on every rank (``launch.run``): time ``steps`` training steps of ``strategy``, then measure
    memory over ``memory_steps`` more (the CPU meter slows every op down, so it never runs while timing)."""
    import time

    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.models.data import TokenTask
    from course_lib.measure.memory import MemoryMeter, model_state
    from course_lib.launch import rank_info
    from course_lib.models import loss_fn
    info = rank_info()
    device = torch.device(info.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model, units = build(strategy, cfg, device, prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    total = warmup + steps + memory_steps
    batches = [tuple(torch.from_numpy(a).to(device) for a in task.rank_batch(s, batch, info.rank, info.world_size))
               for s in range(total)]
    meter = MemoryMeter()
    times, losses, state = [], [], None
    for s, (x, y) in enumerate(batches):
        timed, metered = warmup <= s < warmup + steps, s >= warmup + steps
        with lt.paused():
            dist.barrier()
        if s == warmup:
            lt.recorder().reset()
        if s == warmup + steps:
            meter.track(list(model.parameters()), list(opt.state.values()))
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
        lt.set_step(s - warmup if timed else None)
        t0 = time.perf_counter()
        with meter if (metered and not cuda) else _null():
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            if s == total - 1:
                state = model_state(model, opt)   # gradients still held: the 16Ψ/N moment
            opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(device)
        if timed:
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if cuda else meter.peak
    return {"times": times, "losses": losses, "peak": peak, "state": state, "units": units}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure(strategy: str, cfg: GPTConfig, *, ranks: int = 4, steps: int = 20, warmup: int = 3,
            batch: int = 8, prefetch: bool = False, timeout: float = 300) -> dict:
    """One strategy, all ranks: median step time, memory and the ledger against the formula."""
    if strategy == "ddp":
        warmup = max(warmup, DDP_MIN_WARMUP)   # past the reducer's one-time bucket rebuild (module docstring)
    out = launch.run(bench_rank, strategy, cfg, steps, warmup, batch, prefetch, world_size=ranks, timeout=timeout)
    n = ranks
    step_times = [max(r["times"][i] for r in out) for i in range(steps)]  # the slowest rank sets the pace
    one_step = out.ledger.filter(rank=0, step=steps // 2)
    units = out[0]["units"]
    if strategy == "ddp":
        analytic = costs.step_cost("dp", units, n)
    else:
        analytic = costs.step_cost("fsdp", units, n, padding="flat" if strategy == "ours" else "dim0")
    measured = costs.ledger_wire_bytes(one_step)
    state_formula = memory.state_bytes("dp" if strategy == "ddp" else "fsdp", analytic.psi_padded, n).total
    return {
        "strategy": strategy, "median_s": statistics.median(step_times),
        "peak": max(r["peak"] for r in out), "state": out[0]["state"].total, "state_formula": state_formula,
        "counts": dict(one_step.counts()), "wire": measured, "formula": analytic.wire_bytes,
        "ratio": costs.ratio(measured, analytic.wire_bytes), "losses": out[0]["losses"],
        "psi": analytic.psi, "psi_padded": analytic.psi_padded, "backend": out.backend,
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'strategy':<9}{'median ms':>10}{'peak KiB':>10}{'state KiB':>10}{'/16Ψ/N':>8}  {'AG':>3}{'RS':>3}"
            f"{'AR':>3}{'wire B/step':>13}{'formula B':>12}{'ratio':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r["counts"]
        lines.append(f"{r['strategy']:<9}{r['median_s'] * 1e3:>10.2f}{r['peak'] / 1024:>10.1f}{r['state'] / 1024:>10.1f}"
                     f"{r['state'] / r['state_formula']:>8.4f}  "
                     f"{c.get('all_gather', 0):>3}{c.get('reduce_scatter', 0):>3}{c.get('all_reduce', 0):>3}"
                     f"{r['wire']:>13,.0f}{r['formula']:>12,.0f}{r['ratio']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib bench fsdp", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per strategy")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over ranks")
    ap.add_argument("--d-model", type=int, default=66)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--d-ff", type=int, default=199, help="prime: every block's flat parameter pads")
    ap.add_argument("--seq-len", type=int, default=31, help="prime: the root's flat parameter pads")
    ap.add_argument("--vocab", type=int, default=67)
    ap.add_argument("--prefetch", action="store_true", help="prefetch the next unit in both FSDPs")
    ap.add_argument("--only", nargs="+", choices=IMPLEMENTATIONS, default=list(IMPLEMENTATIONS))
    a = ap.parse_args(argv)
    cfg = GPTConfig(vocab_size=a.vocab, seq_len=a.seq_len, d_model=a.d_model, n_heads=a.heads,
                    n_layers=a.layers, d_ff=a.d_ff)
    # With DDP in the race every strategy warms up past DDP's bucket rebuild: the losses below are then one step's
    warmup = max(a.warmup, DDP_MIN_WARMUP) if "ddp" in a.only else a.warmup
    rows = [measure(s, cfg, ranks=a.ranks, steps=a.steps, warmup=warmup, batch=a.batch, prefetch=a.prefetch)
            for s in a.only]
    r0 = rows[0]
    asked = f" (--warmup {a.warmup} asked: DDP rebuilds its buckets in step 2)" if warmup != a.warmup else ""
    print(f"FSDP benchmark: {a.ranks} ranks ({r0['backend']}), {cfg}, global batch {a.batch}, "
          f"{a.steps} timed steps after {warmup} warm-up{asked}, prefetch={'on' if a.prefetch else 'off'}")
    print(f"Ψ = {r0['psi']:,} parameters; wire bytes are rank 0's, ring formulas (costs.wire_bytes); state = "
          "parameters + gradients + AdamW m, v (+ step counters) on rank 0, against 16·Ψpad/N (DDP: 16·Ψ)")
    print(format_table(rows))
    by = {r["strategy"]: r for r in rows}
    if "ours" in by and "fsdp2" in by:
        o, f = by["ours"], by["fsdp2"]
        print(f"ours / FSDP2: step time {o['median_s'] / f['median_s']:.2f}x, peak memory {o['peak'] / f['peak']:.2f}x, "
              f"wire bytes {o['wire'] / f['wire']:.4f}x (flat padding {o['psi_padded']:,} vs dim-0 padding "
              f"{f['psi_padded']:,} elements)")
        print(f"losses, last timed step: ours {o['losses'][-1]:.6f}, FSDP2 {f['losses'][-1]:.6f}"
              + (f", DDP {by['ddp']['losses'][-1]:.6f}" if "ddp" in by else ""))
    bad = [r["strategy"] for r in rows if abs(r["ratio"] - 1) > 1e-9]
    if bad:
        print(f"ledger != formula for: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
