"""The training harness behind Lab 03's last two checks: the learner's FSDP class trained beside DDP.

:func:`train_beside_ddp` runs, on N gloo ranks, the lab's GPT twice from the same weights and batches -- once
under DDP, once under the learner's class -- with plain SGD (AdamW would normalise a gradient-scale error
away), and returns per rank: both loss curves, the step-0 gradient shards against DDP's, each unit's state
after every step, the peak of gathered bytes, and (``log_prefetch``) which all-gathers were started where.
Errors that the FSDP plumbing raises for a wrong lifecycle become a ❌ with the likely mistake
(:data:`PLUMBING`). :func:`grads_match_ddp` and :func:`ledger_matches_formula` turn the result into the
checks' verdicts: gradients, and each step's collectives against ``costs.step_cost``'s formula.
"""
from __future__ import annotations

import numpy as np

from course_lib import checks
from course_lib.maths import costs
from course_lib.models import LAB_CONFIG

__all__ = ["train_beside_ddp", "grads_match_ddp", "ledger_matches_formula", "divided_twice", "PLUMBING"]


def divided_twice(n: int):
    def detect(got, exp):
        if np.any(exp != 0) and np.allclose(got, exp / n, rtol=1e-4, atol=1e-7):
            return (f"got is the mean ÷{n} again → you divided twice (ReduceOp.AVG and then ÷N, or ÷N twice); "
                    "the reduce-scatter sums, divide once")
    return detect



def _train_on_rank(cls, cfg, steps: int, batch: int, kwargs: dict, log_prefetch: bool = False):
    import torch.distributed as dist

    from course_lib.models.data import TokenTask
    from course_lib.strategies.fsdp import scratch as fsdp
    from course_lib.strategies.fsdp.scratch import State
    r, n = dist.get_rank(), dist.get_world_size()
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    out, events = {}, []
    if log_prefetch:   # which gathers are started where: the plan of a prefetch, beside its bytes
        real_unshard, current = fsdp.FlatParameter.unshard, []

        def unshard(self, async_op=False):
            if self.state is State.SHARDED and self._pending is None:
                events.append((current[-1] if current else None, self.name or "root", bool(async_op)))
            return real_unshard(self, async_op)
        fsdp.FlatParameter.unshard = unshard
    try:
        _train_both(cls, cfg, steps, batch, kwargs, log_prefetch, task, r, n, out, current if log_prefetch else None,
                    events)
    finally:
        if log_prefetch:
            fsdp.FlatParameter.unshard = real_unshard   # the ranks are reused: leave no patch behind
    out["events"] = events
    out.pop("ddp_grads", None)
    return out


def _train_both(cls, cfg, steps, batch, kwargs, log_prefetch, task, r, n, out, current, events):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.comm import torch_ledger as lt
    from course_lib.models import loss_fn, torch_gpt
    from course_lib.strategies.fsdp.scratch import State
    for kind in ("ddp", "fsdp"):
        model = torch_gpt(cfg, seed=0)
        m = DDP(model) if kind == "ddp" else cls(model, list(model.blocks), **kwargs)
        if kind == "fsdp" and log_prefetch:
            for phase in ("pre_forward", "post_forward"):
                def wrapped(flat, f=getattr(m, phase), phase=phase):
                    current.append(f"{phase}:{flat.name or 'root'}")
                    try:
                        return f(flat)
                    finally:
                        current.pop()
                setattr(m, phase, wrapped)
        opt = torch.optim.SGD(m.parameters(), lr=0.3)   # SGD: a wrong gradient scale shows in the losses
        losses, states = [], []
        for s in range(steps):
            events.clear()                        # the prefetch plan of the last step
            x, y = (torch.from_numpy(a) for a in task.rank_batch(s, batch, r, n))
            with (lt.phase("forward", step=s) if kind == "fsdp" else lt.paused()):
                loss = loss_fn(m(x), y)
                loss.backward()                   # labelled "backward" by the ledger itself
            if s == 0 and kind == "ddp":
                out["ddp_grads"] = {k.removeprefix("module."): p.grad.detach().clone() for k, p in m.named_parameters()}
            if s == 0 and kind == "fsdp":
                got, want = [], []
                for f in m.flats:
                    g = torch.cat([out["ddp_grads"][k].reshape(-1) for k in f.fqns] + [torch.zeros(f.layout.padding)])
                    b = f.layout.shards[r]
                    want.append(g[b.start:b.stop])
                    got.append(f.sharded.grad.detach().clone() if f.sharded.grad is not None else None)
                out["grads"], out["grads_ref"] = got, want
            opt.step()
            opt.zero_grad()
            losses.append(lt.unrecorded_mean(loss))
            if kind == "fsdp":
                states.append(sorted({f.state.name for f in m.flats}))
        out[kind] = losses
        if kind == "fsdp":
            out.update(states=states, units=m.unit_shapes(), flats=[f.unsharded_bytes for f in m.flats],
                       peak=m.unsharded_peak_bytes, left=[f.state is State.UNSHARDED for f in m.flats],
                       names=[f.name or "root" for f in m.flats])


