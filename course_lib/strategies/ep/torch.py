"""A mixture-of-experts layer in PyTorch, unsharded (:meth:`MoE.forward`) and expert-parallel (:func:`ep_forward`).

Expert parallel, on rank r of p (experts ``r·E/p ..`` live here, router replicated):

1. route this rank's tokens (top-k, capacity per group), sort the kept copies by expert -- so by destination rank;
2. ``all_to_all_single`` of the per-expert counts: each rank learns how many copies of each of its experts come
   from each rank (E integers per rank, a metadata exchange);
3. ``all_to_all_single`` of the copies themselves, with those counts as the split sizes (uneven splits);
4. each local expert runs on its copies; 5. ``all_to_all_single`` back, the splits reversed; 6. combine: each
   token adds its copies' outputs times their gates.

The functional (differentiable) ``all_to_all_single`` of ``torch.distributed._functional_collectives`` carries the gradients back the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from course_lib.strategies.ep import routing

__all__ = ["MoEConfig", "MoE", "ep_forward", "expert_slice"]


@dataclass(frozen=True)
class MoEConfig:
    """A small MoE layer: ``n_experts`` MLPs d -> d_ff -> d, ``top_k`` experts per token."""
    d: int = 16
    d_ff: int = 32
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.0   #: 1.0: an expert takes its fair share of a group's copies, no more
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")
        if self.capacity_factor <= 0 or self.d < 1 or self.d_ff < 1:
            raise ValueError(f"capacity_factor={self.capacity_factor}, d={self.d}, d_ff={self.d_ff} must be > 0")


class MoE(nn.Module):
    """Router ``(d, E)``, expert weights ``w1`` (E, d, d_ff) and ``w2`` (E, d_ff, d); seeded, the same everywhere."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        E, d, f = cfg.n_experts, cfg.d, cfg.d_ff
        self.router = nn.Parameter(torch.randn(d, E, generator=g))
        self.w1 = nn.Parameter(torch.randn(E, d, f, generator=g) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, f, d, generator=g) / f ** 0.5)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1[e]) @ self.w2[e]

    def route(self, x: torch.Tensor):
        """(ids (T, k), gates (T, k), keep (T, k), capacity) for one group of tokens ``x`` (T, d)."""
        cfg = self.cfg
        ids, gates = routing.top_k(x @ self.router, cfg.top_k)
        cap = routing.capacity(x.shape[0], cfg.n_experts, cfg.top_k, cfg.capacity_factor)
        return ids, gates, routing.keep_mask(ids, cfg.n_experts, cap), cap

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """Unsharded: ``x`` (T, d) cut into ``groups`` equal groups, each routed with its own capacity."""
        if x.shape[0] % groups:
            raise ValueError(f"{x.shape[0]} tokens in {groups} groups: use a multiple of {groups}")
        outs = []
        for xg in x.chunk(groups):
            ids, gates, keep, _ = self.route(xg)
            y = torch.zeros_like(xg)
            for e in range(self.cfg.n_experts):
                t, j = ((ids == e) & keep).nonzero(as_tuple=True)
                y = y.index_add(0, t, gates[t, j, None] * self.expert(e, xg[t]))
            outs.append(y)
        return torch.cat(outs)


def expert_slice(cfg: MoEConfig, rank: int, world: int) -> range:
    """The experts rank ``rank`` holds."""
    if cfg.n_experts % world:
        raise ValueError(f"n_experts({cfg.n_experts}) % world({world}) != 0: every rank holds the same number of "
                         f"experts; use n_experts a multiple of {world}")
    per = cfg.n_experts // world
    return range(rank * per, (rank + 1) * per)


def ep_forward(moe: MoE, x: torch.Tensor, group=None) -> tuple[torch.Tensor, dict]:
    """This rank's tokens ``x`` (T, d) through the expert-parallel layer; only this rank's experts' weights are
    used. Returns (output (T, d), stats: the copies sent to each rank, received per local expert, dropped)."""
    from torch.distributed._functional_collectives import all_to_all_single as fc_a2a    # differentiable

    def a2a(inp, out_split, in_split):     # `* 1` waits: the functional API returns an AsyncCollectiveTensor
        return fc_a2a(inp.contiguous(), out_split, in_split, group if group is not None else dist.group.WORLD) * 1
    r, p = dist.get_rank(group), dist.get_world_size(group)
    E, mine = moe.cfg.n_experts, expert_slice(moe.cfg, r, p)
    per = len(mine)
    ids, gates, keep, _ = moe.route(x)
    t, j = keep.nonzero(as_tuple=True)                          # the kept copies: token t, choice j
    order = torch.argsort(ids[t, j], stable=True)               # by expert, so by destination rank
    t, j = t[order], j[order]
    counts = torch.bincount(ids[t, j], minlength=E)             # (E,) copies per expert from this rank
    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)            # got[src·per + e']: copies of my expert e' from src
    send_split = counts.view(p, per).sum(1).tolist()
    recv_split = got.view(p, per).sum(1).tolist()
    recv = a2a(x[t], recv_split, send_split)
    outs, at = [], 0
    for src in range(p):                                        # from each source: its copies, by local expert
        for e in range(per):
            n = int(got[src * per + e])
            outs.append(moe.expert(mine[e], recv[at:at + n]))
            at += n
    back = a2a(torch.cat(outs), send_split, recv_split)
    y = torch.zeros_like(x).index_add(0, t, gates[t, j, None] * back)
    return y, {"sent": send_split, "received": got.view(p, per).sum(0).tolist(), "dropped": int((~keep).sum())}
