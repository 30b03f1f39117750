"""FLOPs per token: the one definition of MFU's numerator in the course.

``course_lib.train``, ``course_lib.train_jax``, ``python -m course_lib bench gpu-mfu``, the step-time model
(:mod:`~course_lib.maths.step_model`) and the planner (:mod:`~course_lib.maths.planner`) all call
:func:`model_flops_per_token`, so they report the same MFU for the same model:

    FLOPs per token = 6·N + 12·L·d·s

* ``6·N`` -- every matmul weight, forward (2 FLOPs per weight: a multiply and an add) and backward (twice the
  forward: the gradient of the input and of the weight). ``N`` counts matmul weights only: each block's linears
  and the output head. **Embedding lookups are not counted** (a lookup reads a row, it multiplies nothing), nor
  biases, norms or the positional table (elementwise, and under 0.1% of the work at any real size).
* ``12·L·d·s`` -- attention's two ``s × s`` products (``QKᵀ`` and ``PV``), forward and backward, per layer,
  counted at full ``s`` as if not causal.

This is the convention of Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways" (2022, appendix B,
"model FLOPs utilization"), which torchtitan, Megatron-LM and the published runs the planner is checked against
follow: MFU counts the model's work, not the work a particular run did (recomputation under activation
checkpointing is *hardware* FLOPs: :attr:`course_lib.maths.planner.Plan.hfu`). Counting the lookups would
inflate MFU most on small models with large vocabularies, the course's own. Pure arithmetic: no torch.
"""
from __future__ import annotations

import math

__all__ = ["model_flops_per_token", "gpt_flops_per_token", "gpt_matmul_params", "gpt_block_shapes"]


def model_flops_per_token(matmul_params: int, n_layers: int, d_model: int, seq_len: int) -> float:
    """``6·N + 12·L·d·s`` (module docstring): forward + backward FLOPs per token, ``N = matmul_params``."""
    return 6.0 * matmul_params + 12.0 * n_layers * d_model * seq_len


def gpt_block_shapes(cfg) -> list[tuple[int, ...]]:
    """One block of the course GPT: ln1, qkv, proj, ln2, fc, proj -- weight ``[out, in]`` then bias ``[out]``."""
    C, F_ = cfg.d_model, cfg.d_ff
    return [(C,), (C,), (3 * C, C), (3 * C,), (C, C), (C,), (C,), (C,), (F_, C), (F_,), (C, F_), (C,)]


def gpt_matmul_params(cfg) -> int:
    """``N`` of the course GPT (any object with ``vocab_size, d_model, n_layers, d_ff``, e.g. ``GPTConfig``):
    every block's 2-D weights and the head; the token and position embeddings are lookups."""
    return sum(math.prod(s) for s in gpt_block_shapes(cfg) if len(s) == 2) * cfg.n_layers \
        + cfg.vocab_size * cfg.d_model


def gpt_flops_per_token(cfg) -> float:
    """:func:`model_flops_per_token` of the course GPT at its own ``seq_len``."""
    return model_flops_per_token(gpt_matmul_params(cfg), cfg.n_layers, cfg.d_model, cfg.seq_len)
