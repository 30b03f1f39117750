"""Context parallel: the online-softmax merge is exact, ring attention on gloo (uneven block sizes, causal or not)
equals torch's attention and sends exactly the ring formula's bytes, torch's own context_parallel is probed, and the
JAX ppermute ring equals full attention."""
from __future__ import annotations

import pytest
import torch

from course_lib import launch
from course_lib.comm import torch_ledger
from course_lib.strategies.cp import torch as cpt


def _qkv(B=2, H=3, T=20, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g) for _ in range(3)]


def test_merge_of_blocks_is_attention_over_all_keys():
    q, k, v = _qkv(T=11)
    o, lse = cpt.block_attention(q, k[:, :, :4], v[:, :, :4])
    for a, b in ((4, 5), (5, 11)):
        o, lse = cpt.merge(o, lse, *cpt.block_attention(q, k[:, :, a:b], v[:, :, a:b]))
    o_ref, lse_ref = cpt.block_attention(q, k, v)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    torch.testing.assert_close(o_ref, cpt.full_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_merge_survives_scores_past_float32s_exp():
    q, k, v = _qkv(T=8)
    q = q * 80
    o, lse = cpt.merge(*cpt.block_attention(q, k[:, :, :4], v[:, :, :4]), *cpt.block_attention(q, k[:, :, 4:], v[:, :, 4:]))
    assert torch.isinf(lse.exp()).any() and torch.isfinite(o).all()
    torch.testing.assert_close(o, cpt.full_attention(q, k, v), rtol=1e-4, atol=1e-5)


def _ring(q, k, v, causal):
    import torch.distributed as dist
    r, p = dist.get_rank(), dist.get_world_size()
    tl = q.shape[2] // p
    sl = slice(r * tl, (r + 1) * tl)
    torch_ledger.recorder().reset()
    o = cpt.ring_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], causal=causal)
    led = torch_ledger.recorder().ledger()
    return o, [(x.op, x.nbytes) for x in led]


@pytest.mark.parametrize("p, T", [(4, 20), (3, 9)])
def test_ring_attention_equals_full_attention_and_sends_the_ring_bytes(p, T):
    q, k, v = _qkv(T=T, D=6)
    for causal in (False, True):
        outs = launch.run(_ring, q, k, v, causal, world_size=p, timeout=120)
        torch.testing.assert_close(torch.cat([o for o, _ in outs], dim=2), cpt.full_attention(q, k, v, causal),
                                   rtol=1e-5, atol=1e-6)
        for _, ops in outs:
            assert [op for op, _ in ops] == ["send", "recv"] * (p - 1)
            assert sum(n for op, n in ops if op == "send") == cpt.ring_bytes(2, 3, T, 6, p)


def _torch_cp(q, k, v):
    import torch.distributed as dist
    state, out = cpt.torch_context_parallel(q.clone(), k.clone(), v.clone(), causal=True)
    return state, (out if state == "refused" else out.detach()), dist.get_rank()


def test_torch_context_parallel_either_runs_right_or_says_why_not():
    q, k, v = _qkv(T=16)
    outs = launch.run(_torch_cp, q, k, v, world_size=4, timeout=120)
    states = {s for s, _, _ in outs}
    assert len(states) == 1
    if states == {"refused"}:
        assert all("NotImplementedError" in m or "RuntimeError" in m for _, m, _ in outs)
    else:   # a torch whose CPU attention has a sharding rule: the blocks (round-robin load balancing) hold the answer
        ref = cpt.full_attention(q, k, v, True)
        assert sum(o.numel() for _, o, _ in outs) == ref.numel()


def test_jax_ring_attention_equals_full_attention():
    jax = pytest.importorskip("jax")
    import numpy as np

    from course_lib.strategies.cp import jax as cpj
    q, k, v = (t.numpy() for t in _qkv(T=12, D=5))
    mesh = cpj.seq_mesh(4)
    for causal in (False, True):
        got = jax.jit(lambda q, k, v: cpj.ring_attention(q, k, v, mesh, causal=causal))(q, k, v)
        want = cpt.full_attention(*(torch.from_numpy(a) for a in (q, k, v)), causal).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cpj.full_attention(q, k, v, causal), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiple of 4"):
        cpj.ring_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], mesh)
