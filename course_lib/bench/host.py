"""Seconds per dispatch, measured: the two constants of :mod:`course_lib.maths.planner_host`, from tiny runs here.

    python -m course_lib.bench.host [cuda]   # DISPATCH_S, STEP_FIXED_S, FSDP_UNIT_S for this machine (or its GPU)

A course GPT so small (d 16, 8 tokens) that a training step is nothing but dispatches, at 1 and 3 layers: the
step time's (median of ``reps`` after warm-up) slope over the counted dispatches
(:class:`course_lib.measure.dispatches.DispatchCounter`) is the host's seconds per dispatch, the rest at 1 layer the
step's fixed Python. The same model under FSDP2 at world size 1 (a group of one) makes more dispatches and runs
Python in its hooks: what its step (3 layers: 4 units) takes beyond its dispatches and the fixed part, per unit, is
``FSDP_UNIT_S``. On a GPU box, ``cuda`` runs the tiny model on the GPU, each step ending in a synchronisation:
what a CUDA dispatch costs the host (Python, dispatcher, caching allocator, launch) -- the constants to plan that
GPU's eager steps with (``planner_host.dispatches_per_step(..., dispatch_s=..., ...)``).
"""
from __future__ import annotations

import statistics
import time

__all__ = ["TINY", "tiny_step", "time_step", "calibrate"]

#: the calibration model: every tensor tiny, so the step is its dispatches
TINY = dict(n_layers=1, d_model=16, n_heads=2, d_ff=32, vocab_size=16, seq_len=8, batch=1)


def tiny_step(fsdp: bool = False, device: str = "cpu", **sizes):
    """``(step, cfg)``: one training step of the capstone's model (a ``GPTConfig``), optimizer and fused loss (fp32,
    CPU, or ``device``) at ``TINY`` sizes (or ``sizes``), plain or under FSDP2 over a group of one (the caller owns
    the group). On a GPU the step ends with a synchronisation, so its time is the host's issuing of every kernel."""
    import torch
    from course_lib.models import GPTConfig, TokenTask, TorchGPT, fused_loss_fn, torch_init_
    sizes = {**TINY, **sizes}
    batch = sizes.pop("batch")
    mcfg = cfg = GPTConfig(**sizes)
    with torch.device("meta"):
        model = TorchGPT(mcfg)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from course_lib.strategies.fsdp.torch import shard_gpt
        shard_gpt(model, init_device_mesh(torch.device(device).type, (1,)))
    model.to_empty(device=device)
    torch_init_(model, mcfg, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = (torch.from_numpy(a) for a in TokenTask(mcfg.vocab_size, mcfg.seq_len).rank_batch(0, batch, 0, 1))
    x, y = x.to(device), y.to(device)
    cuda = torch.device(device).type == "cuda"

    def step():
        loss = fused_loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return loss
    return step, cfg


def time_step(step, reps: int = 30, warmup: int = 5) -> float:
    """Median seconds of ``step()`` over ``reps`` calls after ``warmup`` (CPU: every op is done when it returns)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _counted_and_timed(step, reps):
    from course_lib.measure.dispatches import count_dispatches
    step()
    step()                               # warm: AdamW's state exists
    return count_dispatches(step)[1].total, time_step(step, reps)


def calibrate(reps: int = 30, fsdp: bool = True, device: str = "cpu") -> dict:
    """``{"dispatch_s", "step_fixed_s", ...}`` from the tiny plain step at 1 and 3 layers; with ``fsdp`` also
    ``"fsdp_unit_s"`` (needs no process group of the caller's: one is made over a ``HashStore`` and destroyed)."""
    import torch
    torch.set_num_threads(1)
    step, cfg = tiny_step(device=device)
    n, t = _counted_and_timed(step, reps)
    n3, t3 = _counted_and_timed(tiny_step(n_layers=3, device=device)[0], reps)
    per = (t3 - t) / (n3 - n)
    out = {"dispatch_s": per, "step_fixed_s": t - n * per, "dispatches": n, "step_s": t, "dispatches_3": n3,
           "step_s_3": t3}
    if fsdp:
        import torch.distributed as dist
        cuda = torch.device(device).type == "cuda"     # FSDP2's collectives on CUDA tensors need NCCL
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            nf, tf = _counted_and_timed(tiny_step(fsdp=True, n_layers=3, device=device)[0], reps)
        finally:
            dist.destroy_process_group()
        units = 3 + 1                    # every block and the root
        out.update(fsdp_dispatches=nf, fsdp_step_s=tf,
                   fsdp_unit_s=(tf - nf * per - out["step_fixed_s"]) / units)
    return out


if __name__ == "__main__":
    import sys
    r = calibrate(device=sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print(f"tiny course GPT step: {r['dispatches']} dispatches in {r['step_s'] * 1e3:.3f} ms, 3 layers "
          f"{r['dispatches_3']} in {r['step_s_3'] * 1e3:.3f} ms -> DISPATCH_S = {r['dispatch_s'] * 1e6:.2f} us, "
          f"STEP_FIXED_S = {r['step_fixed_s'] * 1e6:.0f} us; FSDP2 at world size 1: {r['fsdp_dispatches']} "
          f"dispatches in "
          f"{r['fsdp_step_s'] * 1e3:.3f} ms -> FSDP_UNIT_S = {r['fsdp_unit_s'] * 1e6:.0f} us per unit")
