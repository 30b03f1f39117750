"""HSDP in torch (fully_shard over a 2-D mesh): the mesh factors are validated, HSDP == FSDP == DDP == one
process, the ledger's bytes per mesh axis equal the formula from the model alone (4 and 8 ranks, the lab GPT
whose primes force padding), set_requires_all_reduce(False) accumulates with fewer all-reduces, and model
state per rank is 16·Ψpad/F."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib import launch
from course_lib.comm.ledger import CollectiveRecord
from course_lib.maths import costs
from course_lib.models import LAB_CONFIG, TorchGPT
from course_lib.strategies.hsdp import torch as hsdp

with torch.device("meta"):
    UNITS = hsdp.unit_shapes(TorchGPT(LAB_CONFIG))


# -- pure ------------------------------------------------------------------------------------------------
def test_config_error_names_every_factor():
    with pytest.raises(ValueError, match=r"replicate\(2\) \* shard\(3\) != world_size\(4\)"):
        hsdp.HSDPConfig(2, 3, 4)
    with pytest.raises(ValueError, match="positive ints"):
        hsdp.HSDPConfig(0, 4, 4)
    assert hsdp.HSDPConfig(2, 4, 8).mesh_shape == (2, 4)


def test_groups_rows_shard_columns_replicate():
    assert hsdp.shard_groups(2, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hsdp.replica_groups(2, 4) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_axis_of_names_groups_by_ranks():
    rec = lambda ranks, axis=None: CollectiveRecord("all_gather", 8, "float32", len(ranks), 0, tuple(ranks), axis)  # noqa: E731
    assert hsdp.axis_of(rec([0, 1, 2, 3]), 2, 4) == "shard"
    assert hsdp.axis_of(rec([1, 5]), 2, 4) == "replicate"
    assert hsdp.axis_of(rec(range(8)), 2, 4) == "replicate,shard"
    assert hsdp.axis_of(rec(range(8)), 1, 8) == "shard"        # F = N: the default group, no axis name
    assert hsdp.axis_of(rec(range(8)), 8, 1) == "replicate"    # F = 1: DDP-like
    assert hsdp.axis_of(rec([0, 2]), 2, 4) is None
    assert hsdp.axis_of(rec([0, 2], "mine"), 2, 4) == "mine"


def test_formula_by_axis_splits_step_cost():
    f = hsdp.formula_by_axis(UNITS, 2, 4, padding="dim0", root_unit=0)
    total = costs.step_cost("hsdp", UNITS, 8, replicate=2, padding="dim0", root_unit=0).wire_bytes
    assert f["shard"] + f["replicate"] == pytest.approx(total)
    assert f["replicate"] == pytest.approx(costs.padded_numel(UNITS, 4, "dim0") / 4 * 4)   # 2(R-1)/R · Ψpad/F · 4B, R = 2


# -- on ranks --------------------------------------------------------------------------------------------
def _train(kind, R, F, steps, dtype, accum=1, each=False):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    from course_lib.comm import torch_ledger as lt
    from course_lib.models import loss_fn, torch_gpt
    from course_lib.models.data import TokenTask
    from course_lib.strategies.hsdp import torch as hsdp
    from course_lib.strategies.fsdp.scratch import gathered_parameters
    from course_lib.measure.memory import model_state
    r, n = dist.get_rank(), dist.get_world_size()
    if kind == "ddp":
        model = DDP(torch_gpt(LAB_CONFIG, seed=0).to(dtype))
    else:
        mesh = hsdp.hsdp_mesh(R, F) if kind == "hsdp" else init_device_mesh("cpu", (n,))
        model = hsdp.build_gpt(LAB_CONFIG, mesh, dtype=dtype)
    # fused: one kernel per step (torch's CPU default is one DTensor call per shard, as Lab 04 says): 20 s -> 17 s
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    task = TokenTask(LAB_CONFIG.vocab_size, LAB_CONFIG.seq_len, seed=0)
    losses, state = [], None
    for s in range(steps):
        lt.set_step(s)
        x, y = (torch.from_numpy(a) for a in task.rank_batch(s, 16, r, n))
        if s == steps - 1 and kind != "ddp":       # the 16Ψ/F moment: gradients held, Adam state born
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            state = model_state(model, opt).total
            opt.zero_grad()
        else:
            loss = hsdp.accumulate_step(model, opt, list(zip(x.chunk(accum), y.chunk(accum))), loss_fn,
                                        all_reduce_each=each)
        losses.append(lt.unrecorded_mean(loss))
    with lt.paused():
        weights = {k: v.double().numpy() for k, v in gathered_parameters(model).items()}
    return losses, weights, state


def _one_process(steps, dtype):
    from course_lib.models import loss_fn, torch_gpt
    from course_lib.models.data import TokenTask
    model = torch_gpt(LAB_CONFIG, seed=0).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    task = TokenTask(LAB_CONFIG.vocab_size, LAB_CONFIG.seq_len, seed=0)
    losses = []
    for s in range(steps):
        x, y = (torch.from_numpy(a) for a in task.global_batch(s, 16))
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().double().numpy() for k, v in model.named_parameters()}


@pytest.fixture(scope="module")
def four():
    out = {}
    for kind in ("hsdp", "fsdp", "ddp"):
        out[kind] = launch.run(_train, kind, 2, 2, 10, torch.float32, world_size=4)
    out["hsdp64"] = launch.run(_train, "hsdp", 2, 2, 3, torch.float64, world_size=4)
    return out


def test_hsdp_equals_fsdp_equals_ddp_equals_one_process(four):
    ref, _ = _one_process(10, torch.float32)
    for kind in ("hsdp", "fsdp", "ddp"):
        torch.testing.assert_close(torch.tensor(four[kind][0][0]), torch.tensor(ref), rtol=1e-5, atol=1e-6,
                                   msg=f"{kind} losses vs one process")
    _, w64 = _one_process(3, torch.float64)
    got = four["hsdp64"][0][1]
    for k, v in w64.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


def test_placements_and_ledger_axes_at_4(four):
    res = four["hsdp"]
    led = res.ledger.filter(rank=0, step=5)
    assert {(r.op, r.axis) for r in led} == {("all_gather", "shard"), ("reduce_scatter", "shard"),
                                            ("all_reduce", "replicate")}
    got = hsdp.ledger_by_axis(res.ledger, 2, 2, step=5)
    want = hsdp.formula_by_axis(UNITS, 2, 2, padding="dim0", root_unit=0)
    for axis in ("shard", "replicate"):
        assert costs.ratio(got[axis], want[axis]) == pytest.approx(1.0, abs=1e-12), axis


@pytest.mark.parametrize("R,F", [(2, 4), (4, 2), (1, 8), (8, 1)])
def test_bytes_per_axis_and_memory_at_8(R, F):
    res = launch.run(_train, "hsdp", R, F, 2, torch.float32, world_size=8)
    got = hsdp.ledger_by_axis(res.ledger, R, F, step=0)
    want = hsdp.formula_by_axis(UNITS, R, F, padding="dim0", root_unit=0)
    for axis in ("shard", "replicate"):
        assert costs.ratio(got[axis], want[axis]) == pytest.approx(1.0, abs=1e-12), (axis, got, want)
    pad = costs.padded_numel(UNITS, F, "dim0")
    n_params = sum(len(u) for u in UNITS)
    # 16 bytes per padded element held, plus AdamW's 4-byte step counter per parameter; rank 0 holds full
    # ceil(d0/F)-row chunks, a group's last ranks may hold shorter ones (torch.chunk), never more
    want = 16 * pad // F + 4 * n_params
    assert res[0][2] == want, (res[0][2], want)
    assert all(res[r][2] <= want for r in range(8)), [res[r][2] for r in range(8)]
    # parity at 8 ranks too: the same losses as one process on the whole batch (2 steps, one update)
    ref, _ = _one_process(2, torch.float32)
    torch.testing.assert_close(torch.tensor(res[0][0]), torch.tensor(ref), rtol=1e-5, atol=1e-6,
                               msg=f"HSDP {R}x{F} losses vs one process")


def test_accumulation_without_all_reduce_matches_and_saves_bytes():
    skip = launch.run(_train, "hsdp", 2, 2, 2, torch.float64, 2, False, world_size=4)
    each = launch.run(_train, "hsdp", 2, 2, 2, torch.float64, 2, True, world_size=4)
    for k, v in each[0][1].items():
        np.testing.assert_allclose(skip[0][1][k], v, rtol=1e-10, atol=1e-12, err_msg=k)
    ar = lambda res: len(res.ledger.filter(rank=0, step=0, op="all_reduce"))  # noqa: E731
    rs = lambda res: len(res.ledger.filter(rank=0, step=0, op="reduce_scatter"))  # noqa: E731
    assert ar(each) == 2 * ar(skip) == 8        # one all-reduce per unit per micro-batch vs per step
    assert rs(each) == rs(skip) == 8            # the reduce-scatter still runs for every micro-batch
