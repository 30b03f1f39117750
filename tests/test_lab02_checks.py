"""Lab 02's exercise checks: the right answer passes, the stub says "not implemented yet" (storage accounting;
ZeRO-1's sharded step; ZeRO-3's gather and free -- the last two on real gloo ranks). The wrong answers, each with
the diagnosis it must get, are in tests/wrong_answers/lab02.py (tests/test_wrong_answer_kinds.py)."""
from __future__ import annotations

from course_lib.measure import memory as memory_meter
from course_lib.checks import lab02
from exercise_contract import storage_bytes_by_data_ptr


# -- exercise 1: storage bytes --------------------------------------------------------------------------
def test_storage_bytes_passes_the_reference_and_a_data_ptr_version(capsys):
    assert lab02.check_storage_bytes(memory_meter.storage_bytes) is True
    assert lab02.check_storage_bytes(storage_bytes_by_data_ptr) is True
    assert "✅ storage_bytes" in capsys.readouterr().out


def test_storage_bytes_stub_is_not_implemented(capsys):
    def stub(tensors):
        raise NotImplementedError("Exercise not done yet: count each storage once")
    assert lab02.check_storage_bytes(stub) is False
    assert "not implemented yet" in capsys.readouterr().out


# -- exercise 2: ZeRO-1's sharded step (on ranks) --------------------------------------------------------
def right(full_params, full_grads, shard_params, optimizer):
    import torch
    import torch.distributed as dist

    from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)


def stub(full_params, full_grads, shard_params, optimizer):
    raise NotImplementedError("Exercise not done yet: reduce-scatter, step, all-gather")


def test_sharded_step_passes_the_right_answer(capsys):
    assert lab02.check_sharded_step(right, world_size=4) is True
    assert "✅ sharded_step: on 4 ranks" in capsys.readouterr().out


def test_sharded_step_on_three_ranks_pads_and_passes():
    assert lab02.check_sharded_step(right, world_size=3) is True


def test_sharded_step_stub_is_not_implemented(capsys):
    assert lab02.check_sharded_step(stub, world_size=4) is False
    assert "⏳ sharded_step: not implemented yet" in capsys.readouterr().out


# -- exercise 3: ZeRO-3's gather and free (on ranks) ------------------------------------------------------
def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel() * full.element_size())
    all_gather_flat(shard, out=full)


def free(full):
    full.untyped_storage().resize_(0)


def stub_gather(full, shard):
    raise NotImplementedError("Exercise not done yet: resize the storage, then all-gather")


def test_gather_free_passes_the_right_answer(capsys):
    assert lab02.check_gather_free(gather, free, world_size=4) is True
    assert "✅ gather / free" in capsys.readouterr().out


def test_gather_free_stub_is_not_implemented(capsys):
    assert lab02.check_gather_free(stub_gather, free, world_size=4) is False
    assert "not implemented yet" in capsys.readouterr().out
