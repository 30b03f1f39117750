"""Tensor parallel in PyTorch, and FSDP × TP on a 2-D ``DeviceMesh`` ``("dp_shard", "tp")``.

Megatron-LM's split of a transformer block (Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", 2019, sec. 3), as ``torch.distributed.tensor.parallel`` writes it:

* **column-wise** (``ColwiseParallel``): a Linear's output features are cut over the T ranks of a tensor
  group (weight ``Shard(0)``); its input is the whole activation on every rank. Attention's q, k, v are
  column-wise, so each rank computes ``n_heads / T`` whole heads; the MLP's ``fc`` too, so the GELU runs on
  a slice of ``d_ff`` with no communication.
* **row-wise** (``RowwiseParallel``): the next Linear's input features are cut the same way (weight
  ``Shard(1)``); each rank's product is a partial sum, and one **all-reduce** over the tensor group makes the
  output whole again -- attention's ``proj`` and the MLP's ``proj``.

So a block costs, per step and per tensor group, 2 all-reduces of the activation ``[b, s, d]`` in forward
(after each row-wise Linear) and 4 in backward (the input gradient of each column-wise Linear: q, k, v, fc
are partial sums over the group). Megatron's fused qkv sums q's, k's and v's input gradients locally first
and needs 2 in backward; with three separate Linears ``parallelize_module`` issues one each. Then ``fully_shard(..., mesh=mesh["dp_shard"])`` cuts each rank's TP piece
again over the data-parallel dim: FSDP's all-gathers and reduce-scatters run there (torchtitan applies TP
first, then FSDP, the same way).

The course GPT fuses q, k and v into one ``attn.qkv`` Linear; a column-wise cut of that would hand rank 0
all of q and half of k. :func:`split_attention_` gives each block separate ``q``, ``k``, ``v`` Linears with
the same weights (:class:`TPAttention`), and ``fuse_qkv`` / ``split_qkv``
(:mod:`course_lib.models.names`, re-exported here) convert weights between the two namings --
the name adapter a checkpoint needs to cross between layouts. Heads and ``d_ff`` must
divide by T (:func:`check_tp`): DTensor's ``from_local`` assumes even pieces.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from course_lib.models.names import fuse_qkv, split_qkv  # noqa: F401 (re-exported: the TP names)

__all__ = ["TP_DIMS", "TPAttention", "split_attention_", "fuse_qkv", "split_qkv", "check_tp", "gpt_plan",
           "mesh_2d", "apply_tp", "apply_fsdp", "local_unit_shapes", "formula_by_axis", "ledger_by_axis",
           "full_weights", "train_2d"]

TP_DIMS = ("dp_shard", "tp")   #: the 2-D mesh: data parallel (sharded by FSDP) × tensor parallel
_QKV = ("q", "k", "v")


class TPAttention(nn.Module):
    """Causal self-attention with separate q, k, v Linears, written for *local* heads: under TP a rank's
    ``q(x)`` holds ``n_heads / T`` heads, and ``view(B, T, -1, head_dim)`` finds how many."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.head_dim = d_model // n_heads
        self.q, self.k, self.v = (nn.Linear(d_model, d_model) for _ in _QKV)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # batch, time
        q, k, v = (m(x).view(B, T, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # [B, H_local, T, hd]
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))               # [B, T, H_local·hd] -> proj


def split_attention_(model: nn.Module) -> nn.Module:
    """Replace every block's fused attention by a :class:`TPAttention` holding the same weights (in place)."""
    cfg = model.cfg
    if cfg.dropout:
        raise ValueError(f"dropout({cfg.dropout}) > 0: TPAttention has no dropout; use GPTConfig(dropout=0.0)")
    for block in model.blocks:
        old, new = block.attn, TPAttention(cfg.d_model, cfg.n_heads)
        with torch.no_grad():
            for m, w, b in zip((new.q, new.k, new.v), old.qkv.weight.chunk(3), old.qkv.bias.chunk(3)):
                m.weight.copy_(w)
                m.bias.copy_(b)
            new.proj.load_state_dict(old.proj.state_dict())
        block.attn = new
    return model


def check_tp(cfg, tp: int) -> None:
    """Refuse a TP degree that does not cut whole heads and whole MLP columns, naming the factors."""
    bad = {k: v for k, v in (("n_heads", cfg.n_heads), ("d_ff", cfg.d_ff)) if v % tp}
    if bad:
        fits = [t for t in range(1, cfg.n_heads + 1) if cfg.n_heads % t == 0 and cfg.d_ff % t == 0]
        raise ValueError(f"tp({tp}) must divide " + " and ".join(f"{k}({v})" for k, v in bad.items())
                         + f": each rank computes whole heads and an even slice of the MLP; TP degrees that fit: {fits}")


