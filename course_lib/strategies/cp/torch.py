"""Ring attention in PyTorch: each rank holds ``T/p`` positions of q, k and v; the k/v blocks travel the ring
(``isend`` to rank r+1, ``recv`` from rank r-1, p-1 times) while each rank merges the attention of its queries over
each block that passes. Exact, not an approximation: the merge is the online softmax (as in FlashAttention).

Bytes: each step every rank sends one k block and one v block, ``2 · B · H · (T/p) · D`` elements; over the p-1
steps a rank sends ``2 (p-1)/p · B·H·T·D`` elements -- the ring all-gather of k and v, spread over the steps so it
can hide behind the block computations. Causal attention skips the blocks from later positions (computed as
"nothing to add"), which leaves the ranks unevenly loaded: rank p-1 does p blocks, rank 0 one (the zig-zag order of
the Llama 3 paper and torchtitan's load balancer fix that; not done here).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["block_attention", "merge", "full_attention", "ring_attention", "ring_bytes", "torch_context_parallel"]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """Attention of ``q`` (..., Tq, D) over one block of keys ``k``, ``v`` (..., Tk, D): ``(o, lse)`` with
    ``o = softmax(scores) @ v`` (..., Tq, D) and ``lse = logsumexp(scores)`` (..., Tq). ``mask``: True = may attend."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])       # (..., Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """The online-softmax merge of two blocks' results: the attention over both blocks' keys, exactly.
    ``lse = log(e^lse_a + e^lse_b)``, computed without overflow; each output weighted by its block's share."""
    lse = torch.logaddexp(lse_a, lse_b)                              # (..., T)
    return torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b, lse


def full_attention(q, k, v, causal: bool = False) -> torch.Tensor:
    """The single-device reference, torch's own ``scaled_dot_product_attention``."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ring_attention(q, k, v, group=None, causal: bool = False, merge_fn=merge) -> torch.Tensor:
    """This rank's block of the attention output. ``q``, ``k``, ``v``: this rank's blocks (B, H, T/p, D), rank r
    holding positions ``r·T/p .. (r+1)·T/p``. ``merge_fn``: the merge (a learner's, in the lab)."""
    r, p = dist.get_rank(group), dist.get_world_size(group)
    glob = lambda i: dist.get_global_rank(group, i) if group is not None else i  # noqa: E731
    tl = q.shape[-2]
    diag = torch.ones(tl, tl, dtype=torch.bool).tril() if causal else None
    o, lse = block_attention(q, k, v, diag)                         # step 0: this rank's own block
    kv = torch.stack([k, v])                                        # one message per step: (2, B, H, T/p, D)
    for step in range(1, p):
        send = dist.isend(kv.contiguous(), dst=glob((r + 1) % p), group=group)
        kv = torch.empty_like(kv)
        dist.recv(kv, src=glob((r - 1) % p), group=group)
        send.wait()
        src = (r - step) % p                                        # whose positions these keys are
        if causal and src > r:
            continue                                                # later positions: masked out entirely
        o, lse = merge_fn(o, lse, *block_attention(q, kv[0], kv[1]))
    return o


def ring_bytes(B: int, H: int, T: int, D: int, p: int, itemsize: int = 4) -> int:
    """Bytes one rank sends in one ring attention: p-1 steps of one k and one v block."""
    return (p - 1) * 2 * B * H * (T // p) * D * itemsize


def torch_context_parallel(q, k, v, causal: bool = True):
    """torch's own context parallel (``torch.distributed.tensor.experimental.context_parallel``) around
    ``scaled_dot_product_attention``, on a 1-D CPU ``DeviceMesh`` of every rank; q, k, v are the FULL tensors (the
    context manager shards them in place along the sequence). Returns ``("ran", this rank's output block)`` or
    ``("refused", "<exception>: <message>")`` -- on CPU in torch 2.13 it is refused: the CPU attention kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) has no sharding rule; only the CUDA kernels do."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return "ran", out
    except (NotImplementedError, RuntimeError) as exc:
        return "refused", f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
