"""Lab 03's last two checks, both halves: the learner's FSDP class trained on ranks (run), DDP's numbers in one
process (judge).

* **run half** -- :func:`train_learner_class` trains the lab's GPT under the learner's class on N gloo ranks with
  plain SGD (AdamW would normalise a gradient-scale error away) and returns plain facts per rank: the loss of each
  step, the step-0 gradient shards, each unit's state after every step, the peak of gathered bytes, (``log_prefetch``)
  which all-gathers were started where, and rank 0's ledger rows. Errors that the FSDP plumbing raises for a wrong
  lifecycle (:data:`PLUMBING`) come back as data too (``{"error": ...}``); any other error is the learner's crash.
  No DDP runs on a rank: nothing there knows the answer.
* **judge half** -- :func:`ddp_reference` is what DDP computes on N ranks, done in one process (every rank's slice
  is one slice of the global batch, and DDP's averaged gradient is the global batch's gradient);
  :func:`units_of` is the units FlatFSDP builds, read off the model; :func:`grads_match_ddp`,
  :func:`ledger_matches_formula` and :func:`plumbing_failure` turn the run's facts into a verdict.
"""
from __future__ import annotations

import contextlib

import numpy as np

from course_lib import checks
from course_lib.checks import plain as _plain
from course_lib.maths import costs
from course_lib.models import LAB_CONFIG

__all__ = ["train_learner_class", "ddp_reference", "units_of", "grads_match_ddp", "ledger_matches_formula",
           "plumbing_failure", "ledger_rows", "blocking", "divided_twice", "PLUMBING", "BATCH", "LR"]

BATCH, LR = 8, 0.3        #: the global batch (8 // N rows per rank) and SGD's learning rate


def divided_twice(n: int):
    def detect(got, exp):
        if np.any(exp != 0) and np.allclose(got, exp / n, rtol=1e-4, atol=1e-7):
            return (f"got is the mean ÷{n} again → you divided twice (ReduceOp.AVG and then ÷N, or ÷N twice); "
                    "the reduce-scatter sums, divide once")
    return detect


def blocking(answer):
    """On a rank: while inside, the exercise's references are unavailable if ``answer`` is a graded
    (:class:`~course_lib.checks.judge.Guarded`) class -- its methods run long after its constructor returned."""
    from course_lib.checks.judge import Guarded, unavailable
    if isinstance(answer, Guarded):
        return unavailable(answer.references, answer.exercise)
    return contextlib.nullcontext()


def ledger_rows(ledger) -> list[dict]:
    """A ledger's records as plain rows (what the judge needs of each)."""
    keep = ("op", "nbytes", "dtype", "group_size", "rank", "phase", "step")
    return [{k: getattr(r, k) for k in keep} for r in ledger]


# -- run half: on the ranks ---------------------------------------------------------------------------------------
def _train_on_rank(cls, cfg, steps: int, batch: int, log_prefetch: bool = False):
    import torch.distributed as dist

    from course_lib.models.data import TokenTask
    from course_lib.strategies.fsdp import scratch as fsdp
    from course_lib.strategies.fsdp.scratch import State
    r, n = dist.get_rank(), dist.get_world_size()
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    out, events, current = {}, [], []
    if log_prefetch:   # which gathers are started where: the plan of a prefetch, beside its bytes
        real_unshard = fsdp.FlatParameter.unshard

        def unshard(self, async_op=False):
            if self.state is State.SHARDED and self._pending is None:
                events.append((current[-1] if current else None, self.name or "root", bool(async_op)))
            return real_unshard(self, async_op)
        fsdp.FlatParameter.unshard = unshard
    try:
        with blocking(cls):
            _train(cls, cfg, steps, batch, log_prefetch, task, r, n, out, current, events)
    finally:
        if log_prefetch:
            fsdp.FlatParameter.unshard = real_unshard   # the ranks are reused: leave no patch behind
    out["events"] = [list(e) for e in events]
    return _plain.plain(out)


def _train(cls, cfg, steps, batch, log_prefetch, task, r, n, out, current, events):
    import torch

    from course_lib.comm import torch_ledger as lt
    from course_lib.models import loss_fn, torch_gpt
    from course_lib.strategies.fsdp.scratch import State
    model = torch_gpt(cfg, seed=0)
    m = cls(model, list(model.blocks))
    if log_prefetch:
        for phase in ("pre_forward", "post_forward"):
            def wrapped(flat, f=getattr(m, phase), phase=phase):
                current.append(f"{phase}:{flat.name or 'root'}")
                try:
                    return f(flat)
                finally:
                    current.pop()
            setattr(m, phase, wrapped)
    opt = torch.optim.SGD(m.parameters(), lr=LR)   # SGD: a wrong gradient scale shows in the losses
    losses, states = [], []
    for s in range(steps):
        events.clear()                        # the prefetch plan of the last step
        x, y = (torch.from_numpy(a) for a in task.rank_batch(s, batch, r, n))
        with lt.phase("forward", step=s):
            loss = loss_fn(m(x), y)
            loss.backward()                   # labelled "backward" by the ledger itself
        if s == 0:
            out["grads"] = [f.sharded.grad.detach().clone() if f.sharded.grad is not None else None for f in m.flats]
        opt.step()
        opt.zero_grad()
        losses.append(lt.unrecorded_mean(loss))
        states.append(sorted({f.state.name for f in m.flats}))
    out.update(losses=losses, states=states, peak=m.unsharded_peak_bytes,
               left=[f.state is State.UNSHARDED for f in m.flats], names=[f.name or "root" for f in m.flats])


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


