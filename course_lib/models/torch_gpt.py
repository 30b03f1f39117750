"""The course GPT in PyTorch (GPT-2 shaped, tiny), holding :func:`~course_lib.models.config.init_weights`.

The maths is matched with :mod:`~course_lib.models.flax_gpt`: exact (erf) GELU, LayerNorm eps 1e-5 with
two-pass variance, attention scaled by 1/sqrt(head_dim). Dropout sits where GPT-2 puts it but defaults
to 0, because the frameworks draw different masks.
"""
from __future__ import annotations


import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.models.config import LN_EPS, GPTConfig, init_weights

__all__ = ["TorchGPT", "Block", "CausalSelfAttention", "MLP", "torch_gpt", "torch_init_", "loss_fn",
           "fused_loss_fn", "to_numpy_weights"]

#: fp32 logits of one chunk of :func:`fused_loss_fn` (256 MiB: 2,048 rows of a 32K vocabulary)
LOSS_CHUNK_BYTES = 1 << 28


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # q, k, v of all heads in one matmul
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels
        q, k, v = self.qkv(x).split(C, dim=2)                                              # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))  # 3 x [B, H, T, hd]
        p = self.dropout if self.training else 0.0  # SDPA does not look at .training itself
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)      # [B, H, T, hd]
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))         # heads side by side


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # exact erf GELU; [B, T, C] -> [B, T, d_ff] -> [B, T, C]


class Block(nn.Module):
    """Pre-LN transformer block (GPT-2): x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model, eps=LN_EPS), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model, eps=LN_EPS), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """The GPT in torch, from standard layers only, so every submodule has a ``reset_parameters()``.

    Meta-device build: ``with torch.device("meta"): m = TorchGPT(cfg)``, ``m.to_empty(device=d)``, then
    ``m.reset_parameters(seed)`` (= ``torch_init_(m, cfg, seed)``) gives exactly ``torch_gpt(cfg, seed)``.
    Careful: ``for x in m.modules(): x.reset_parameters()`` visits the root first, then the layers
    overwrite it with nn's own random init; ``m.apply(...)`` visits the root last and is fine.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied from tok_emb: one owner per tensor

    def reset_parameters(self, seed: int = 0) -> None:
        torch_init_(self, self.cfg, seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape  # batch, time
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length T({T}) > cfg.seq_len({self.cfg.seq_len}); crop idx or raise seq_len")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [B, T, V]


def torch_init_(model: nn.Module, cfg: GPTConfig, seed: int = 0) -> nn.Module:
    """Copy ``init_weights(cfg, seed)`` into ``model`` in place, on whatever device it lives. A DTensor
    (after ``fully_shard``) gets just its shard, cut locally: every rank can compute the full tensor."""
    weights, params = init_weights(cfg, seed), dict(model.named_parameters())
    if params.keys() != weights.keys():
        raise ValueError(f"model does not match cfg={cfg}: missing {sorted(weights.keys() - params.keys())}, "
                         f"unexpected {sorted(params.keys() - weights.keys())}; build the model from the same cfg")
    from torch.distributed.tensor import DTensor, distribute_tensor  # here, not on top: ~0.6 s to import
    with torch.no_grad():
        for name, p in params.items():
            full = torch.from_numpy(weights[name])
            if isinstance(p, DTensor):
                full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)
    return model


def torch_gpt(cfg: GPTConfig = GPTConfig(), seed: int = 0) -> TorchGPT:
    """A :class:`TorchGPT` holding ``init_weights(cfg, seed)``."""
    return torch_init_(TorchGPT(cfg), cfg, seed)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _FusedCrossEntropy(torch.autograd.Function):
    """Mean cross entropy whose gradient is computed in the forward, chunk by chunk in fp32.

    ``F.cross_entropy(logits.float(), y)`` keeps an fp32 copy of the logits, saves fp32 log-probabilities for
    backward and, in backward, makes two more fp32 tensors of the same size (14 bytes per token and vocabulary
    entry at the peak for bf16 logits). Here each chunk of rows is cast to fp32, its log-softmax gives the loss
    and, in place, ``softmax - onehot`` (the gradient), written back in the logits' own dtype: autograd keeps
    only that gradient, and fp32 exists for one chunk at a time. Liger-Kernel's and torchtune's fused/chunked
    losses do the same (in one Triton kernel or under ``torch.compile``)."""

    @staticmethod
    def forward(ctx, logits, targets):                         # [N, V] float, [N] int64
        n_rows, vocab = logits.shape
        rows = max(1, LOSS_CHUNK_BYTES // (4 * vocab))
        grad = torch.empty_like(logits)                        # [N, V] in the logits' dtype
        total = logits.new_zeros((), dtype=torch.float32)
        for i in range(0, n_rows, rows):
            t = targets[i:i + rows, None]                      # [n, 1]
            logp = torch.log_softmax(logits[i:i + rows].float(), dim=1)   # [n, V] fp32, this chunk only
            total -= logp.gather(1, t).sum()
            p = logp.exp_()                                    # softmax, in place
            p.scatter_add_(1, t, torch.full_like(t, -1, dtype=p.dtype))   # softmax - onehot(y)
            grad[i:i + rows] = p
        grad.div_(n_rows)
        ctx.save_for_backward(grad)
        return total / n_rows

    @staticmethod
    def backward(ctx, g):
        grad, = ctx.saved_tensors
        return grad * g, None


def fused_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`loss_fn` (mean cross entropy, computed in fp32 whatever the logits' dtype) without an fp32 copy of
    the logits kept for backward: logits [B, T, V] (bf16 or fp32), targets [B, T]. What ``course_lib.train``
    runs; equal to ``loss_fn(logits.float(), targets)`` to fp32 rounding."""
    return _FusedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def to_numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Float32 copies of the parameters by torch name. DTensors are gathered, so every rank must call."""
    from torch.distributed.tensor import DTensor
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", torch.float32).numpy().copy()
            for name, p in model.named_parameters()}
