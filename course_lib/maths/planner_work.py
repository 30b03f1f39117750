"""What one token costs a transformer layer, counted from the ops it runs: FLOPs and HBM bytes.

The planner (:mod:`course_lib.maths.planner`) turns these counts into seconds with the rates of
:mod:`course_lib.maths.planner_hw`. Nothing here is fitted: every number is read off the ops a Llama-style
block (RMSNorm, RoPE, SwiGLU, as torchtitan writes it) or a GPT/MPT-style block (fused LayerNorm, GELU, fused
QKV, ALiBi inside the attention kernel) runs, in bf16 (2 bytes per element).

**Memory-bound work** (bytes per token and layer, forward; backward reads the saved input and the incoming
gradient and writes a gradient, so it moves twice the forward's bytes):

============================  ==========================================  ======================================
op (per element)              eager PyTorch                               ``torch.compile`` (Inductor fuses)
============================  ==========================================  ======================================
RMSNorm (Llama reference)     x.float r2 w4, pow r4 w4, mean r4,          one kernel, with the residual add:
                              x*rsqrt r4 w4, type_as r4 w2, *w r2 w2: 36   read x and the branch, write both: 8
LayerNorm (fused kernel)      r2 w2: 4                                    4 (+ the residual add folded in: 8)
residual add                  r4 w2: 6                                    folded into the next norm: 0
RoPE on q and k               .float r2 w4, complex mul r4 w4,            r2 w2: 4
                              type_as r4 w2: 20
attention output transpose    .contiguous r2 w2: 4                        folded: 0
SwiGLU (per d_ff element)     silu r2 w2, mul r4 w2: 10                   r4 w2: 6
GELU (per d_ff element)       r2 w2: 4                                    4
============================  ==========================================  ======================================

**Loss** (per token, ``V`` = vocabulary), by how the step writes it (``loss=``): ``"fp32"`` (eager,
``F.cross_entropy(logits.float(), y)`` as torchtitan and ``course_lib.train`` write it) -- logits.float() r2 w4,
log_softmax r8 w4, nll backward writes a dense fp32 gradient w4, log_softmax backward r8 w4, the cast back
r4 w2: ``40·V`` bytes; ``"bf16"`` (eager on the bf16 logits) -- log_softmax r4 w2, nll backward w2,
log_softmax backward r4 w2: ``16·V``; ``"fused"`` (one fused cross-entropy forward and backward: Inductor's, or
XLA's fusion of the same ops in JAX): read the logits twice and write their gradient: ``8·V``; ``"chunked"``
(``course_lib.train``'s ``fused_loss_fn``: the gradient made in the forward, one chunk of fp32 at a time) -- the
cast r2 w4, log_softmax r4 w4, exp in place r4 w4, the gradient written back r4 w2, its scaling in backward r2
w2: ``32·V``.

**Float8 scaling** (torchao's dynamic tensorwise recipe, as torchtitan runs it): every linear's input and its
output gradient get an amax (read 2 B) and a cast to fp8 (read 2, write 1), and the backward a transposed fp8
copy (read 1, write 1): 7 bytes per element eager, 3 when compiled (amax and cast fuse into the op that wrote
the tensor); weights the same per micro-step, per parameter.

FLOPs per token: ``2·(parameters of every matmul)`` forward, twice that backward; attention forward
``2·s·d`` causal (QKᵀ and PV, each halved), flash attention's backward 2.5 x the forward
(it recomputes QKᵀ) -- the FlashAttention papers' own count, so their measured rates apply.
"""
from __future__ import annotations

__all__ = ["block_matmuls", "matmul_flops_per_token", "attention_flops_per_token", "pointwise_bytes_per_token",
           "loss_bytes_per_token", "LOSS_KINDS", "LOSS_CHUNK_BYTES", "recomputed_matmul_fraction",
           "saved_bytes_per_token",
           "outside_layers_bytes_per_token",
           "float8_bytes_per_token"]


def block_matmuls(m) -> list[tuple[int, int]]:
    """A block's linears in the order its forward runs them, ``(in, out)``: Llama q, k, v, o, w1, w3, w2;
    MPT (fused QKV) Wqkv, out, up, down."""
    d, kv, f = m.d_model, m.d_kv, m.d_ff
    attn = [(d, d + 2 * kv), (d, d)] if m.fused_qkv else [(d, d), (d, kv), (d, kv), (d, d)]
    mlp = [(d, f), (d, f), (f, d)] if m.gated_mlp else [(d, f), (f, d)]
    return attn + mlp


def matmul_flops_per_token(m) -> tuple[float, float]:
    """``(block, head)`` forward matmul FLOPs per token: every block's linears, and the output head."""
    return 2.0 * m.n_layers * sum(i * o for i, o in block_matmuls(m)), 2.0 * m.d_model * m.vocab_size


def attention_flops_per_token(m, s: int) -> float:
    """Forward causal attention FLOPs per token, all layers: ``2·s·d`` per layer (QKᵀ and PV, half the square)."""
    return 2.0 * s * m.d_model * m.n_layers


