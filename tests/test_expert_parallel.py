"""Expert parallel: routing (top-k, capacity in GShard's order, the dispatch matrix), the torch layer on gloo with
all_to_all_single equal to the unsharded layer in values and gradients with the ledger's bytes equal to the
matrix, and the JAX all_to_all layer equal to both -- at awkward sizes."""
from __future__ import annotations

import pytest
import torch

from course_lib import launch
from course_lib.comm import torch_ledger
from course_lib.strategies.ep import routing
from course_lib.strategies.ep import torch as ept


def test_capacity_is_fair_share_times_factor_rounded_up():
    assert routing.capacity(24, 8, 2, 1.0) == 6
    assert routing.capacity(7, 8, 2, 1.25) == 3
    with pytest.raises(ValueError, match="factor=0"):
        routing.capacity(7, 8, 2, 0)


def test_positions_fill_first_choices_before_second_choices():
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    assert routing.positions(ids, 2).tolist() == [[0, 1], [0, 2], [1, 2]]   # expert 1: token 1 first, then 0, 2
    assert routing.keep_mask(ids, 2, 2).tolist() == [[True, True], [True, False], [True, False]]


@pytest.mark.parametrize("T, E, k, cap, world", [(7, 8, 2, 2, 4), (9, 6, 1, 2, 2), (5, 3, 2, 3, 3)])
def test_dispatch_matrix_keeps_min_of_count_and_capacity_per_expert(T, E, k, cap, world):
    g = torch.Generator().manual_seed(T)
    ids = [routing.top_k(torch.randn(T, E, generator=g), k)[0] for _ in range(world)]
    m = routing.dispatch_matrix(ids, E, world, cap)
    for row, i in zip(m, ids):
        assert sum(row) == int(torch.bincount(i.reshape(-1), minlength=E).clamp(max=cap).sum())
    with pytest.raises(ValueError, match=r"n_experts\(8\) % world\(3\) != 0"):
        routing.dispatch_matrix(ids, 8, 3, cap)


CFG = ept.MoEConfig(d=9, d_ff=12, n_experts=8, top_k=2, capacity_factor=1.0)


def _tokens(world, T):
    return torch.randn(world * T, CFG.d, generator=torch.Generator().manual_seed(world + T))


def _ep(T):
    import torch.distributed as dist
    r, p = dist.get_rank(), dist.get_world_size()
    moe = ept.MoE(CFG)
    x = _tokens(p, T).chunk(p)[r].clone().requires_grad_(True)
    torch_ledger.recorder().reset()
    y, stats = ept.ep_forward(moe, x)
    ops = [(rec.op, rec.nbytes) for rec in torch_ledger.recorder().ledger()]
    (y ** 2).sum().backward()
    return y.detach(), stats, ops, x.grad, {n: q.grad for n, q in moe.named_parameters()}


@pytest.mark.parametrize("world, T", [(4, 7), (2, 5)])
def test_expert_parallel_equals_the_unsharded_layer_and_moves_the_matrix(world, T):
    outs = launch.run(_ep, T, world_size=world, timeout=120)
    moe = ept.MoE(CFG)
    x = _tokens(world, T).requires_grad_(True)
    ref = moe(x, groups=world)
    (ref ** 2).sum().backward()
    torch.testing.assert_close(torch.cat([o[0] for o in outs]), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([o[3] for o in outs]), x.grad, rtol=1e-5, atol=1e-5)
    for name in ("w1", "w2", "router"):
        torch.testing.assert_close(sum(o[4][name] for o in outs), getattr(moe, name).grad, rtol=1e-5, atol=1e-5)
    ids = [moe.route(g)[0] for g in x.detach().chunk(world)]
    cap = routing.capacity(T, CFG.n_experts, CFG.top_k, CFG.capacity_factor)
    matrix = routing.dispatch_matrix(ids, CFG.n_experts, world, cap)
    assert [o[1]["sent"] for o in outs] == matrix
    for r, o in enumerate(outs):
        a2a = [n for op, n in o[2] if op == "all_to_all"]
        assert a2a == [8 * CFG.n_experts, sum(matrix[r]) * CFG.d * 4, sum(row[r] for row in matrix) * CFG.d * 4]
        assert o[1]["dropped"] == T * CFG.top_k - sum(matrix[r])


def test_jax_all_to_all_layer_equals_the_torch_layer():
    jax = pytest.importorskip("jax")
    import numpy as np

    from course_lib.strategies.ep import jax as epj
    world, T = 4, 7
    moe = ept.MoE(CFG)
    x = _tokens(world, T)
    ref = moe(x, groups=world).detach().numpy()
    cap = routing.capacity(T, CFG.n_experts, CFG.top_k, CFG.capacity_factor)
    W = [t.detach().numpy() for t in (moe.router, moe.w1, moe.w2)]
    np.testing.assert_allclose(epj.moe_layer(x.numpy(), *W, k=2, cap=cap, groups=world), ref, rtol=1e-5, atol=1e-5)
    mesh = epj.expert_mesh(world)
    got = jax.jit(lambda x, r, a, b: epj.ep_layer(x, r, a, b, mesh, k=2, cap=cap))(x.numpy(), *W)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_expert_slice_names_the_fix():
    assert list(ept.expert_slice(CFG, 1, 4)) == [2, 3]
    with pytest.raises(ValueError, match=r"n_experts\(8\) % world\(3\) != 0"):
        ept.expert_slice(CFG, 0, 3)


def test_the_matrix_figure_writes_every_count_and_carries_a_png():
    from course_lib.widgets.dimensions import matrix_figure
    fig = matrix_figure([[1, 2], [3, 4]], "m", side=[("per expert", [5, 6, 7, 8])])
    assert sorted(t.get_text() for t in fig.axes[0].texts) == ["1", "2", "3", "4"]
    assert len(fig.axes[1].patches) == 4 and fig._repr_png_()[:4] == b"\x89PNG"
