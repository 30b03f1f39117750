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


def root_first(model, mesh):                    # top-down: the root takes everything, blocks then break it
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)


def every_linear(model, mesh):                  # units too small: every Linear its own unit
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        for m in block.modules():
            if isinstance(m, __import__("torch").nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def never_reshards(model, mesh):                # reshard_after_forward=False: ZeRO-2's traffic and memory
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)


def skips_last_block(model, mesh):              # off by one: the last block stays in the root
    from torch.distributed.fsdp import fully_shard
    for block in list(model.blocks)[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def bf16_params(model, mesh):                   # a knob that halves what is gathered: not what was asked
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def test_shard_model_right_and_stub(capsys):
    assert lab04.check_shard_model(shard_model) is True
    assert "✅ shard_model: 4 units (root + 3 blocks)" in capsys.readouterr().out
    assert lab04.check_shard_model(stub_shard_model) is False
    assert "⏳ shard_model: not implemented yet — fully_shard bottom-up" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [(root_only, "call fully_shard(block) on every block"),
                                         (blocks_only, "call fully_shard(model) last"),
                                         (root_first, "the root was sharded before the blocks"),
                                         (every_linear, "sharding each layer inside a block"),
                                         (never_reshards, "reshard_after_forward=False"),
                                         (skips_last_block, "call fully_shard(block) on every block"),
                                         (bf16_params, "a knob changed what is sent")])
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


def includes_itself(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i:i + depth])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])


def wraps_around(model, depth):
    blocks = list(model.blocks)
    L = len(blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch([blocks[(i + k) % L] for k in range(1, depth + 1) if (i + k) % L != i])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])


def backward_far_first(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i])


def every_block(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:])
        block.set_modules_to_backward_prefetch(blocks[:i][::-1])


def test_prefetch_plan_right_and_stub(capsys):
    assert lab04.check_prefetch_plan(set_prefetch) is True
    assert capsys.readouterr().out.startswith("✅ set_prefetch: 5 blocks")
    assert lab04.check_prefetch_plan(stub_prefetch) is False
    assert "⏳ set_prefetch: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (backward_not_reversed, "backward runs the blocks in reverse"),
    (one_ahead, "use `depth`, not a fixed number"),
    (includes_itself, "prefetches itself"),
    (wraps_around, "wraps around"),
    (backward_far_first, "nearest first"),
    (every_block, "prefetching every block holds them all"),
])
def test_prefetch_plan_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab04.check_prefetch_plan(wrong)
    assert says in str(err.value)


def test_reference_prefetch_is_the_library_one():
    from course_lib.strategies.fsdp import torch as fsdp2
    assert lab04.check_prefetch_plan(fsdp2.prefetch_ahead) is True