def _plumbing_why(kind, text) -> str | None:
    return next((why for etype, says, why in PLUMBING if kind == etype and says in str(text)), None)


def train_learner_class(cls, world_size, steps, log_prefetch=False) -> dict:
    """Run half: ``cls(model, units)`` trained on ``world_size`` ranks (see the module docstring), as plain data:
    ``{"ranks": [per rank facts], "ledger": rank 0's rows}`` or ``{"error": {"type", "rank", "text"}}``."""
    from course_lib.launch import run
    try:
        out = run(_train_on_rank, cls, LAB_CONFIG, steps, BATCH, log_prefetch, world_size=world_size)
    except Exception as e:  # noqa: BLE001 - the plumbing's own diagnoses become data; any other error is a crash
        kind = getattr(e, "exc_type", "")
        if _plumbing_why(kind, e) is None:
            raise
        return {"error": {"type": kind, "rank": getattr(e, "rank", None), "text": str(e)[:4000]}}
    return {"ranks": list(out), "ledger": ledger_rows(out.ledger.filter(rank=0))}


# -- judge half: in one process -------------------------------------------------------------------------------
def plumbing_failure(data) -> None:
    """Raise the plumbing's diagnosis if the run ended in one; check the run's data has every rank's facts."""
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        why = _plumbing_why(err.get("type"), err.get("text", ""))
        first = str(err.get("text", "")).split("\n")[0].split(": ", 1)[-1]
        raise AssertionError(f"on rank {err.get('rank')}: {first}" + (f"\n   likely mistake: {why}" if why else ""))
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list) or not data["ranks"] \
            or not isinstance(data["ranks"][0], dict) or not isinstance(data.get("ledger"), list):
        raise AssertionError("the training run sent no result from its ranks; expected each rank's losses, "
                             "gradient shards and unit states")


def _fresh_model(cfg):
    """The lab's GPT as every rank builds it, without touching the kernel's random state."""
    import torch

    from course_lib.models import torch_gpt
    with torch.random.fork_rng(devices=[]):
        return torch_gpt(cfg, seed=0)


def units_of(cfg=LAB_CONFIG) -> list[tuple[str, list[str], list[tuple[int, ...]]]]:
    """(name, parameter names, shapes) of each unit FlatFSDP builds on the GPT with ``units=model.blocks``:
    the root (what no block owns), then each block, parameters in FlatFSDP's flat order."""
    from course_lib.strategies.fsdp.scratch import FlatFSDP
    model = _fresh_model(cfg)
    unit_mods = [model, *model.blocks]
    names = {m: n for n, m in model.named_modules()}
    out = []
    for um in unit_mods:
        slots = [(f"{names[m]}.{a}".lstrip("."), tuple(p.shape)) for m in FlatFSDP._owned_modules(um, unit_mods)
                 for a, p in list(m._parameters.items()) if p is not None]
        out.append((names[um] or "root", [f for f, _ in slots], [s for _, s in slots]))
    return out


def ddp_reference(cfg, steps: int, world_size: int) -> dict:
    """What DDP reports on ``world_size`` ranks, computed in one process: the mean loss of each step and rank 0's
    step-0 gradient shard of each unit (FlatFSDP's flat layout, padding zeros at the end)."""
    import torch

    from course_lib.maths.sharding import flat_layout
    from course_lib.models import loss_fn
    from course_lib.models.data import TokenTask
    model = _fresh_model(cfg)
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], {}
    for s in range(steps):
        x, y = (torch.from_numpy(a) for a in task.global_batch(s, BATCH))   # every rank's slice, in rank order
        loss = loss_fn(model(x), y)
        loss.backward()
        if s == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    shards = []
    for _, fqns, _ in units_of(cfg):
        layout = flat_layout([grads[k].numel() for k in fqns], world_size)
        g = torch.cat([grads[k].reshape(-1) for k in fqns] + [torch.zeros(layout.padding)])
        b = layout.shards[0]
        shards.append(g[b.start:b.stop].numpy())
    return {"losses": losses, "grads": shards}


def grads_match_ddp(o, ref, name, n, names):
    """The step-0 gradient shards of every unit equal DDP's gradient, sliced the same way (rank 0)."""
    got = o.get("grads")
    if not isinstance(got, list) or len(got) != len(ref["grads"]):
        raise AssertionError(f"after the first backward rank 0 reported {type(got).__name__} gradient shards, "
                             f"expected one per unit ({len(ref['grads'])})")
    if any(g is None for g in got):
        units = [u for u, g in zip(names, got) if g is None]
        raise AssertionError(f"after the first backward the shards of {units} have no gradient\n   likely "
                             "mistake: the gather in pre_forward did not go through the autograd Function "
                             "(gather.apply(flat.sharded, flat)), so autograd never reaches the shard")
    for u, g, e in zip(names, got, ref["grads"]):
        checks.assert_close(f"{name}: step 0 gradient shard of unit {u} vs DDP's (rank 0)", g, e, rtol=1e-4, atol=1e-6,
                            hint=[checks.summed_not_averaged(n), divided_twice(n)])


def ledger_matches_formula(rows, units, n, steps, reshard=True):
    """Each step: one all-gather per unit in forward (and in backward when resharding), one reduce-scatter,
    nothing else; the last step's wire bytes equal the formula exactly. Returns the formula's cost."""
    from course_lib.comm.ledger import Ledger
    led = Ledger.from_dicts(rows)
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
