"""One training step of the capstone (``course_lib.train``) at world size 1, counted op by op on CPU (issue 46).

At world size 1 there is nothing to shard, yet ``fully_shard`` on every block and the root still runs its hooks and
copies (and, with ``--bf16``, casts) every parameter in forward and again in backward. On a fast GPU that is host
work the step waits for: the course GPT L12 d1024 ran at 185k tokens/s on an H200 where JAX ran 326k. Counted here
with a ``TorchDispatchMode`` (:class:`course_lib.measure.dispatches.DispatchCounter`), L12 at CPU sizes:

====================  =========================  =========================
one step, L12         before (FSDP2 at world 1)   now (plain module)
====================  =========================  =========================
fp32                  1,972 dispatches (924        1,254 (376 kernels)
                      kernels)
bf16                  2,293 (1,245 kernels)        1,523 (645 kernels; autocast)
====================  =========================  =========================

The test fails if FSDP's copies come back: the capstone's step must dispatch exactly what the plain module does,
and FSDP2's wrapping of the same model (built here for contrast) must still count more.
"""
from __future__ import annotations

import pytest
import torch

from course_lib.apps import train
from course_lib.apps.train_config import TrainConfig
from course_lib.measure.dispatches import DispatchCounter, count_dispatches
from course_lib.maths.schedule import Warmup

SMALL = dict(n_layers=2, d_model=64, n_heads=2, d_ff=256, vocab_size=67, seq_len=32, batch=2)


def _count(model, opt, sched, data, autocast: bool) -> DispatchCounter:
    def step():
        return train.train_step(model, opt, sched, data.next(0, 1), autocast=autocast)
    step()
    step()                      # warm: AdamW's state exists, every lazy initialisation is done
    return count_dispatches(step)[1]


def _plain(cfg):
    """The same model, optimizer and data with nothing around the model: what the step should cost."""
    from course_lib.models import TokenTask, torch_gpt
    from course_lib.checkpoint.resumable import ResumableBatches
    model = torch_gpt(cfg.model_config(), cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(cfg.warmup))
    return model, opt, sched, ResumableBatches(TokenTask(cfg.vocab_size, cfg.seq_len, seed=cfg.data_seed), cfg.batch)


def _fsdp_at_world_size_1(cfg):
    """What the capstone built before: fully_shard on every block and the root, over a group of one."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from course_lib.strategies.fsdp.torch import shard_gpt
    from course_lib.models import TorchGPT, torch_init_
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = TorchGPT(cfg.model_config())
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw = {"mp_policy": mp} if cfg.bf16 else {}
        shard_gpt(model, init_device_mesh("cpu", (1,)), **kw)
        model.to_empty(device="cpu")
        torch_init_(model, cfg.model_config(), cfg.seed)
        data = _plain(cfg)[3]                    # the same data stream
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(cfg.warmup))
        return _count(model, opt, sched, data, autocast=False)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_one_step_at_world_size_1_makes_no_fsdp_copies(bf16):
    cfg = TrainConfig(world_size=1, bf16=bf16, **SMALL)
    model, opt, sched, data = train.build(cfg, torch.device("cpu"))
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters()), "world size 1 must not shard"
    ours = _count(model, opt, sched, data, autocast=bf16)
    plain = _count(*_plain(cfg), autocast=bf16)
    fsdp = _fsdp_at_world_size_1(cfg)
    print(f"\nL{cfg.n_layers} {'bf16' if bf16 else 'fp32'}: capstone {ours.summary(6)}\n  plain module {plain.total}"
          f", FSDP2 at world size 1 {fsdp.summary(6)}")
    assert ours.by_op == plain.by_op, (ours.by_op - plain.by_op, plain.by_op - ours.by_op)
    # FSDP's copy-in / copy-out (one copy_ per parameter and pass); the one copy_ left is the fused loss's gradient
    assert ours.by_op["copy_"] <= 1 and ours.by_op["split_with_sizes"] == 0
    assert fsdp.total > 1.3 * ours.total and fsdp.kernels > 1.5 * ours.kernels  # what the test guards against


def test_the_counter_sees_backward_and_the_optimizer():
    w = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)

    def step():
        (w * 2).sum().backward()
        opt.step()
    _, c = count_dispatches(step)
    assert c.by_op["mul"] >= 2 and c.by_op["sum"] == 1 and c.kernels < c.total or c.kernels == c.total
    assert c.by_op["add_"] + c.by_op["_foreach_add_"] >= 1        # SGD's update
