"""Expert parallelism's terms: a mixture-of-experts layer's parameters, FLOPs, all-to-all bytes and memory.

``E`` routed experts per MoE layer (plus ``shared_experts`` every token runs), ``top_k`` of them per token
(Lepikhin et al., "GShard: Scaling Giant Models with Conditional Computation and Automatic Sharding"; Fedus et
al., "Switch Transformers: Scaling to Trillion Parameter Models with Simple and Efficient Sparsity"), spread over
``ep`` ranks. Dispatch and combine are two all-to-alls forward and two backward, each moving
``tokens·top_k·d·bytes·(ep-1)/ep`` per rank (routing uniform: ``1/ep`` of a rank's routed tokens stay home); the
experts' parameters divide by ``ep``; FLOPs follow the active parameters (``6·N_active`` per token), not the total.

:func:`active_shape` is the dense model that runs the same FLOPs and saves the same activations per token (both
linear in ``d_ff``): :func:`course_lib.maths.planner_dims.plan` prices a MoE model's compute with it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from course_lib.maths.planner import positive_ints

__all__ = ["MoE", "moe_params", "moe_active_params", "moe_flops_per_token", "all_to_all_bytes_per_layer",
           "expert_state_bytes", "active_shape"]


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP in ``moe_layers`` of the model's layers (the rest keep the dense MLP)."""

    n_experts: int        #: routed experts per MoE layer, E
    top_k: int            #: experts each token is sent to
    d_ff_expert: int      #: an expert's hidden width (gated: 3 matrices of d x d_ff_expert)
    moe_layers: int       #: how many layers are MoE
    shared_experts: int = 0   #: experts every token also runs (DeepSeek's shared expert), kept on every rank

    def __post_init__(self):
        positive_ints("MoE", n_experts=self.n_experts, top_k=self.top_k, d_ff_expert=self.d_ff_expert,
                      moe_layers=self.moe_layers)
        if self.top_k > self.n_experts or self.shared_experts < 0:
            raise ValueError(f"top_k({self.top_k}) must be <= n_experts({self.n_experts}) and shared_experts"
                             f"({self.shared_experts}) >= 0; e.g. MoE(n_experts=8, top_k=2, ...)")


def moe_params(model, moe: MoE) -> tuple[float, float]:
    """``(dense, expert)`` parameters: the model with its MoE layers' dense MLP swapped for ``E`` routed and
    the shared experts (gated, 3 matrices each) and a router of ``d x E``."""
    d = model.d_model
    mlp = (3 if model.gated_mlp else 2) * d * model.d_ff
    expert = 3 * d * moe.d_ff_expert
    dense = model.params - moe.moe_layers * mlp + moe.moe_layers * (moe.shared_experts * expert + d * moe.n_experts)
    return float(dense), float(moe.moe_layers * moe.n_experts * expert)


def moe_active_params(model, moe: MoE) -> float:
    """Parameters a token runs through: the dense part and ``top_k`` of each MoE layer's experts."""
    dense, _ = moe_params(model, moe)
    return dense + moe.moe_layers * moe.top_k * 3 * model.d_model * moe.d_ff_expert


def moe_flops_per_token(model, moe: MoE, seq_len: int | None = None) -> float:
    """``6·N_active + 12·L·d·s`` (PaLM's count, on the active parameters, the input embedding left out)."""
    s = seq_len or model.seq_len
    emb = model.vocab_size * model.d_model * (not model.tied_embeddings)
    return 6 * (moe_active_params(model, moe) - emb) + 12 * model.n_layers * model.d_model * s


def all_to_all_bytes_per_layer(tokens: int, moe: MoE, d_model: int, ep: int, bytes_per: int = 2) -> float:
    """Bytes one rank sends per MoE layer and step: dispatch + combine forward, their gradients backward, each
    ``tokens·top_k·d·bytes·(ep-1)/ep`` (the share of its routed tokens bound for other ranks, routing uniform)."""
    return 4 * tokens * moe.top_k * d_model * bytes_per * (ep - 1) / ep


def expert_state_bytes(model, moe: MoE, ep: int, shards: int = 1, bytes_per_param: float = 16) -> float:
    """Model-state bytes per GPU of the routed experts: ``E/ep`` experts per rank, each further sharded
    ``shards`` ways (FSDP over the rest), at ``bytes_per_param`` (16: bf16 + fp32 grads and Adam, the ZeRO K)."""
    if moe.n_experts % ep:
        raise ValueError(f"ep({ep}) must divide n_experts({moe.n_experts})")
    return moe_params(model, moe)[1] / ep / shards * bytes_per_param


def active_shape(model, moe: MoE):
    """``model`` with the MLP width a token really runs, averaged over its layers: ``(top_k + shared)·d_ff_expert``
    in the MoE layers, ``d_ff`` in the rest. Matmul FLOPs and saved activations per token are linear in ``d_ff``,
    so they match the MoE model's (up to rounding the average to an int)."""
    if moe.moe_layers > model.n_layers or not model.gated_mlp:
        raise ValueError(f"moe_layers({moe.moe_layers}) must be <= n_layers({model.n_layers}) and the MLP gated "
                         f"(gated_mlp={model.gated_mlp}): experts are SwiGLU")
    width = (model.n_layers - moe.moe_layers) * model.d_ff + moe.moe_layers * (moe.top_k + moe.shared_experts) \
        * moe.d_ff_expert
    return dataclasses.replace(model, name=f"{model.name} (active)", d_ff=round(width / model.n_layers))
