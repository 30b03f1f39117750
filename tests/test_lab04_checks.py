"""Lab 04's exercise checks (FSDP2): right answers pass, stubs are "not implemented yet", wrong
answers are named."""
from __future__ import annotations

import pytest

from course_lib.checks import lab04
from course_lib.checks import CheckFailed


def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def stub_shard_model(model, mesh):
    raise NotImplementedError("Exercise not done yet: fully_shard bottom-up")


def root_only(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)


def blocks_only(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)


def test_shard_model_right_and_stub(capsys):
    assert lab04.check_shard_model(shard_model) is True
    assert "✅ shard_model: 4 units (root + 3 blocks)" in capsys.readouterr().out
    assert lab04.check_shard_model(stub_shard_model) is False
    assert "⏳ shard_model: not implemented yet — fully_shard bottom-up" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [(root_only, "call fully_shard(block) on every block"),
                                         (blocks_only, "call fully_shard(model) last")])
def test_shard_model_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab04.check_shard_model(wrong)
    assert says in str(err.value)


def set_prefetch(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])


def stub_prefetch(model, depth):
    raise NotImplementedError("Exercise not done yet: two lists per block")


def backward_not_reversed(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[i + 1:i + 1 + depth])


def one_ahead(model, depth):
    set_prefetch(model, 1)


def test_prefetch_plan(capsys):
    assert lab04.check_prefetch_plan(set_prefetch) is True
    assert capsys.readouterr().out.startswith("✅ set_prefetch: 5 blocks")
    assert lab04.check_prefetch_plan(stub_prefetch) is False
    assert "⏳ set_prefetch: not implemented yet" in capsys.readouterr().out
    with pytest.raises(CheckFailed) as err:
        lab04.check_prefetch_plan(backward_not_reversed)
    assert "backward runs the blocks in reverse" in str(err.value)
    with pytest.raises(CheckFailed) as err:
        lab04.check_prefetch_plan(one_ahead)
    assert "the next `depth` blocks" in str(err.value)