#: Errors the FlatFSDP plumbing (or torch) raises for a wrong lifecycle: (type, text, likely mistake).
PLUMBING = [
    ("RuntimeError", "pre_forward left unit", "pre_forward must gather the unit (through your Unshard, so that "
                                              "its gradient reaches the shard) before the unit runs"),
    ("AttributeError", "'NoneType' object has no attribute 'as_strided'",
     "the backward found a unit marked UNSHARDED without its buffer: free it with flat.reshard(), which also "
     "sets the state back to SHARDED (flat.unsharded = None alone leaves it UNSHARDED, so nothing gathers it again)"),
    ("AttributeError", "object has no attribute 'weight'", "the unit's modules have no weights while it runs: pre_forward must "
                                           "point them at views of the gathered buffer (flat.set_views(full))"),
    ("RuntimeError", "pre_backward left unit", "pre_backward must gather the unit again (flat.unshard()): "
                                               "post_forward freed it and the backward needs its weights"),
    ("RuntimeError", "does not require grad", "the gather in pre_forward did not go through the autograd "
                                              "Function (gather.apply(flat.sharded, flat)), so the loss has no "
                                              "path back to the shards"),
]


def train_beside_ddp(cls, world_size, steps, kwargs=None, log_prefetch=False):
    """Train ``cls(model, units, **kwargs)`` beside DDP on ``world_size`` ranks (see the module docstring)."""
    from course_lib.launch import run
    try:
        return run(_train_on_rank, cls, LAB_CONFIG, steps, 8, kwargs or {}, log_prefetch, world_size=world_size)
    except Exception as e:  # noqa: BLE001 - the plumbing's own diagnoses become a ❌ with the reason
        text, kind = str(e), getattr(e, "exc_type", "")
        for etype, says, why in PLUMBING:
            if kind == etype and says in text:
                first = text.split("\n")[0].split(": ", 1)[-1]
                raise AssertionError(f"on rank {e.rank}: {first}\n   likely mistake: {why}") from None
        raise


def grads_match_ddp(o, name, n):
    """The step-0 gradient shards of every unit equal DDP's gradient, sliced the same way (rank 0)."""
    if any(g is None for g in o["grads"]):
        units = [u for u, g in zip(o["names"], o["grads"]) if g is None]
        raise AssertionError(f"after the first backward the shards of {units} have no gradient\n   likely "
                             "mistake: the gather in pre_forward did not go through the autograd Function "
                             "(gather.apply(flat.sharded, flat)), so autograd never reaches the shard")
    for u, g, e in zip(o["names"], o["grads"], o["grads_ref"]):
        checks.assert_close(f"{name}: step 0 gradient shard of unit {u} vs DDP's (rank 0)", g, e, rtol=1e-4, atol=1e-6,
                            hint=[checks.summed_not_averaged(n), divided_twice(n)])


def ledger_matches_formula(led, units, n, steps, reshard=True):
    """Each step: one all-gather per unit in forward (and in backward when resharding), one reduce-scatter,
    nothing else; the last step's wire bytes equal the formula exactly. Returns the formula's cost."""
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
