"""The exercise checks of Lab 03 (FSDP from scratch).

Each check runs the learner's code (on real gloo ranks where collectives are involved), compares it
with the reference (:mod:`course_lib.strategies.fsdp`, :mod:`course_lib.maths.sharding`, DDP) and reads the ledger to
see *how* the answer was computed, not only what it returned. Outcomes as in :mod:`course_lib.checks`:
✅ with a one-line summary, ⏳ for a stub, ❌ with the likely mistake.

Test models have awkward sizes on purpose (``Linear(17, 257)``: 4,626 elements, 2 of padding at N=4),
so a forgotten pad or a wrong shard offset cannot pass by luck.
"""
from __future__ import annotations

import numpy as np

from course_lib import checks
from course_lib.maths import costs
from course_lib.models import LAB_CONFIG
from course_lib.maths.sharding import flat_layout, padded_size

__all__ = ["check_flat_shard", "check_unshard_function", "check_fsdp_class", "check_prefetch"]




def _reference_shard(tensors, rank: int, world: int) -> np.ndarray:
    flat = np.concatenate([np.asarray(t, dtype=np.float32).reshape(-1) for t in tensors])
    layout = flat_layout([flat.size], world)
    padded = np.concatenate([flat, np.zeros(layout.padding, np.float32)])
    b = layout.shards[rank]
    return padded[b.start:b.stop]


def _front_padded(flat: np.ndarray, world: int) -> np.ndarray:
    pad = padded_size(flat.size, world) - flat.size
    return np.concatenate([np.zeros(pad, np.float32), flat])


# -- Lab 03, exercise 1: flatten, concatenate, pad, keep one shard (pure, no ranks) ------------------
def check_flat_shard(fn, name: str = "flat_shard") -> bool:
    """``fn(tensors, rank, world) -> 1-D tensor``: this rank's shard of the padded flat parameter."""
    import torch
    cases = [([(17, 257), (257,)], 4), ([(17, 257), (257,)], 3), ([(5,), (2,)], 3), ([(4, 3), (3,)], 16),
             ([(8, 4)], 4)]
    g = torch.Generator().manual_seed(3)
    with checks.check(name) as c:
        for shapes, world in cases:
            tensors = [torch.randn(s, generator=g) + 1.0 for s in shapes]   # no zeros: padding shows
            flat = torch.cat([t.reshape(-1) for t in tensors]).numpy()
            got_all = [fn([t.clone() for t in tensors], r, world) for r in range(world)]
            for r, got in enumerate(got_all):
                if not isinstance(got, torch.Tensor) or got.dim() != 1:
                    raise AssertionError(f"{name}(shapes {shapes}, rank {r}, world {world}) returned "
                                         f"{type(got).__name__} {getattr(got, 'shape', '')}; return a 1-D tensor")
            sizes = [g_.numel() for g_ in got_all]
            S = padded_size(flat.size, world) // world
            if len(set(sizes)) > 1 or sizes[0] != S:
                hint = ("the last ranks' shards are short: pad the flat buffer with zeros to "
                        f"padded_size({flat.size}, {world}) = {S * world} first (collectives need equal sizes)"
                        if sum(sizes) == flat.size else
                        f"every shard must have padded_size(numel, N) / N = {S} elements")
                raise AssertionError(f"shapes {shapes}, world {world}: shard sizes {sizes}, expected {S} "
                                     f"on every rank\n   likely mistake: {hint}")
            got = torch.cat(got_all).numpy()
            exp = np.concatenate([_reference_shard(tensors, r, world) for r in range(world)])
            front = _front_padded(flat, world)

            def padded_in_front(g_, e_, front=front):
                if g_.shape == front.shape and np.allclose(g_, front):
                    return "the padding is at the front; FSDP pads at the END, so rank 0 starts at element 0"
            checks.assert_close(f"{name}: the {world} shards of {shapes}, concatenated", got, exp, rtol=0, atol=0,
                                hint=[padded_in_front, checks.wrong_shard_offset(world)])
        c.ok(f"{len(cases)} cases (17×257 + 257 over 3 and 4 ranks, 7 elements over 3, 15 over 16 ...): "
             "equal shard sizes, padding zeros at the end")
    return bool(c.passed)


