"""Routing for a mixture-of-experts layer, in torch, without a process group: top-k, capacity, the dispatch matrix.

Capacity is filled in GShard's priority order: every token's first choice before any token's second choice, and
within one choice in token order. ``positions`` is that order's running count per expert (a cumulative sum of
one-hot rows, as GShard and Switch compute it); a copy is kept while its position is below ``C``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["capacity", "top_k", "positions", "keep_mask", "dispatch_matrix", "tokens_per_expert"]


def capacity(tokens: int, n_experts: int, k: int, factor: float) -> int:
    """Copies one expert accepts from one group: ``ceil(factor · tokens · k / n_experts)`` (Switch Transformers)."""
    if tokens < 1 or n_experts < 1 or k < 1 or factor <= 0:
        raise ValueError(f"tokens={tokens}, n_experts={n_experts}, k={k} must be >= 1 and factor={factor} > 0")
    return math.ceil(factor * tokens * k / n_experts)


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids (T, k), gates (T, k)): the k most probable experts, best first, and their probabilities
    renormalised to sum to 1 over the k (GShard's top-2, Mixtral)."""
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"top_k={k} must be in 1..{logits.shape[-1]} (the number of experts)")
    probs = torch.softmax(logits, dim=-1)
    gates, ids = probs.topk(k, dim=-1)
    return ids, gates / gates.sum(dim=-1, keepdim=True)


def positions(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Each copy's place in its expert's queue (T, k): first choices of every token first, then second choices."""
    T, k = ids.shape
    onehot = torch.nn.functional.one_hot(ids.T.reshape(-1), n_experts)        # (k·T, E), choice-major
    pos = (onehot.cumsum(0) * onehot).sum(-1) - 1
    return pos.view(k, T).T


def keep_mask(ids: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """True for the copies their expert accepts: the first ``cap`` in the priority order."""
    return positions(ids, n_experts) < cap


def tokens_per_expert(ids: torch.Tensor, keep: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Kept copies per expert (E,)."""
    return torch.bincount(ids[keep], minlength=n_experts)


def dispatch_matrix(ids_per_group: list[torch.Tensor], n_experts: int, world: int, cap: int) -> list[list[int]]:
    """``M[src][dst]``: token copies rank ``src`` sends to rank ``dst`` in the dispatch all-to-all, experts split
    evenly over ranks (rank r holds experts ``r·E/p .. (r+1)·E/p - 1``). The combine all-to-all is its transpose."""
    if n_experts % world:
        raise ValueError(f"n_experts({n_experts}) % world({world}) != 0: every rank holds the same number of experts")
    per = n_experts // world
    out = []
    for ids in ids_per_group:
        kept = tokens_per_expert(ids, keep_mask(ids, n_experts, cap), n_experts)
        out.append([int(kept[d * per:(d + 1) * per].sum()) for d in range(world)])
    return out
