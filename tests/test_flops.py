"""One definition each: FLOPs per token (MFU's numerator), GPU peaks (its denominator), the LR warm-up.

Every caller -- the torch and JAX trainers, ``bench gpu-mfu``, the step-time model, the planner -- reaches the
same numbers, so the MFU one reports is the MFU another reports for the same model and GPU."""
import math

import pytest

from course_lib.maths.flops import gpt_flops_per_token, gpt_matmul_params, model_flops_per_token
from course_lib.maths.planner import ModelShape
from course_lib.maths.planner_hw import A100_80GB, H100, peak_flops
from course_lib.maths.schedule import Warmup
from course_lib.maths.step_model import train_flops
from course_lib.models.config import GPTConfig, param_count

CFG = GPTConfig(vocab_size=17, seq_len=8, d_model=12, n_heads=3, n_layers=2, d_ff=257)


def test_embeddings_are_lookups_not_matmuls():
    """N is every block's linears and the head: not the token or position tables, nor biases and norms."""
    C, V, T, L, F = CFG.d_model, CFG.vocab_size, CFG.seq_len, CFG.n_layers, CFG.d_ff
    assert gpt_matmul_params(CFG) == L * (3 * C * C + C * C + 2 * F * C) + V * C
    assert gpt_matmul_params(CFG) < param_count(CFG) - V * C - T * C   # biases and norms left out too
    assert gpt_flops_per_token(CFG) == 6 * gpt_matmul_params(CFG) + 12 * L * C * T


def test_the_step_model_and_the_planner_count_the_course_gpt_alike():
    """The planner's shape of the course GPT (GELU MLP, fused QKV, LayerNorm, an untied head) gets the same
    FLOPs per token as the trainers' count: one formula, whichever door it is reached through."""
    shape = ModelShape("course GPT", CFG.n_layers, CFG.d_model, CFG.n_heads, CFG.n_heads, CFG.d_ff,
                       CFG.vocab_size, CFG.seq_len, gated_mlp=False, tied_embeddings=False, norm="layer",
                       rope=False, fused_qkv=True)
    assert shape.model_flops_per_token() == gpt_flops_per_token(CFG) == train_flops(CFG, 1)
    assert train_flops(CFG, 10) == 10 * gpt_flops_per_token(CFG)
    assert model_flops_per_token(1, 1, 1, 1) == 18.0


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A10", 125e12),
                                        ("NVIDIA L4", 121e12), ("cpu", None), ("", None)])
def test_one_table_of_gpu_peaks(name, peak):
    """An A100's name holds "A10" too: the A100 is matched first."""
    assert peak_flops(name) == peak


def test_the_peaks_are_the_planners_gpus():
    assert peak_flops("H100") == H100.peak_flops and peak_flops("A100") == A100_80GB.peak_flops


def test_warmup_is_linear_then_flat_for_torch_and_for_jax():
    w = Warmup(4)
    assert [w(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    import numpy as np
    assert np.allclose(w(np.arange(6), np.minimum), [0.25, 0.5, 0.75, 1.0, 1.0, 1.0])   # as optax calls it
    with pytest.raises(ValueError, match="warm-up steps"):
        Warmup(0)


def test_lambda_lr_saves_and_restores_the_warmup():
    import torch
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(8))
    sd = sched.state_dict()
    assert sd["lr_lambdas"] == [{"steps": 8}]
    other = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(3))
    other.load_state_dict(sd)
    assert other.lr_lambdas[0].steps == 8 and math.isclose(other.lr_lambdas[0](0), 1 / 8)