# -- Lab 03, exercise 2: all-gather in forward, reduce-scatter ÷N in backward ------------------------
def _unit_on_rank(fn_cls):
    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.strategies.fsdp import FlatParameter
    r, n = dist.get_rank(), dist.get_world_size()

    def one_pass():
        torch.manual_seed(0)                           # the same module on every rank
        lin = torch.nn.Linear(17, 257)                 # weight (257, 17), bias (257,): 4,626 elements
        slots = [(f"lin.{a}", lin, a, p) for a, p in lin._parameters.items()]
        flat = FlatParameter("lin", slots, None)
        coef = [torch.randn(p.shape, generator=torch.Generator().manual_seed(10 + r)) for *_, p in slots]
        with lt.phase("forward"):
            full = fn_cls.apply(flat.sharded, flat)
        state_fwd = flat.state.name
        loss = sum((v * c_).sum() for v, c_ in zip(flat.views(full), coef))   # rank r's gradient is coef_r
        loss.backward()
        return flat, slots, coef, full, state_fwd

    flat, slots, coef, full, state_fwd = one_pass()
    full_ref = torch.cat([p.detach().reshape(-1) for *_, p in slots])
    grad_full = torch.cat([c_.reshape(-1) for c_ in coef] + [torch.zeros(flat.layout.padding)])
    with lt.paused():
        dist.all_reduce(grad_full)
    b = flat.layout.shards[r]
    return {"full": full.detach()[:full_ref.numel()], "full_numel": full.numel(), "ref": full_ref,
            "grad": flat.sharded.grad, "grad_ref": (grad_full / n)[b.start:b.stop],
            "state_fwd": state_fwd, "state_bwd": flat.state.name, "padded": flat.layout.padded_numel}


def check_unshard_function(fn_cls, world_size: int = 4, name: str = "Unshard") -> bool:
    """``fn_cls.apply(sharded, flat)``: forward all-gathers the padded flat buffer (flat UNSHARDED);
    backward reduce-scatters the gradient and divides by N (flat SHARDED again)."""
    from course_lib.launch import run
    with checks.check(name) as c:
        out = run(_unit_on_rank, fn_cls, world_size=world_size)
        n, padded = world_size, out[0]["padded"]
        if out[0]["full_numel"] != padded:
            raise AssertionError(f"forward returned {out[0]['full_numel']} elements, expected the padded all-gather "
                                 f"output of {padded} (N × shard); return the whole gathered buffer")
        for r in range(n):
            checks.assert_close(f"{name}.forward on rank {r} (padding stripped)", out[r]["full"], out[r]["ref"],
                                rtol=0, atol=0, hint=[checks.wrong_shard_offset(1)])
        if out[0]["state_fwd"] != "UNSHARDED":
            raise AssertionError("after forward the flat is still SHARDED: set flat.unsharded = the gathered "
                                 "buffer and flat.state = State.UNSHARDED")
        for r in range(n):
            if out[r]["grad"] is None:
                raise AssertionError(f"rank {r}: flat.sharded.grad is None → backward must return the gradient "
                                     "shard as its first output (and None for `flat`)")
            checks.assert_close(f"{name}.backward: gradient shard on rank {r}", out[r]["grad"], out[r]["grad_ref"],
                                rtol=1e-5, atol=1e-6, hint=[checks.summed_not_averaged(n), checks.averaged_twice(n)])
        if out[0]["state_bwd"] != "SHARDED":
            raise AssertionError("the gradient is right, but the flat is still UNSHARDED after backward: free it "
                                 "(flat.reshard()) once the gradient is reduce-scattered")
        led = out.ledger.filter(rank=0)
        fwd, bwd = [x.op for x in led.filter(phase="forward")], [x.op for x in led.filter(phase="backward")]
        if fwd != ["all_gather"] or bwd != ["reduce_scatter"]:
            raise AssertionError(f"the numbers are right, but rank 0 issued forward {fwd}, backward {bwd}; "
                                 "expected one all_gather in forward and one reduce_scatter in backward "
                                 "(an all_reduce sends 2× the bytes and keeps the whole gradient)")
        wire = costs.ledger_wire_bytes(led)
        c.ok(f"gathers {padded:,} elements (2 of padding), gradient shard = mean over {n} ranks; "
             f"ledger: all_gather + reduce_scatter, {wire:,.0f} wire bytes on rank 0")
    return bool(c.passed)


# -- Lab 03, exercise 3 and 4: the unit lifecycle, then prefetch -------------------------------------
def _train_on_rank(cls, cfg, steps: int, batch: int, kwargs: dict):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.comm import torch_ledger as lt
    from course_lib.models.data import TokenTask
    from course_lib.strategies.fsdp import State
    from course_lib.models import loss_fn, torch_gpt
    r, n = dist.get_rank(), dist.get_world_size()
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    out = {}
    for kind in ("ddp", "fsdp"):
        model = torch_gpt(cfg, seed=0)
        m = DDP(model) if kind == "ddp" else cls(model, list(model.blocks), **kwargs)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        losses, states = [], []
        for s in range(steps):
            x, y = (torch.from_numpy(a) for a in task.rank_batch(s, batch, r, n))
            with (lt.phase("forward", step=s) if kind == "fsdp" else lt.paused()):
                loss = loss_fn(m(x), y)
                loss.backward()                   # labelled "backward" by the ledger itself
            opt.step()
            opt.zero_grad()
            losses.append(lt.unrecorded_mean(loss))
            if kind == "fsdp":
                states.append(sorted({f.state.name for f in m.flats}))
        out[kind] = losses
        if kind == "fsdp":
            out.update(states=states, units=m.unit_shapes(), flats=[f.unsharded_bytes for f in m.flats],
                       peak=m.unsharded_peak_bytes, timeline=list(m.timeline),
                       left=[f.state is State.UNSHARDED for f in m.flats])
    return out


