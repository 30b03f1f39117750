"""Lab 03's exercise checks: the right answer passes, a stub says "not implemented yet", and
plausible wrong answers fail with feedback that names the mistake."""
from __future__ import annotations

import pytest
import torch

from course_lib.strategies.fsdp import scratch as fsdp
from course_lib.checks import lab03
from course_lib.checks import CheckFailed
from course_lib.strategies.fsdp.scratch import State


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


def floor_division(tensors, rank, world):          # S = numel // world: the remainder is lost
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = flat.numel() // world
    return flat[rank * S:(rank + 1) * S].clone()


def pads_each_tensor(tensors, rank, world):        # pads every tensor to a multiple of world on its own
    parts = []
    for t in tensors:
        f = t.reshape(-1)
        parts += [f, f.new_zeros(-(-f.numel() // world) * world - f.numel())]
    flat = torch.cat(parts)
    S = flat.numel() // world
    return flat[rank * S:(rank + 1) * S].clone()


def float32_padding(tensors, rank, world):          # torch.zeros(k) and a float32 buffer: loses float64
    flat = torch.cat([t.reshape(-1) for t in tensors]).float()
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, torch.zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S].clone()


def view_not_copy(tensors, rank, world):            # keeps the whole padded buffer alive
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S]


def test_flat_shard_right_and_stub(capsys):
    assert lab03.check_flat_shard(flat_shard) is True
    assert capsys.readouterr().out.startswith("✅ flat_shard:")
    assert lab03.check_flat_shard(stub_shard) is False
    assert "⏳ flat_shard: not implemented yet — flatten, pad, slice" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (chunk_no_padding, "pad the flat buffer with zeros"),
    (padded_in_front, "padding is at the front"),
    (next_ranks_shard, "shifted by 1 shard"),
    (floor_division, "rounded down"),
    (pads_each_tensor, "each tensor was padded on its own"),
    (float32_padding, "without the tensors' dtype"),
    (view_not_copy, "element copy"),
])
def test_flat_shard_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab03.check_flat_shard(wrong)
    assert says in str(err.value)


# -- exercise 2: the Unshard autograd.Function ---------------------------------------------------------
def _make(divide=True, reduce="scatter", free=True, inplace=False, dtype=True, twice=False, ret="full",
          state=True):
    class Unshard(torch.autograd.Function):
        @staticmethod
        def forward(ctx, sharded, flat):
            import torch.distributed as dist
            like = dict(dtype=sharded.dtype, device=sharded.device) if dtype else {}
            full = torch.empty(dist.get_world_size() * sharded.numel(), **like)
            dist.all_gather_into_tensor(full, sharded)
            flat.unsharded, ctx.flat = full, flat
            if state:
                flat.state = State.UNSHARDED
            return full if ret == "full" else sharded.clone()

        @staticmethod
        def backward(ctx, grad_full):
            import torch.distributed as dist
            n, r = dist.get_world_size(), dist.get_rank()
            if reduce == "scatter":
                grad = torch.empty(grad_full.numel() // n, dtype=grad_full.dtype)
                dist.reduce_scatter_tensor(grad, grad_full.contiguous())
            else:
                g = grad_full.clone()
                dist.all_reduce(g)
                grad = g.chunk(n)[r].clone()
            if free:
                ctx.flat.reshard()
            if inplace:
                return grad.div_(n), None
            if twice:
                return grad / n / n, None
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
    (dict(twice=True), "you divided twice"),
    (dict(dtype=False), "allocated without dtype="),          # the old hint's answer: crashes float64 later
    (dict(ret="shard"), "return the gathered buffer, not the input"),
    (dict(state=False), "flat.state = State.UNSHARDED"),
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


class NeverFrees(MyFSDP):                    # post_forward does nothing: no re-gather, units stay gathered
    def post_forward(self, flat):
        pass


class NoRegather(MyFSDP):                    # frees, but never gathers again for backward
    def pre_backward(self, flat):
        pass


class NoViews(MyFSDP):                       # gathers, but the modules never see the weights
    def pre_forward(self, flat):
        _make().apply(flat.sharded, flat)


class BypassesAutograd(MyFSDP):              # gathers outside the autograd Function: no gradient reaches the shard
    def pre_forward(self, flat):
        flat.unshard()
        flat.set_views(flat.unsharded)


class ForgetsTheBuffer(MyFSDP):              # drops the buffer but not the state: the unit is never gathered again
    def post_forward(self, flat):
        flat.unsharded = None


class SumsGradients(MyFSDP):                 # Unshard without ÷N: only SGD (not AdamW) sees the scale
    def pre_forward(self, flat):
        flat.set_views(_make(divide=False).apply(flat.sharded, flat))


class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard(async_op=True)


class SyncPrefetch(fsdp.FlatFSDP):           # "prefetch" that waits: nothing overlaps
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard()


class PrefetchEverything(fsdp.FlatFSDP):     # every later unit at once, from the root
    def pre_forward(self, flat):
        super().pre_forward(flat)
        for nxt in self.flats[self.flats.index(flat) + 1:]:
            nxt.unshard(async_op=True)


class PrefetchTwoAhead(fsdp.FlatFSDP):       # the wrong unit: skips the next one
    def pre_forward(self, flat):
        super().pre_forward(flat)
        i = self.flats.index(flat)
        if i + 2 < len(self.flats):
            self.flats[i + 2].unshard(async_op=True)


class PrefetchInPostForward(fsdp.FlatFSDP):  # too late: after the unit computed
    def post_forward(self, flat):
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard(async_op=True)
        super().post_forward(flat)


def test_fsdp_class_right_and_stub(capsys):
    assert lab03.check_fsdp_class(MyFSDP, steps=2) is True
    assert "✅ MyFSDP: DDP's gradients and losses over 2 steps; per step 4 all-gathers forward" in capsys.readouterr().out
    assert lab03.check_fsdp_class(StubFSDP, steps=1) is False
    assert "⏳ MyFSDP: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (NeverFrees, "post_forward"),
    (NoRegather, "pre_backward must gather the unit again"),
    (NoViews, "flat.set_views(full)"),
    (BypassesAutograd, "did not go through the autograd Function"),
    (ForgetsTheBuffer, "flat.unsharded = None alone"),
    (SumsGradients, "summed instead of averaging"),
])
def test_fsdp_class_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab03.check_fsdp_class(wrong, steps=2)
    assert says in str(err.value)


def test_prefetch_right_and_stub(capsys):
    assert lab03.check_prefetch(Prefetching, steps=1) is True
    assert "root + 2 blocks" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (fsdp.FlatFSDP, "started no gather ahead"),
    (SyncPrefetch, "async_op=False"),
    (PrefetchEverything, "prefetch ONE unit"),
    (PrefetchTwoAhead, "runs next"),
    (PrefetchInPostForward, "too late"),
])
def test_prefetch_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab03.check_prefetch(wrong, steps=1)
    assert says in str(err.value)
