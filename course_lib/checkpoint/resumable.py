"""A training run whose whole state can be checkpointed: the course GPT, AdamW, a warm-up, a data position.

What :class:`~course_lib.checkpoint.dcp.AppState` saves and restores, built the same way in Lab 07,
its checks and tests, and a training script: :func:`resumable_run` on every rank, then
:func:`train_step` in a loop. The data position counts *global* batches, so it means the same at any
world size. Importing this module imports neither torch.distributed nor JAX.
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.maths.schedule import Warmup

__all__ = ["ResumableBatches", "resumable_run", "train_step"]


@dataclass
class ResumableBatches:
    """The data position, as *global* batches consumed: ``TokenTask.global_batch(step)`` then this rank's rows.

    A position counted in global batches survives a change of world size (a per-rank sampler offset does
    not: rank r's 40th sample is another sample at another world size).
    """

    task: object          #: a :class:`~course_lib.models.data.TokenTask`
    batch_size: int       #: global batch, split evenly across ranks
    step: int = 0         #: global batches consumed so far: the next batch is ``global_batch(step)``

    def next(self, rank: int, world_size: int):
        """This rank's ``(x, y)`` int64 tensors of the next global batch; advances the position."""
        import torch
        x, y = self.task.rank_batch(self.step, self.batch_size, rank, world_size)
        self.step += 1
        return torch.from_numpy(x), torch.from_numpy(y)

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.task.seed, "batch_size": self.batch_size}

    def load_state_dict(self, sd: dict) -> None:
        bad = {k: (sd[k], v) for k, v in (("seed", self.task.seed), ("batch_size", self.batch_size)) if sd[k] != v}
        if bad:
            raise ValueError("data stream differs from the checkpoint's: " + ", ".join(
                f"{k} saved {s} vs now {n}" for k, (s, n) in bad.items()) + "; resume with the same task and batch")
        self.step = int(sd["step"])


def resumable_run(cfg, *, mesh=None, seed: int = 0, lr: float = 3e-3, warmup: int = 8, batch_size: int = 8,
                  data_seed: int = 0, device=None):
    """On a rank (or in one process): ``(model, optimizer, scheduler, data)`` of a run an :class:`AppState`
    can checkpoint -- the course GPT (``init_weights(cfg, seed)``; FSDP2 over ``mesh``, default: all ranks,
    when a process group is up), AdamW, a linear warm-up over ``warmup`` steps
    (:class:`course_lib.maths.schedule.Warmup`, as ``course_lib.train``), :class:`ResumableBatches`.
    ``device``: default this rank's (``rank_info().device``: a GPU under NCCL), else CPU."""
    import torch
    import torch.distributed as dist
    from course_lib.models import TokenTask, TorchGPT, torch_init_
    from course_lib.strategies.fsdp.torch import shard_gpt
    if device is None:
        from course_lib.launch import rank_info
        device = rank_info().device if dist.is_initialized() else "cpu"
    with torch.device("meta"):
        model = TorchGPT(cfg)
    if dist.is_initialized():
        if mesh is None:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
        shard_gpt(model, mesh)
    model.to_empty(device=device)
    torch_init_(model, cfg, seed)      # every rank computes the same full tensors and keeps its shard
    # fused: one kernel call per step for all the DTensor shards (torch's CPU default is one call per parameter,
    # each a DTensor dispatch). The foreach kernels are as quick once warm, but each new process first works out
    # the sharding of their 7 calls: measured, a fresh 4-rank run's first step 0.30 s instead of 0.66 s. Resumes
    # and reshards stay bit-exact (tests/test_checkpoint.py); the weights differ from foreach's in the 5th digit.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(warmup))
    return model, opt, sched, ResumableBatches(TokenTask(cfg.vocab_size, cfg.seq_len, seed=data_seed), batch_size)


def train_step(model, optimizer, scheduler, data, loss_fn=None) -> float:
    """One step on this rank's slice of the next global batch; returns this rank's loss."""
    import torch.distributed as dist
    from course_lib.models import loss_fn as gpt_loss
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in data.next(rank, world))
    loss = (loss_fn or gpt_loss)(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return loss.item()