def _run_fsdp(cls, world_size, steps, kwargs=None):
    from course_lib.launch import run
    return run(_train_on_rank, cls, LAB_CONFIG, steps, 8, kwargs or {}, world_size=world_size)


def _check_ledger(led, units, n, steps, reshard=True):
    k = len(units)
    for s in range(steps):
        one = led.filter(step=s)
        fwd = one.filter(op="all_gather", phase="forward").counts().get("all_gather", 0)
        bwd = one.filter(op="all_gather", phase="backward").counts().get("all_gather", 0)
        rs = one.filter(op="reduce_scatter").counts().get("reduce_scatter", 0)
        other = {op: c for op, c in one.counts().items() if op not in ("all_gather", "reduce_scatter")}
        want_bwd = k if reshard else 0
        if other:
            raise AssertionError(f"step {s}: unexpected collectives {other}; FSDP needs only all-gathers and "
                                 "reduce-scatters")
        if (fwd, bwd, rs) != (k, want_bwd, k):
            why = ""
            if bwd == 0 and reshard:
                why = ("no all-gather in backward: the units were never freed after forward → post_forward "
                       "must call flat.reshard(), and pre_backward gather them again")
            elif fwd > k or bwd > want_bwd:
                why = "a unit is gathered more than once per pass → gather only when the flat is SHARDED"
            elif rs != k:
                why = "one reduce-scatter per unit per step: the gradient of each flat parameter"
            raise AssertionError(f"step {s} on rank 0: {fwd} all-gathers in forward, {bwd} in backward, {rs} "
                                 f"reduce-scatters; expected {k}, {want_bwd}, {k} for {k} units"
                                 + (f"\n   likely mistake: {why}" if why else ""))
    analytic = costs.step_cost("fsdp", units, n, padding="flat", reshard_after_forward=reshard)
    measured = costs.ledger_wire_bytes(led.filter(step=steps - 1))
    if abs(costs.ratio(measured, analytic.wire_bytes) - 1) > 1e-12:
        raise AssertionError(f"rank 0 sent {measured:,.0f} wire bytes in one step, the formula "
                             f"3(N-1)/N·Ψpad·4 says {analytic.wire_bytes:,.0f}")
    return analytic


def check_fsdp_class(cls, world_size: int = 4, steps: int = 3, name: str = "MyFSDP") -> bool:
    """``cls(model, units)`` trains the lab's GPT: same losses as DDP, FSDP's ledger, units freed."""
    with checks.check(name) as c:
        out = _run_fsdp(cls, world_size, steps)
        o = out[0]
        checks.assert_close(f"{name} losses vs DDP ({steps} steps)", o["fsdp"], o["ddp"], **checks.TOLERANCES["fp32"])
        if any(o["left"]):
            raise AssertionError("after the step some units are still UNSHARDED → free them after their backward "
                                 "(Unshard.backward calls flat.reshard())")
        analytic = _check_ledger(out.ledger.filter(rank=0), o["units"], world_size, steps)
        c.ok(f"losses match DDP over {steps} steps; per step {len(o['units'])} all-gathers forward + "
             f"{len(o['units'])} backward + {len(o['units'])} reduce-scatters = {analytic.wire_bytes:,.0f} wire "
             "bytes, the formula exactly")
    return bool(c.passed)


def check_prefetch(cls, world_size: int = 4, steps: int = 2, name: str = "prefetch") -> bool:
    """``cls(model, units)`` prefetches the next unit: same losses and bytes, the next unit's all-gather
    is issued before the current unit's forward ends, two blocks unsharded at the peak."""
    with checks.check(name) as c:
        out = _run_fsdp(cls, world_size, steps)
        o = out[0]
        checks.assert_close(f"{name} losses vs DDP", o["fsdp"], o["ddp"], **checks.TOLERANCES["fp32"])
        _check_ledger(out.ledger.filter(rank=0), o["units"], world_size, steps)
        root, blocks = o["flats"][0], sorted(o["flats"][1:])
        want = root + sum(blocks[-2:])
        if o["peak"] < want:
            raise AssertionError(f"at most {o['peak']:,} bytes were unsharded at once, no more than without "
                                 f"prefetch; with it the root and two blocks ({want:,} bytes) are → call "
                                 "next.unshard(async_op=True) for the next unit in pre_forward")
        c.ok(f"losses and bytes unchanged; peak unsharded {o['peak']:,} bytes = root + 2 blocks "
             f"(without prefetch: root + 1 block = {root + blocks[-1]:,})")
    return bool(c.passed)
