"""FSDP2 (fully_shard) == our from-scratch FSDP == DDP on the lab's GPT and data, and each one's
ledger equals its formula: flat padding for ours, dim-0 padding for FSDP2."""
from __future__ import annotations

import pytest
import torch

from course_lib.maths import costs
from course_lib import launch
from course_lib.models import LAB_CONFIG

N = 4


def _steps(strategy, steps, dtype, reshard_root=True):
    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.strategies.fsdp.torch import build
    from course_lib.models.data import TokenTask
    from course_lib.strategies.fsdp.scratch import gathered_parameters
    from course_lib.models import loss_fn
    r, n = dist.get_rank(), dist.get_world_size()
    model, units = build(strategy, LAB_CONFIG, dtype=dtype, reshard_root=reshard_root)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    task = TokenTask(LAB_CONFIG.vocab_size, LAB_CONFIG.seq_len, seed=0)
    losses = []
    for s in range(steps):
        x, y = (torch.from_numpy(a) for a in task.rank_batch(s, 8, r, n))
        lt.set_step(s)
        with lt.phase("forward"):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(lt.unrecorded_mean(loss))
    with lt.paused():
        weights = {k: v.numpy() for k, v in gathered_parameters(model).items()}
    return losses, weights, units


@pytest.fixture(scope="module")
def runs():
    out = {}
    for dtype in (torch.float32, torch.float64):
        for s in ("ours", "fsdp2", "ddp"):
            out[s, dtype] = launch.run(_steps, s, 3, dtype, world_size=N)
    return out


def test_losses_fsdp2_equal_ours_equal_ddp(runs):
    for dtype, tol in ((torch.float32, dict(rtol=1e-5, atol=1e-6)), (torch.float64, dict(rtol=1e-10, atol=1e-12))):
        ref = torch.tensor(runs["ddp", dtype][0][0])
        for s in ("ours", "fsdp2"):
            torch.testing.assert_close(torch.tensor(runs[s, dtype][0][0]), ref, **tol, msg=f"{s} {dtype}")


def test_gathered_weights_equal_in_float64(runs):
    ref = runs["ddp", torch.float64][0][1]
    for s in ("ours", "fsdp2"):
        got = runs[s, torch.float64][0][1]
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(torch.from_numpy(got[k]), torch.from_numpy(ref[k]), rtol=1e-10, atol=1e-12)


def test_each_ledger_equals_its_formula(runs):
    for s, strategy, padding in (("ours", "fsdp", "flat"), ("fsdp2", "fsdp", "dim0"), ("ddp", "dp", "none")):
        out = runs[s, torch.float32]
        analytic = costs.step_cost(strategy, out[0][2], N, padding=padding)
        for r in range(N):
            led = out.ledger.filter(rank=r, step=2)
            assert costs.ledger_wire_bytes(led) == pytest.approx(analytic.wire_bytes, rel=1e-12), (s, r)
    ours = costs.padded_numel(runs["ours", torch.float32][0][2], N, "flat")
    fsdp2 = costs.padded_numel(runs["fsdp2", torch.float32][0][2], N, "dim0")
    assert ours < fsdp2          # FSDP2 pads every parameter's rows, ours each unit once


def test_fsdp2_default_keeps_the_root_unsharded_after_forward():
    out = launch.run(_steps, "fsdp2", 2, torch.float32, False, world_size=N)
    led = out.ledger.filter(rank=0, step=1)
    assert len(led.filter(op="all_gather", phase="forward")) == 1 + LAB_CONFIG.n_layers
    assert len(led.filter(op="all_gather", phase="backward")) == LAB_CONFIG.n_layers   # no root re-gather
    analytic = costs.step_cost("fsdp", out[0][2], N, padding="dim0", root_unit=0)
    assert costs.ledger_wire_bytes(led) == pytest.approx(analytic.wire_bytes, rel=1e-12)
