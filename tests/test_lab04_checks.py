"""Lab 04's exercise checks (FSDP2): right answers pass, stubs are "not implemented yet". The wrong answers and
their diagnoses are in the catalogue, tests/wrong_answers/lab04.py (tests/test_wrong_answer_kinds.py)."""
from __future__ import annotations

from course_lib.checks import lab04


def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def stub_shard_model(model, mesh):
    raise NotImplementedError("Exercise not done yet: fully_shard bottom-up")


def test_shard_model_right_and_stub(capsys):
    assert lab04.check_shard_model(shard_model) is True
    assert "✅ shard_model: 4 units (root + 3 blocks)" in capsys.readouterr().out
    assert lab04.check_shard_model(stub_shard_model) is False
    assert "⏳ shard_model: not implemented yet — fully_shard bottom-up" in capsys.readouterr().out


def set_prefetch(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])


def stub_prefetch(model, depth):
    raise NotImplementedError("Exercise not done yet: two lists per block")


def test_prefetch_plan_right_and_stub(capsys):
    assert lab04.check_prefetch_plan(set_prefetch) is True
    assert capsys.readouterr().out.startswith("✅ set_prefetch: 5 blocks")
    assert lab04.check_prefetch_plan(stub_prefetch) is False
    assert "⏳ set_prefetch: not implemented yet" in capsys.readouterr().out


def test_reference_prefetch_is_the_library_one():
    from course_lib.strategies.fsdp import torch as fsdp2
    assert lab04.check_prefetch_plan(fsdp2.prefetch_ahead) is True


def accumulate_and_clip(model, micro_batches, loss_fn, max_norm):
    import torch
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == k - 1)
        (loss_fn(model(x), y) / k).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def stub_accumulate(model, micro_batches, loss_fn, max_norm):
    raise NotImplementedError("Exercise not done yet: k micro-batches, one sync, one clip")


def test_accumulate_and_clip_right_and_stub(capsys):
    from course_lib.checks import lab04_grads
    assert lab04_grads.check_accumulate_and_clip(accumulate_and_clip) is True
    out = capsys.readouterr().out
    assert out.startswith("✅ accumulate_and_clip: 3 micro-batches, 4 reduce-scatters (one per unit, on the last)")
    assert lab04_grads.check_accumulate_and_clip(stub_accumulate) is False
    assert "⏳ accumulate_and_clip: not implemented yet" in capsys.readouterr().out


def test_the_reference_clip_is_active_and_per_shard_differs():
    """The judge's premises: the clip bites (max_norm below the norm), and per-shard clipping changes the numbers."""
    import numpy as np
    from course_lib.checks import lab04_grads as g
    per_micro = g.reference_grads()
    ref = {n: sum(m[n] for m in per_micro) for n in per_micro[0]}
    assert g._norm(ref) > 2 * g.MAX_NORM
    clipped, shard = g._clip(ref, g.MAX_NORM), g._per_shard(ref, 4, g.MAX_NORM)
    assert abs(g._norm(clipped) - g.MAX_NORM) < 1e-5
    assert not g._close(shard, clipped)
    assert g._norm(shard) > 1.5 * g.MAX_NORM            # every shard clipped to max_norm: about sqrt(4) x
    assert all(np.array_equal(a, b) for a, b in zip(ref.values(), g._clip(ref, 1e9).values()))


def test_judge_rejects_plain_data_that_lies():
    """The judge reads numbers, not claims: a run whose norm is right but whose gradients are missing is refused."""
    import pytest
    from course_lib.checks import lab04_grads as g
    rank = {"returned": {"type": "float", "dtype": None, "values": 3.05}, "ops": [], "grads": None}
    with pytest.raises(AssertionError, match="no gradient for each parameter"):
        g.judge_accumulate_and_clip({"ranks": [rank] * 4})
    with pytest.raises(AssertionError, match="no result from each of 4 ranks"):
        g.judge_accumulate_and_clip({"ranks": [rank] * 3})
