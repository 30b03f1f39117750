"""Per-rank model-state memory: the ZeRO paper's formulas, with and without padding."""
import doctest

import pytest

from course_lib.maths import memory
from course_lib.maths.memory import state_bytes

PSI, N = 7_500_000, 64  # the ZeRO paper's N = 64, with a smaller Ψ


def test_docstrings_run():
    assert doctest.testmod(memory).failed == 0


@pytest.mark.parametrize("strategy, formula", [
    ("dp", 16 * PSI), ("zero1", 8 * PSI + 8 * PSI / N), ("zero2", 4 * PSI + 12 * PSI / N),
    ("zero3", 16 * PSI / N), ("fsdp", 16 * PSI / N),
])
def test_fp32_adam(strategy, formula):
    assert state_bytes(strategy, PSI, N).total == pytest.approx(formula)


@pytest.mark.parametrize("strategy, formula", [
    ("dp", 16 * PSI), ("zero1", 4 * PSI + 12 * PSI / N), ("zero2", 2 * PSI + 14 * PSI / N), ("zero3", 16 * PSI / N),
])
def test_mixed_precision_k12(strategy, formula):
    assert state_bytes(strategy, PSI, N, precision="mixed").total == pytest.approx(formula)


def test_zero_paper_figure_1_gigabytes():
    # fig. 1: Ψ = 7.5B, N = 64, mixed precision: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device
    gb = [state_bytes(s, 7_500_000_000, 64, precision="mixed").total / 1e9 for s in ("dp", "zero1", "zero2", "zero3")]
    assert [round(v, 1) for v in gb] == [120.0, 31.4, 16.6, 1.9]


def test_components_zero2_fp32():
    s = state_bytes("zero2", 1000, 4)
    assert (s.params, s.grads, s.optimizer) == (4000, 1000, 2000)
    assert s.per_psi() == 7.0


def test_padding_option_counts_ceil_psi_over_n():
    # Ψ = 17*257 = 4369 over 4: the paper's Ψ/N = 1092.25; padded, each rank holds 1093 elements
    exact = state_bytes("zero3", 17 * 257, 4)
    padded = state_bytes("zero3", 17 * 257, 4, pad=True)
    assert exact.total == pytest.approx(16 * 4369 / 4)
    assert padded.total == 16 * 1093 and padded.total > exact.total
    # replicated states are never padded
    assert state_bytes("zero1", 4369, 4, pad=True).params == 4 * 4369


def test_tensor_smaller_than_world_padded():
    assert state_bytes("fsdp", 3, 8, pad=True).total == 16  # 3 elements over 8 ranks: 1 element each, 16 bytes


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="hsdp", psi=10, n=4, replicate=3), "must be an int >= 1 that divides n"),
    (dict(strategy="fsdp", psi=10, n=4, replicate=2), "replicate=2 only applies to strategy='hsdp'"),
    (dict(strategy="zero4", psi=10, n=4), "strategy='zero4' must be one of"),
    (dict(strategy="dp", psi=10, n=2, precision="fp16"), "precision='fp16' must be one of"),
    (dict(strategy="dp", psi=-1, n=2), "psi=-1 must be an int >= 0"),
    (dict(strategy="dp", psi=10, n=0), "n=0 must be an int >= 1"),
])
def test_errors_name_the_value_and_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        state_bytes(**kwargs)
