"""Lab 02's exercise checks: the right answer passes, the stub says "not implemented yet", and plausible
wrong answers fail with feedback naming the mistake (storage accounting; ZeRO-1's sharded step; ZeRO-3's
gather and free -- the last two on real gloo ranks)."""
from __future__ import annotations

import pytest

from course_lib.measure import memory as memory_meter
from course_lib.checks import lab02
from course_lib.checks import CheckFailed


# -- exercise 1: storage bytes --------------------------------------------------------------------------
def sizes_of_tensors(tensors):             # numel x element_size: double counts views, misses padding
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def dedup_but_view_size(tensors):          # one count per storage, but of the view, not the storage
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    return total


def no_dedup(tensors):                     # storage size, but every tensor counted
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def elements_not_bytes(tensors):           # one count per storage, in elements
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes() // t.element_size()
    return total


def test_storage_bytes_passes_the_reference_and_a_data_ptr_version(capsys):
    assert lab02.check_storage_bytes(memory_meter.storage_bytes) is True

    def by_data_ptr(tensors):
        seen, total = set(), 0
        for t in tensors:
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total
    assert lab02.check_storage_bytes(by_data_ptr) is True
    assert "✅ storage_bytes" in capsys.readouterr().out


def test_storage_bytes_stub_is_not_implemented(capsys):
    def stub(tensors):
        raise NotImplementedError("Exercise not done yet: count each storage once")
    assert lab02.check_storage_bytes(stub) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (sizes_of_tensors, "counts views twice and misses padding"),
    (dedup_but_view_size, "use the whole storage's nbytes()"),
    (no_dedup, "expected 52 bytes"),
    (elements_not_bytes, "a count of elements"),
])
def test_storage_bytes_names_the_mistake(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab02.check_storage_bytes(wrong)
    assert says in str(err.value)


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


def forgot_divide(full_params, full_grads, shard_params, optimizer):
    import torch

    from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g                   # the sum: Adam hardly notices, the check must
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)


def forgot_gather(full_params, full_grads, shard_params, optimizer):
    import torch
    import torch.distributed as dist

    from course_lib.comm.shim import reduce_scatter_flat
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()


def local_slice(full_params, full_grads, shard_params, optimizer):   # no reduction: own gradient slice
    import torch.distributed as dist

    from course_lib.comm.shim import all_gather_flat
    r, S = dist.get_rank(), shard_params.numel()
    shard_params.grad = full_grads[r * S:(r + 1) * S].clone()
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)


def used_all_reduce(full_params, full_grads, shard_params, optimizer):
    import torch.distributed as dist

    from course_lib.comm.shim import all_gather_flat
    r, n, S = dist.get_rank(), dist.get_world_size(), shard_params.numel()
    dist.all_reduce(full_grads)
    shard_params.grad = full_grads[r * S:(r + 1) * S] / n
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)


def skipped_the_copy(full_params, full_grads, shard_params, optimizer):   # gathers from a view of its output
    import torch
    import torch.distributed as dist

    from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()
    all_gather_flat(shard_params, out=full_params)


def test_sharded_step_passes_the_right_answer(capsys):
    assert lab02.check_sharded_step(right, world_size=4) is True
    assert "✅ sharded_step: on 4 ranks" in capsys.readouterr().out


def test_sharded_step_on_three_ranks_pads_and_passes():
    assert lab02.check_sharded_step(right, world_size=3) is True


def test_sharded_step_stub_is_not_implemented(capsys):
    assert lab02.check_sharded_step(stub, world_size=4) is False
    assert "⏳ sharded_step: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (forgot_divide, "summed instead of averaging"),
    (forgot_gather, "never updated: all-gather"),
    (local_slice, "collective was skipped"),
    (used_all_reduce, "ZeRO needs a reduce_scatter"),
    (skipped_the_copy, "The input must not overlap the output"),
])
def test_sharded_step_names_the_mistake(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab02.check_sharded_step(wrong, world_size=4)
    assert says in str(err.value)


# -- exercise 3: ZeRO-3's gather and free (on ranks) ------------------------------------------------------
def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel() * full.element_size())
    all_gather_flat(shard, out=full)


def free(full):
    full.untyped_storage().resize_(0)


def gather_into_new_tensor(full, shard):    # the parameters never see it
    import torch

    from course_lib.comm.shim import all_gather_flat
    fresh = torch.empty(full.numel())
    all_gather_flat(shard, out=fresh)


def free_by_rebinding(full):                # drops a name; the storage stays allocated
    full = None  # noqa: F841


def gather_own_shard_everywhere(full, shard):   # no communication: copies its own shard N times
    import torch.distributed as dist
    full.untyped_storage().resize_(full.numel() * full.element_size())
    full.copy_(shard.repeat(dist.get_world_size()))


def free_by_zeroing(full):                 # zeros the values; the bytes stay allocated
    full.zero_()


def stub_gather(full, shard):
    raise NotImplementedError("Exercise not done yet: resize the storage, then all-gather")


def test_gather_free_passes_the_right_answer(capsys):
    assert lab02.check_gather_free(gather, free, world_size=4) is True
    assert "✅ gather / free" in capsys.readouterr().out


def test_gather_free_stub_is_not_implemented(capsys):
    assert lab02.check_gather_free(stub_gather, free, world_size=4) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("g, f, says", [
    (gather_into_new_tensor, free, "refill that one"),
    (gather, free_by_rebinding, "release it"),
    (gather_own_shard_everywhere, free, "model output after gather #1"),
    (gather, free_by_zeroing, "release it"),
])
def test_gather_free_names_the_mistake(g, f, says):
    with pytest.raises(CheckFailed) as err:
        lab02.check_gather_free(g, f, world_size=4)
    assert says in str(err.value)
