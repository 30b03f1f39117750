"""Data parallel from scratch (course_lib.strategies.dp.torch): the averaged gradient is all_reduce(grad)/N, on real gloo
ranks, for awkward sizes; bucketing changes the number of collectives, not the bytes; K steps of DP equal
one process on the whole batch."""
from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

from course_lib.maths import costs
from course_lib.strategies.dp import torch as dp
from course_lib import launch
from course_lib import models
from course_lib.models.data import TokenTask

N = 4


def test_docstrings_run():
    assert doctest.testmod(dp).failed == 0


def _awkward(seed=0):
    """17x257 and friends: nothing divides evenly, so every slicing mistake shows."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(17, 257), torch.nn.Tanh(), torch.nn.Linear(257, 5),
                                torch.nn.Linear(5, 3, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch(rank, world, rows=12):
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(rows, 17, generator=g), torch.randn(rows, 3, generator=g)
    sl = slice(rank * rows // world, (rank + 1) * rows // world)
    return x, y, sl


# -- make_buckets: pure -----------------------------------------------------------------------------
@pytest.mark.parametrize("numels, cap", [((10, 10, 30, 5), 64), ((17 * 257, 257, 5 * 257, 5), 4096),
                                         ((1,), 4), ((7, 7, 7), 10**9), ((100, 1, 1, 100), 8)])
def test_make_buckets_reverse_greedy_each_parameter_once(numels, cap):
    ps = [torch.zeros(k, requires_grad=True) for k in numels]
    buckets = dp.make_buckets(ps, cap)
    flat = [id(p) for b in buckets for p in b]
    assert flat == [id(p) for p in reversed(ps)]                   # every parameter once, in reverse
    for b in buckets:                                              # a bucket over the cap holds one tensor
        assert len(b) == 1 or sum(4 * p.numel() for p in b) <= cap
    for a, b in zip(buckets, buckets[1:]):                         # greedy: the next tensor did not fit
        assert sum(4 * p.numel() for p in a) + 4 * b[0].numel() > cap


def test_make_buckets_skips_frozen_and_rejects_bad_cap():
    ps = [torch.zeros(3, requires_grad=True), torch.zeros(3), torch.zeros(3, requires_grad=True)]
    assert [len(b) for b in dp.make_buckets(ps, 100)] == [2]
    with pytest.raises(ValueError, match="cap_bytes=0"):
        dp.make_buckets(ps, 0)


# -- the wrappers on real ranks ----------------------------------------------------------------------
def _wrapped_grads(kind, cap_mb, steps):
    """Per step: the wrapper's gradients, and the reference all_reduce(grad)/N on a plain copy."""
    import copy

    import torch.distributed as dist

    from course_lib.strategies.dp import torch as dp
    from course_lib.comm import torch_ledger as lt
    r, n = dist.get_rank(), dist.get_world_size()
    model = _awkward()
    ref = copy.deepcopy(model)
    wrapped = dp.NaiveDataParallel(model) if kind == "naive" else dp.BucketedDataParallel(model, cap_mb)
    x, y, sl = _batch(r, n)
    out = []
    for step in range(steps):
        lt.set_step(step)
        torch.nn.functional.mse_loss(wrapped(x[sl] * (step + 1)), y[sl]).backward()
        with lt.paused():
            torch.nn.functional.mse_loss(ref(x[sl] * (step + 1)), y[sl]).backward()
            for p in ref.parameters():
                dist.all_reduce(p.grad)
                p.grad /= n
        out.append(([p.grad.clone() for p in model.parameters()], [p.grad.clone() for p in ref.parameters()]))
        model.zero_grad(set_to_none=False)
        ref.zero_grad(set_to_none=False)
    return out, [len(b.params) for b in getattr(wrapped, "buckets", [])]


@pytest.mark.parametrize("kind, cap_mb", [("naive", None), ("bucketed", 0.004), ("bucketed", 25.0)])
def test_wrappers_average_like_all_reduce_over_n(kind, cap_mb):
    res = launch.run(_wrapped_grads, kind, cap_mb, 2, world_size=N)
    for r in range(N):
        for got, ref in res[r][0]:
            for g, e in zip(got, ref):
                torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    n_params = len(list(_awkward().parameters()))
    step1 = res.ledger.filter(rank=0, step=1, op="all_reduce")
    expected_calls = n_params if kind == "naive" else len(res[0][1])
    assert len(step1) == expected_calls
    assert step1.total_bytes() == 4 * sum(p.numel() for p in _awkward().parameters())   # same bytes, any bucketing
    if kind == "bucketed" and cap_mb < 1:
        assert 1 < len(res[0][1]) < n_params                                           # really several buckets


def _replica_gaps():
    import torch.distributed as dist

    from course_lib.strategies.dp import torch as dp
    torch.manual_seed(1000 + dist.get_rank())          # the classic bug: every rank its own init
    model = torch.nn.Linear(17, 257)
    before = dp.max_replica_gap(model)
    dp.broadcast_parameters_(model)
    return before, dp.max_replica_gap(model)


def test_broadcast_makes_replicas_equal():
    res = launch.run(_replica_gaps, world_size=N)
    assert all(before > 0.01 for before, _ in res)
    assert all(after == 0.0 for _, after in res)


def _dp_training(cfg, steps, batch, lr, seed):
    import torch.distributed as dist

    from course_lib.strategies.dp import torch as dp
    from course_lib import models
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed)
    r, n = dist.get_rank(), dist.get_world_size()
    model = models.TorchGPT(cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in models.init_weights(cfg, seed).items()})
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in task.rank_batch(step, batch, r, n))
        models.loss_fn(model(x), y).backward()
        dp.average_gradients_(model)
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_k_steps_of_dp_equal_one_process_on_the_whole_batch():
    cfg, steps, batch, lr = models.GPTConfig(n_layers=1), 3, 8, 0.3
    res = launch.run(_dp_training, cfg, steps, batch, lr, 0, world_size=N)
    task = TokenTask(cfg.vocab_size, cfg.seq_len, 0)
    model = models.TorchGPT(cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in models.init_weights(cfg, 0).items()})
    for step in range(steps):
        x, y = (torch.from_numpy(a) for a in task.global_batch(step, batch))
        models.loss_fn(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
    for r in range(N):
        for k, v in model.state_dict().items():
            torch.testing.assert_close(res[r][k], v, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(res[r][k], res[0][k]) for k in res[0])      # replicas bit-identical


def _unused_parameter():
    import torch.distributed as dist

    from course_lib.strategies.dp import torch as dp
    model = _awkward()
    extra = torch.nn.Linear(3, 3)                       # registered, never used in forward
    holder = torch.nn.ModuleList([model, extra])
    wrapped = dp.BucketedDataParallel(holder, bucket_cap_mb=0.004)
    x, y, sl = _batch(dist.get_rank(), dist.get_world_size())
    torch.nn.functional.mse_loss(wrapped.module[0](x[sl]), y[sl]).backward()
    return extra.weight.grad


def test_bucketed_dp_does_not_hang_when_a_parameter_gets_no_gradient():
    res = launch.run(_unused_parameter, world_size=N, timeout=30)
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in res)


def test_dp_analytic_bytes_match_the_formula():
    shapes = [tuple(p.shape) for p in _awkward().parameters()]
    psi = sum(int(np.prod(s)) for s in shapes)
    assert costs.step_cost("dp", shapes, N).wire_bytes == pytest.approx(2 * (N - 1) / N * 4 * psi)
