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
