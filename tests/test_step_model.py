"""The step-time model: FLOPs, units, the two fitted lines and the prediction, by hand."""
import math

import pytest

from course_lib.maths import step_model
from course_lib.maths.costs import AlphaBeta, wire_bytes
from course_lib.maths.step_model import CommModel, ComputeModel, fit_framework_overhead, gpt_units, predict, train_flops
from course_lib.models.config import LAB_CONFIG, GPTConfig

TINY = GPTConfig(vocab_size=17, seq_len=8, d_model=12, n_heads=3, n_layers=2, d_ff=257)
COMM = CommModel({(op, n): AlphaBeta(a * 1e-3, 1e-9) for n in (2, 4)
                  for op, a in (("all_gather", 1), ("reduce_scatter", 2), ("all_reduce", 3))})
COMPUTE = ComputeModel(0.01, 1e9)


@pytest.mark.parametrize("cfg", [LAB_CONFIG, TINY])
def test_units_match_the_torch_model(cfg):
    import torch

    from course_lib.models import TorchGPT
    from course_lib.strategies.hsdp import torch as hsdp
    with torch.device("meta"):
        model = TorchGPT(cfg)
    assert gpt_units(cfg) == hsdp.unit_shapes(model)


def test_train_flops_by_hand():
    # per block: qkv 36x12, proj 12x12, fc 257x12, proj 12x257 = 432 + 144 + 3084 + 3084 = 6744; x2 + head 17x12
    matmul = 2 * 6744 + 17 * 12
    assert train_flops(TINY, 10) == 10 * (6 * matmul + 12 * 2 * 12 * 8)


def test_compute_fit_recovers_a_line_and_refuses_a_flat_one():
    m = ComputeModel.fit([1e9, 4e9], [0.01 + 1.0, 0.01 + 4.0])
    assert m.overhead_s == pytest.approx(0.01) and m.flops_per_s == pytest.approx(1e9)
    with pytest.raises(ValueError, match="do not grow"):
        ComputeModel.fit([1e9, 4e9], [0.5, 0.4])
    with pytest.raises(ValueError, match=r"flops_per_s\(0\)"):
        ComputeModel(0.0, 0)


def test_dp_prediction_by_hand():
    p = predict("dp", TINY, 4, 8, COMPUTE, COMM)
    psi = sum(math.prod(s) for u in gpt_units(TINY) for s in u)
    comm = 3e-3 * 3 + 1e-9 * wire_bytes("all_reduce", psi * 4, 4)   # 3 units -> 3 all-reduces
    assert p.comm_s == pytest.approx(comm)
    assert p.compute_s == pytest.approx(0.01 + train_flops(TINY, 2 * 8) / 1e9)
    assert p.step_s == pytest.approx(p.compute_s + comm) and p.framework_s == 0


def test_fsdp_prediction_counts_calls_and_framework():
    p = predict("fsdp", TINY, 4, 8, COMPUTE, COMM, root_unit=0, per_collective_s=0.002)
    # 3 units: 3 all-gathers forward, 2 backward (root kept), 3 reduce-scatters
    assert [(o.op, o.phase, o.count) for o in p.cost.ops] == [("all_gather", "forward", 3),
                                                              ("all_gather", "backward", 2),
                                                              ("reduce_scatter", "backward", 3)]
    assert p.collectives == p.framework_calls == 8 and p.framework_s == pytest.approx(0.016)
    alpha = (3 + 2) * 1e-3 + 3 * 2e-3
    assert p.comm_s == pytest.approx(alpha + 1e-9 * p.cost.wire_bytes)
    hidden = predict("fsdp", TINY, 4, 8, COMPUTE, COMM, root_unit=0, overlap=1.0)
    assert hidden.step_s == pytest.approx(hidden.compute_s)


def test_hsdp_uses_group_fits():
    p = predict("hsdp", TINY, 4, 8, COMPUTE, COMM, replicate=2, per_collective_s=0.001)
    assert {o.group_size for o in p.cost.ops} == {2}
    assert "all_reduce (backward)" in p.comm_by_op
    assert p.collectives == 12 and p.framework_calls == 9 and p.framework_s == pytest.approx(0.009)   # no γ on all-reduces


def test_errors_name_the_fix():
    with pytest.raises(KeyError, match=r"calibrated: \[\('all_gather', 2\)\]"):
        predict("fsdp", TINY, 4, 8, COMPUTE, CommModel({("all_gather", 2): AlphaBeta(0, 0)}))
    with pytest.raises(ValueError, match=r"batch\(6\).*n\(4\)"):
        predict("dp", TINY, 4, 6, COMPUTE, COMM)
    with pytest.raises(ValueError, match="strategy='zero2'"):
        predict("zero2", TINY, 4, 8, COMPUTE, COMM)
    with pytest.raises(ValueError, match="must be"):
        CommModel({"all_gather": AlphaBeta(0, 0)})


def test_framework_overhead_is_the_residual_per_call():
    p = predict("fsdp", TINY, 4, 8, COMPUTE, COMM, root_unit=0)
    assert fit_framework_overhead(p.step_s + 0.08, p) == pytest.approx(0.01)
    assert fit_framework_overhead(p.step_s / 2, p) == 0.0
    assert step_model.STRATEGIES == ("dp", "fsdp", "hsdp")
