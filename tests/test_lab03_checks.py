"""Lab 03's exercise checks: the right answer passes, a stub says "not implemented yet", and
plausible wrong answers fail with feedback that names the mistake."""
from __future__ import annotations

import pytest
import torch

from course_lib.strategies import fsdp
from course_lib.checks import lab03
from course_lib.checks import CheckFailed
from course_lib.strategies.fsdp import State


# -- exercise 1: flat shard ----------------------------------------------------------------------------
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S].clone()


def stub_shard(tensors, rank, world):
    raise NotImplementedError("Exercise not done yet: flatten, pad, slice")


def chunk_no_padding(tensors, rank, world):
    return torch.cat([t.reshape(-1) for t in tensors]).tensor_split(world)[rank]


def padded_in_front(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat.new_zeros(S * world - flat.numel()), flat])
    return flat[rank * S:(rank + 1) * S]


def next_ranks_shard(tensors, rank, world):
    return flat_shard(tensors, (rank + 1) % world, world)


def test_flat_shard_right_and_stub(capsys):
    assert lab03.check_flat_shard(flat_shard) is True
    assert capsys.readouterr().out.startswith("✅ flat_shard:")
    assert lab03.check_flat_shard(stub_shard) is False
    assert "⏳ flat_shard: not implemented yet — flatten, pad, slice" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (chunk_no_padding, "pad the flat buffer with zeros"),
    (padded_in_front, "padding is at the front"),
    (next_ranks_shard, "shifted by 1 shard"),
])
def test_flat_shard_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab03.check_flat_shard(wrong)
    assert says in str(err.value)


# -- exercise 2: the Unshard autograd.Function ---------------------------------------------------------
def _make(divide=True, reduce="scatter", free=True, inplace=False):
    class Unshard(torch.autograd.Function):
        @staticmethod
        def forward(ctx, sharded, flat):
            import torch.distributed as dist
            full = torch.empty(dist.get_world_size() * sharded.numel())
            dist.all_gather_into_tensor(full, sharded)
            flat.unsharded, flat.state, ctx.flat = full, State.UNSHARDED, flat
            return full

        @staticmethod
        def backward(ctx, grad_full):
            import torch.distributed as dist
            n, r = dist.get_world_size(), dist.get_rank()
            if reduce == "scatter":
                grad = torch.empty(grad_full.numel() // n)
                dist.reduce_scatter_tensor(grad, grad_full.contiguous())
            else:
                g = grad_full.clone()
                dist.all_reduce(g)
                grad = g.chunk(n)[r].clone()
            if free:
                ctx.flat.reshard()
            if inplace:
                return grad.div_(n), None
            return (grad / n if divide else grad), None
    return Unshard


class StubUnshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sharded, flat):
        raise NotImplementedError("Exercise not done yet: all-gather")


def test_unshard_right_and_stub(capsys):
    assert lab03.check_unshard_function(_make()) is True
    assert "✅ Unshard: gathers 4,628 elements (2 of padding)" in capsys.readouterr().out
    assert lab03.check_unshard_function(StubUnshard) is False
    assert "⏳ Unshard: not implemented yet" in capsys.readouterr().out


def test_unshard_with_an_in_place_division_passes_every_time(capsys):
    """grad.div_(N) right after the reduce-scatter is a right answer (the course's ledger once re-waited
    gloo's reduce-scatter, which copied the undivided chunk over it again now and then)."""
    for _ in range(5):
        assert lab03.check_unshard_function(_make(inplace=True)) is True


@pytest.mark.parametrize("kwargs, says", [
    (dict(divide=False), "summed instead of averaging"),
    (dict(reduce="all"), "an all_reduce sends 2× the bytes"),
    (dict(free=False), "still UNSHARDED after backward"),
])
def test_unshard_wrong_answers_are_named(kwargs, says):
    with pytest.raises(CheckFailed) as err:
        lab03.check_unshard_function(_make(**kwargs))
    assert says in str(err.value)


# -- exercise 3 and 4: the unit lifecycle, prefetch ----------------------------------------------------
class MyFSDP(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        flat.set_views(_make().apply(flat.sharded, flat))

    def post_forward(self, flat):
        flat.reshard()

    def pre_backward(self, flat):
        flat.unshard()


class StubFSDP(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        raise NotImplementedError("Exercise not done yet: gather, set views")


class NeverFrees(MyFSDP):
    def post_forward(self, flat):
        pass


class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard(async_op=True)


def test_fsdp_class_right_stub_and_never_freeing(capsys):
    assert lab03.check_fsdp_class(MyFSDP, steps=2) is True
    assert "✅ MyFSDP: losses match DDP over 2 steps; per step 4 all-gathers forward" in capsys.readouterr().out
    assert lab03.check_fsdp_class(StubFSDP, steps=1) is False
    assert "⏳ MyFSDP: not implemented yet" in capsys.readouterr().out
    with pytest.raises(CheckFailed) as err:
        lab03.check_fsdp_class(NeverFrees, steps=1)
    assert "post_forward must call flat.reshard()" in str(err.value)


def test_prefetch_right_and_missing(capsys):
    assert lab03.check_prefetch(Prefetching, steps=1) is True
    assert "root + 2 blocks" in capsys.readouterr().out
    with pytest.raises(CheckFailed) as err:
        lab03.check_prefetch(fsdp.FlatFSDP, steps=1)
    assert "next.unshard(async_op=True)" in str(err.value)
