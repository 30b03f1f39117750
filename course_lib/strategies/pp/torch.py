"""Pipeline parallel in PyTorch: a schedule run from scratch with point-to-point ``send``/``recv``, and the same
model through ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B`` /
``ScheduleInterleaved1F1B``), on any backend (gloo on CPU).

From scratch (:func:`run_schedule`): stage s owns a slice of the model's layers. For ``("F", i)`` it receives
micro-batch i's activations from stage s-1 (stage 0 takes the micro-batch itself), runs its layers and sends the
output to stage s+1 (the last stage computes the loss instead). For ``("B", i)`` it receives the gradient of that
output from stage s+1 (the last stage starts from its loss), back-propagates through its layers and sends the
gradient of its input to stage s-1. Sends are ``isend`` (never block on a neighbour that is busy), receives block:
the order of ops is the schedule. Gradients accumulate over the micro-batches; each micro-batch's loss is divided
by m, so the sum equals the loss of the whole batch. Naive on purpose: no overlap of the receive with compute, one
tensor per message, as the from-scratch pipeline of picotron does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from course_lib.strategies.pp.schedule import Op, orders

__all__ = ["PipeConfig", "pipe_model", "stage_layers", "run_schedule", "reference_grads", "scratch_step",
           "pipelining_step", "microbatches"]


@dataclass(frozen=True)
class PipeConfig:
    """The lab's pipeline: ``layers`` Linear+Tanh blocks of width ``d`` cut into ``p`` equal stages."""
    d: int = 64              #: width of every layer
    layers: int = 8          #: blocks in the whole model; each stage gets layers // p
    p: int = 4               #: stages (= ranks)
    m: int = 8               #: micro-batches per step
    batch: int = 32          #: rows per step; each micro-batch gets batch // m
    seed: int = 0

    def __post_init__(self):
        if self.p < 1 or self.m < 1 or self.d < 1:
            raise ValueError(f"p={self.p}, m={self.m} and d={self.d} must be >= 1")
        if self.layers % self.p:
            raise ValueError(f"layers({self.layers}) % p({self.p}) != 0: every stage needs the same number of "
                             f"layers; use layers a multiple of {self.p}")
        if self.batch % self.m:
            raise ValueError(f"batch({self.batch}) % m({self.m}) != 0: micro-batches must be equal; use a batch "
                             f"that is a multiple of {self.m}")


def pipe_model(cfg: PipeConfig) -> nn.Sequential:
    """The whole model, the same on every rank (seeded): ``layers`` x (Linear(d, d), Tanh)."""
    g = torch.Generator().manual_seed(cfg.seed)
    blocks = []
    for _ in range(cfg.layers):
        lin = nn.Linear(cfg.d, cfg.d)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(cfg.d, cfg.d, generator=g) / cfg.d ** 0.5)
            lin.bias.copy_(torch.randn(cfg.d, generator=g) * 0.1)
        blocks += [lin, nn.Tanh()]
    return nn.Sequential(*blocks)


def stage_layers(model: nn.Sequential, stage: int, p: int) -> nn.Sequential:
    """Stage ``stage``'s slice of the model: its ``len(model) // p`` consecutive modules."""
    k = len(model) // p
    return model[stage * k:(stage + 1) * k]