def pointwise_bytes_per_token(m, compile: bool) -> float:
    """Forward bytes per token of one layer's norms, residual adds, RoPE, activation (table above)."""
    d, kv, f = m.d_model, m.d_kv, m.d_ff
    rms = m.norm == "rms"
    if compile:
        norms = 2 * 8 * d
        rope = 4 * (d + kv) if m.rope else 0
        act = (6 if m.gated_mlp else 4) * f
        return norms + rope + act
    norms = 2 * (36 if rms else 4) * d
    adds = 2 * 6 * d
    rope = 20 * (d + kv) if m.rope else 0
    act = (10 if m.gated_mlp else 4) * f
    return norms + adds + rope + 4 * d + act


LOSS_KINDS = ("fp32", "bf16", "fused", "chunked")   #: how the cross-entropy is written (module docstring)
#: fp32 logits of one chunk of ``"chunked"`` (``course_lib.models.torch_gpt.LOSS_CHUNK_BYTES``; maths imports no models)
LOSS_CHUNK_BYTES = 1 << 28


def loss_bytes_per_token(m, compile: bool | str) -> float:
    """Forward + backward bytes per token of the loss over ``V`` logits: ``compile`` is a :data:`LOSS_KINDS`
    name, or a bool (True: ``"fused"``, False: ``"fp32"``)."""
    kind = compile if isinstance(compile, str) else ("fused" if compile else "fp32")
    if kind not in LOSS_KINDS:
        raise ValueError(f"loss={kind!r} must be one of {LOSS_KINDS}")
    return {"fp32": 40, "bf16": 16, "fused": 8, "chunked": 32}[kind] * m.vocab_size


def float8_bytes_per_token(m, compile: bool) -> float:
    """Extra bytes per token, all layers, fwd + bwd, of float8's amax and casts (inputs and output grads)."""
    per = 3 if compile else 7
    return per * m.n_layers * sum(i + o for i, o in block_matmuls(m))


def recomputed_matmul_fraction(m, checkpointing: str) -> float:
    """Fraction of a block's forward matmul FLOPs run again in backward: 0 (none), 1 (full), and for
    torchtitan's per-op selective checkpointing every second ``mm`` of each block (``mm_count % 2 == 0`` is
    recomputed: k, o, w3 in a Llama block; out, down in MPT's) -- torchtitan
    ``torchtitan/distributed/activation_checkpoint.py``, ``_custom_policy``."""
    if checkpointing == "none":
        return 0.0
    mms = block_matmuls(m)
    total = sum(i * o for i, o in mms)
    if checkpointing == "full":
        return 1.0
    return sum(i * o for k, (i, o) in enumerate(mms, 1) if k % 2 == 0) / total


def outside_layers_bytes_per_token(m, autocast: bool = False) -> float:
    """Bytes per token autograd keeps outside the layers: the final norm's input (bf16 2d; fp32 under autocast),
    the head's input (2d) and the token ids (int64, 8). Measured on the course GPT (tests/test_planner_memory.py):
    the layer table alone left them out. The planner adds them on ``course_lib.train``'s path (``autocast`` or the
    chunked loss), where they were measured; at the published runs' sizes they are under 0.3% of the memory and
    left out, so those plans (and Lab 08's printed figures) stand as validated."""
    return (4 if autocast else 2) * m.d_model + 2 * m.d_model + 8


def saved_bytes_per_token(m, checkpointing: str, autocast: bool = False) -> float:
    """Bytes one layer keeps for backward per token (bf16, flash attention: no ``s x s`` matrix).

    none: the block's saved inputs -- 2 norms, the qkv input, Q, K, V, the attention output, the MLP input
    (``12d + 4·d_kv``) -- plus the MLP's hidden tensors (``6·d_ff`` SwiGLU, ``4·d_ff`` GELU); for GPT-3
    (``d_ff = 4d``) ``32·d``: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models" (MLSys 2023), ``34·s·b·h`` less its two dropout masks. selective (torchtitan per-op): the layer
    input and the outputs of the matmuls it keeps (every odd one) and of attention. full: the layer input.

    ``autocast`` (``torch.autocast`` to bf16, what ``course_lib.train`` runs at world size 1): the residual stream
    stays fp32 and norms run in fp32, so each norm's saved input is 4d, not 2d (+4d a layer; the layer input +2d
    under checkpointing). Measured on the course GPT under saved-tensor hooks (tests/test_planner_memory.py): the
    bf16 count within 1% (the norms' and attention's per-row statistics are the rest), autocast's likewise.
    """
    d, kv, f = m.d_model, m.d_kv, m.d_ff
    fp32_inputs = 2.0 * d if autocast else 0.0      # per norm input kept in fp32 rather than bf16
    if checkpointing == "full":
        return 2.0 * d + fp32_inputs
    if checkpointing == "selective":
        kept = sum(o for k, (_, o) in enumerate(block_matmuls(m), 1) if k % 2 == 1)
        return 2.0 * d + 2.0 * kept + 2.0 * d + fp32_inputs   # layer input + kept mm outputs + attention output
    return 12.0 * d + 4.0 * kv + (6 if m.gated_mlp else 4) * f + 2 * fp32_inputs