def gpt_plan() -> dict:
    """The TP plan of one block: q, k, v and fc column-wise, both projections row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def mesh_2d(dp_shard: int, tp: int, device_type: str = "cpu"):
    """``init_device_mesh(device_type, (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))``: rank
    ``d·T + t``, so a tensor group is T consecutive ranks (on one node, where the link is fast)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if dp_shard * tp != dist.get_world_size():
        raise ValueError(f"dp_shard({dp_shard}) * tp({tp}) = {dp_shard * tp} != WORLD_SIZE({dist.get_world_size()})")
    return init_device_mesh(device_type, (dp_shard, tp), mesh_dim_names=TP_DIMS)


def apply_tp(model, tp_mesh, plan: dict | None = None):
    """Split attention, then ``parallelize_module`` every block over ``tp_mesh`` (the mesh's ``"tp"`` dim)."""
    from torch.distributed.tensor.parallel import parallelize_module
    check_tp(model.cfg, tp_mesh.size())
    split_attention_(model)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan if plan is not None else gpt_plan())
    return model


def apply_fsdp(model, dp_mesh):
    """FSDP2 over the data-parallel dim, bottom-up: every block, then the root."""
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    return fully_shard(model, mesh=dp_mesh)


def local_unit_shapes(model) -> list[list[tuple[int, ...]]]:
    """FSDP units (root, then each block) with each parameter's *TP-local* shape: what FSDP then shards.
    Call it between :func:`apply_tp` and :func:`apply_fsdp`."""
    def shape(p):
        return tuple(p.to_local().shape) if hasattr(p, "to_local") else tuple(p.shape)
    blocks = {id(p) for b in model.blocks for p in b.parameters()}
    return [[shape(p) for p in model.parameters() if id(p) not in blocks]] + \
        [[shape(p) for p in b.parameters()] for b in model.blocks]


def formula_by_axis(units, dp: int, tp: int, *, batch: int, seq: int, d_model: int, n_layers: int,
                    b: int = 4) -> dict[str, float]:
    """Wire bytes one rank sends per step on each mesh dim. ``dp_shard``: FSDP's all-gathers (forward,
    backward) and reduce-scatter of the TP-local pieces, padded on dim 0 (root not resharded after forward).
    ``tp``: per block 2 + 4 all-reduces of the activation ``[batch, seq, d_model]`` (``batch``: this data-
    parallel rank's rows), ring cost ``2(T-1)/T · V`` each."""
    from course_lib.maths import costs
    fsdp = costs.step_cost("fsdp", units, dp, padding="dim0", root_unit=0).wire_bytes if dp > 1 else 0.0
    v = batch * seq * d_model * b
    return {"dp_shard": fsdp, "tp": 6 * n_layers * costs.wire_bytes("all_reduce", v, tp)}


def ledger_by_axis(ledger, *, rank: int = 0, step=None) -> dict[str, float]:
    """Measured wire bytes per mesh dim of one rank's records (the records carry their dim's name)."""
    from course_lib.maths import costs
    out = {"dp_shard": 0.0, "tp": 0.0}
    for r in ledger.filter(rank=rank, step=step):
        out[r.axis] = out.get(r.axis, 0.0) + costs.record_wire_bytes(r)
    return out


def full_weights(model) -> dict[str, np.ndarray]:
    """On every rank: the whole weights under the course GPT's names (DTensors gathered, q/k/v fused)."""
    import logging

    from course_lib.models import to_numpy_weights
    # Gathering a (dp_shard, tp) piece takes two all-gathers; torch logs a warning that says so, per rank.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level, _ = log.level, log.setLevel(logging.ERROR)
    try:
        return fuse_qkv(to_numpy_weights(model))
    finally:
        log.setLevel(level)


def train_2d(cfg, dp: int, tp: int, *, steps: int = 3, batch: int = 8, lr: float = 0.5, seed: int = 0,
             plan: dict | None = None):
    """On a rank: the course GPT as FSDP × TP on a (dp, tp) mesh, SGD (Adam would divide tiny gradients by
    tiny norms and turn rounding into visible weight differences), ``steps`` steps of ``batch`` global
    rows (``batch / dp`` per data-parallel rank). Returns losses, the whole final weights, the local unit
    shapes. ``plan``: the block plan (default :func:`gpt_plan`). With ``dp = tp = 1``: the single-device reference."""
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.models import TokenTask, loss_fn, torch_gpt
    model = torch_gpt(cfg, seed)
    if dp * tp > 1:
        mesh = mesh_2d(dp, tp)
        apply_tp(model, mesh["tp"], plan)
        units = local_unit_shapes(model)
        apply_fsdp(model, mesh["dp_shard"])
        d = mesh["dp_shard"].get_local_rank()
    else:
        units, d = None, 0
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    task, losses = TokenTask(cfg.vocab_size, cfg.seq_len, seed=seed), []
    for s in range(steps):
        x, y = (torch.from_numpy(a) for a in task.rank_batch(s, batch, d, dp))
        with lt.phase("forward", step=s):         # the ledger labels backward's collectives itself
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(lt.unrecorded_mean(loss) if dp * tp > 1 and dist.is_initialized() else loss.item())
    return {"losses": losses, "weights": full_weights(model), "units": units}
