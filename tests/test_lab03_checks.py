"""Lab 03's exercise checks: the right answer passes and a stub says "not implemented yet". The wrong answers
and their diagnoses are in the catalogue, tests/wrong_answers/lab03.py (tests/test_wrong_answer_kinds.py)."""
from __future__ import annotations

import torch

from course_lib.strategies.fsdp import scratch as fsdp
from course_lib.checks import lab03
from course_lib.strategies.fsdp.scratch import State


# -- exercise 1: flat shard ----------------------------------------------------------------------------
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S].clone()


def stub_shard(tensors, rank, world):
    raise NotImplementedError("Exercise not done yet: flatten, pad, slice")


def test_flat_shard_right_and_stub(capsys):
    assert lab03.check_flat_shard(flat_shard) is True
    assert capsys.readouterr().out.startswith("✅ flat_shard:")
    assert lab03.check_flat_shard(stub_shard) is False
    assert "⏳ flat_shard: not implemented yet — flatten, pad, slice" in capsys.readouterr().out


# -- exercise 2: the Unshard autograd.Function ---------------------------------------------------------
def _make(inplace=False):
    class Unshard(torch.autograd.Function):
        @staticmethod
        def forward(ctx, sharded, flat):
            import torch.distributed as dist
            full = torch.empty(dist.get_world_size() * sharded.numel(), dtype=sharded.dtype, device=sharded.device)
            dist.all_gather_into_tensor(full, sharded)
            flat.unsharded, flat.state, ctx.flat = full, State.UNSHARDED, flat
            return full

        @staticmethod
        def backward(ctx, grad_full):
            import torch.distributed as dist
            n = dist.get_world_size()
            grad = torch.empty(grad_full.numel() // n, dtype=grad_full.dtype)
            dist.reduce_scatter_tensor(grad, grad_full.contiguous())
            ctx.flat.reshard()
            return (grad.div_(n) if inplace else grad / n), None
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


class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard(async_op=True)


def test_fsdp_class_right_and_stub(capsys):
    assert lab03.check_fsdp_class(MyFSDP, steps=2) is True
    assert "✅ MyFSDP: DDP's gradients and losses over 2 steps; per step 4 all-gathers forward" in capsys.readouterr().out
    assert lab03.check_fsdp_class(StubFSDP, steps=1) is False
    assert "⏳ MyFSDP: not implemented yet" in capsys.readouterr().out


def test_prefetch_right_and_stub(capsys):
    assert lab03.check_prefetch(Prefetching, steps=1) is True
    assert "root + 2 blocks" in capsys.readouterr().out


# -- issue 49: nothing on a rank knows the answer --------------------------------------------------------------------
def _peek_for_answers():
    """Names and dict keys in every frame above the learner's code that would hold an expected value."""
    import sys
    f, found = sys._getframe(2), []
    while f is not None:
        for k, v in list(f.f_locals.items()):
            if k.startswith(("ref", "expected", "want")) or "ddp" in k.lower():
                found.append(k)
            if isinstance(v, dict):
                found += [f"{k}[{key!r}]" for key in list(v) if isinstance(key, str)
                          and (key.startswith(("ref", "expected")) or "ddp" in key.lower() or key.endswith("_ref"))]
        f = f.f_back
    return found


class PeekingFSDP(MyFSDP):
    """The right lifecycle, that first searches every frame above it for DDP's numbers or a reference."""
    def pre_forward(self, flat):
        found = _peek_for_answers()
        if found:
            raise ValueError(f"found {found}")
        super().pre_forward(flat)


def test_the_training_ranks_hold_no_reference(capsys):
    """DDP's losses and gradients are the judge's, computed in one process: a rank's frames hold none of them."""
    assert lab03.check_fsdp_class(PeekingFSDP, steps=1) is True, capsys.readouterr().out


def test_the_unshard_ranks_hold_no_reference(capsys):
    class Peeking(_make()):
        @staticmethod
        def forward(ctx, sharded, flat):
            found = _peek_for_answers()
            if found:
                raise ValueError(f"found {found}")
            return _make().forward(ctx, sharded, flat)
    assert lab03.check_unshard_function(Peeking) is True, capsys.readouterr().out