def microbatches(cfg: PipeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one step, shaped (m, batch // m, d)."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.batch, cfg.d, generator=g)
    y = torch.randn(cfg.batch, cfg.d, generator=g)
    return x.view(cfg.m, -1, cfg.d), y.view(cfg.m, -1, cfg.d)


def _loss(out: torch.Tensor, target: torch.Tensor, m: int) -> torch.Tensor:
    return nn.functional.mse_loss(out, target) / m


def run_schedule(stage: nn.Module, order: list[Op], x: torch.Tensor | None, y: torch.Tensor | None,
                 group=None) -> dict:
    """Run this rank's ``order`` of ops on its ``stage``; every rank of ``group`` (None: the world) is one stage, in
    rank order. ``x``: the micro-batches (m, rows, d), used by stage 0 for its inputs and by every stage for the
    activation shape; ``y``: the targets, used by the last stage. Returns plain data: the losses (last stage), the
    op timeline ``[(kind, mb, start, end)]`` in ``time.perf_counter`` seconds (one clock for every process on a
    machine), the peak number of micro-batches whose activations were held, the bytes autograd saved for one
    micro-batch's backward (``saved_tensors_hooks``: each tensor once, weights left out) and the peak of those bytes
    over the step, and each parameter's gradient."""
    s, p = dist.get_rank(group), dist.get_world_size(group)
    glob = lambda r: dist.get_global_rank(group, r) if group is not None else r  # noqa: E731
    m = x.shape[0]
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # mb -> (stage input, stage output or loss)
    sends, events, losses, peak = [], [], {}, 0
    weights = {q.untyped_storage().data_ptr() for q in stage.parameters()}
    act_bytes: dict[int, int] = {}                              # mb -> bytes autograd saved for its backward
    live = peak_bytes = 0
    for kind, i in order:
        if kind == "F":
            if s == 0:
                inp = x[i]
            else:
                inp = torch.empty_like(x[i])
                dist.recv(inp, src=glob(s - 1), group=group)
                inp.requires_grad_(True)
            t0 = time.perf_counter()
            saved: dict[tuple[int, int], int] = {}              # (address, numel) -> bytes: each tensor once

            def pack(t, saved=saved):
                if t.untyped_storage().data_ptr() not in weights:   # the weights are saved too, but held anyway
                    saved[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = stage(inp)
            act_bytes[i] = sum(saved.values())
            live += act_bytes[i]
            peak_bytes = max(peak_bytes, live)
            if s == p - 1:
                out = _loss(out, y[i], m)
                losses[i] = float(out.detach()) * m
            else:
                sends.append(dist.isend(out.detach(), dst=glob(s + 1), group=group))
            held[i] = (inp, out)
            peak = max(peak, len(held))
        elif kind == "B":
            inp, out = held.pop(i)
            live -= act_bytes[i]
            if s == p - 1:
                t0 = time.perf_counter()
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, src=glob(s + 1), group=group)
                t0 = time.perf_counter()
                out.backward(grad)
            if s > 0:
                sends.append(dist.isend(inp.grad, dst=glob(s - 1), group=group))
        else:
            raise ValueError(f"op {(kind, i)!r}: an op is ('F', i) or ('B', i)")
        events.append((kind, i, t0, time.perf_counter()))
    for w in sends:
        w.wait()
    if held:
        raise ValueError(f"stage {s}: micro-batches {sorted(held)} ran forward but never backward; every ('F', i) "
                         "needs its ('B', i)")
    return {"losses": [losses[i] for i in sorted(losses)], "events": events, "peak_held": peak,
            "activation_bytes": act_bytes.get(0, 0), "peak_activation_bytes": peak_bytes,
            "grads": {n: q.grad.detach().clone() for n, q in stage.named_parameters()}}   # the full model's names


def reference_grads(cfg: PipeConfig) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the whole model, the whole batch: (loss, each parameter's gradient by the full model's names)."""
    model = pipe_model(cfg)
    x, y = microbatches(cfg)
    loss = nn.functional.mse_loss(model(x.reshape(-1, cfg.d)), y.reshape(-1, cfg.d))
    loss.backward()
    return float(loss.detach()), {n: q.grad for n, q in model.named_parameters()}


def scratch_step(cfg: PipeConfig, kind: str) -> dict:
    """On each rank: stage ``rank`` of :func:`pipe_model` runs schedule ``kind`` ("gpipe" or "1f1b") from scratch."""
    s = dist.get_rank()
    model = pipe_model(cfg)
    x, y = microbatches(cfg)
    dist.barrier()
    return run_schedule(stage_layers(model, s, cfg.p), orders(kind, cfg.p, cfg.m)[s], x, y)


def pipelining_step(cfg: PipeConfig, kind: str) -> dict:
    """On each rank: the same model and batch through ``torch.distributed.pipelining``. ``kind``: "gpipe", "1f1b" or
    "interleaved" (``ScheduleInterleaved1F1B``: two chunks per rank, rank r holding stages r and r + p, so the model
    is cut into 2p stages). Returns the losses (last stage) and each parameter's gradient by the full model's names."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    r, p = dist.get_rank(), cfg.p
    model = pipe_model(cfg)
    x, y = microbatches(cfg)
    x, y = x.reshape(-1, cfg.d), y.reshape(-1, cfg.d)
    loss_fn = nn.functional.mse_loss          # the schedule averages over micro-batches itself (scale_grads)
    cpu = torch.device("cpu")
    if kind == "interleaved":
        ids = [r, r + p]
        stages = [PipelineStage(stage_layers(model, k, 2 * p), k, 2 * p, cpu) for k in ids]
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=cfg.m, loss_fn=loss_fn)
        first, last = 0 in ids, 2 * p - 1 in ids
    else:
        ids = [r]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind]
        sched = cls(PipelineStage(stage_layers(model, r, p), r, p, cpu), n_microbatches=cfg.m, loss_fn=loss_fn)
        first, last = r == 0, r == p - 1
    losses: list = []
    args = (x,) if first else ()
    sched.step(*args, **({"target": y, "losses": losses} if last else {}))
    grads = {n: q.grad.detach().clone() for sid in ids
             for n, q in stage_layers(model, sid, len(ids) * p).named_parameters()}   # a slice keeps the full names
    return {"losses": [float(v.detach()) for v in losses], "grads": grads}
