"""The exercise checks of Lab 03 (FSDP from scratch), each split in two halves (:mod:`course_lib.checks.judge`).

* **run half** -- runs the learner's code (on real gloo ranks where collectives are involved) and returns plain
  facts: the shards it returned (numbers, dtype, the elements their storage holds), what Unshard gathered and the
  gradient shard it gave each rank, the flat's state after each pass, rank 0's ledger rows, and for the classes the
  losses, step-0 gradient shards, unit states, gathered-bytes peak and prefetch events of a training run. It computes
  no expected value: no reference module, no DDP, no formula.
* **judge half** -- ``judge_*``: builds the inputs again and computes the expected values itself (the padded flat
  buffer, the module's values and the mean gradient, DDP's losses and gradients in one process, the cost formula),
  compares and names the likely mistake. Outcomes as in :mod:`course_lib.checks`: ✅ with a one-line summary, ⏳ for
  a stub, ❌ with the likely mistake.

Test models have awkward sizes on purpose (``Linear(17, 257)``: 4,626 elements, 2 of padding at N=4),
so a forgotten pad or a wrong shard offset cannot pass by luck. Later cells of the lab run the
learner's code in float64 and train with it, so the checks test dtypes too, and train with plain SGD
(AdamW would normalise a gradient-scale error away).

Exercises 3 and 4 train the learner's class with :mod:`course_lib.checks.fsdp_harness` (DDP's numbers: its judge side).

Longer than ~300 lines: four exercise checks, each a run half and a judge half with the diagnoses of its classic
mistakes (the training harness they share is its own module).
"""
from __future__ import annotations

import numpy as np

from course_lib import checks
from course_lib.checks import plain as _plain
from course_lib.checks.core import not_implemented_todo
from course_lib.checks.fsdp_harness import (blocking, ddp_reference, divided_twice, grads_match_ddp,
                                            ledger_matches_formula, ledger_rows, plumbing_failure,
                                            train_learner_class, units_of)
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.maths import costs
from course_lib.maths.sharding import flat_layout, padded_size
from course_lib.models import LAB_CONFIG

__all__ = ["HINTS", "MEASURED", "check_flat_shard", "check_unshard_function", "check_fsdp_class", "check_prefetch"]

#: Layered hints, general to specific (``checks.hint(name, level)``); the last level is near-code.
HINTS = {
    "flat_shard": [
        "One long buffer: every tensor flattened and laid end to end, then made divisible by `world` so "
        "that every rank gets a piece of the same size. Rank r keeps the r-th piece.",
        "The piece size is S = ceil(numel / world). Append zeros at the END (not the front) until the "
        "buffer holds S·world elements; rank r's piece starts at r·S. Keep the tensors' dtype, and return "
        "a copy so that the big buffer can be freed.",
        "torch.cat of t.reshape(-1) for each tensor; S = -(-numel // world); torch.cat with "
        "flat.new_zeros(S * world - numel); then flat[rank * S:(rank + 1) * S].clone().",
    ],
    "Unshard": [
        "Forward: every rank contributes its shard and receives all of them (one collective), in a new "
        "buffer of N times the shard's size. Backward: every rank needs only its own slice of the "
        "gradient, summed over ranks, then divided by N to make it a mean.",
        "Allocate the gathered buffer like the shard (same dtype and device: the lab later runs in "
        "float64), record it in flat.unsharded, set flat.state to State.UNSHARDED and keep flat on ctx. "
        "In backward: a reduce-scatter into a shard-sized buffer, ÷N, flat.reshard(), and return one "
        "gradient per forward input (None for flat).",
        "forward: full = torch.empty(n * sharded.numel(), dtype=sharded.dtype, device=sharded.device); "
        "dist.all_gather_into_tensor(full, sharded.detach()). backward: grad = torch.empty(numel // n, "
        "dtype=..., device=...); dist.reduce_scatter_tensor(grad, grad_full.contiguous()); "
        "ctx.flat.reshard(); return grad / n, None",
    ],
    "MyFSDP": [
        "Three moments of a unit's life: gather just before it runs, free right after, gather again when "
        "the backward first needs it. Only the first must be differentiable (it is where the gradient "
        "flows back to the shard).",
        "pre_forward: run the gather through the autograd Function (its .apply, with the shard and the "
        "flat) and point the unit's modules at views of the result. post_forward: drop the gathered "
        "buffer. pre_backward: gather again, outside autograd.",
        "pre_forward: full = gather.apply(flat.sharded, flat); flat.set_views(full). "
        "post_forward: flat.reshard(). pre_backward: flat.unshard().",
    ],
    "prefetch": [
        "While a unit computes, the NEXT unit's all-gather should already be on its way: start it, do not "
        "wait for it. Its own pre_forward will wait when it needs the result.",
        "First do everything the reference pre_forward does, then ask which unit runs next "
        "(self.next_unit, None after the last block) and start its gather asynchronously. One unit "
        "ahead only: more would hold more memory.",
        "super().pre_forward(flat); nxt = self.next_unit(flat); if nxt is not None: "
        "nxt.unshard(async_op=True)",
    ],
}

#: What the last passing checks measured, for the lab's prediction cells (e.g. "Unshard wire bytes").
MEASURED: dict[str, float] = {}

TESTS = {
    "flat_shard": "six layouts (17×257 + 257 over 3 and 4 ranks, 15 elements over 16 ranks, a float64 "
                  "one ...): every rank's shard has the same size ceil(numel/N), the zeros of padding sit at "
                  "the end, the dtype is kept and the shard is a copy (it does not hold the whole buffer)",
    "Unshard": "on 4 gloo ranks, a Linear(17, 257) unit in float32 and float64: forward returns the whole "
               "padded buffer (same dtype as the shard) and leaves the flat UNSHARDED; backward gives each "
               "rank the mean over ranks of its gradient slice and leaves the flat SHARDED; the ledger "
               "shows one all_gather and one reduce_scatter; then the same on 2 ranks (the world size is not "
               "hard-coded)",
    "MyFSDP": "3 SGD steps of the lab's GPT on 4 ranks: the gradient shards of step 0 equal DDP's, the "
              "losses match DDP, no unit is left gathered, each step's ledger has 4 all-gathers in "
              "forward, 4 in backward, 4 reduce-scatters (the formula's bytes exactly), and at most the root "
              "and one block are gathered at once",
    "prefetch": "2 SGD steps on 4 ranks: losses and bytes as without prefetch; each unit's pre_forward "
                "starts the next unit's all-gather asynchronously (async_op=True), one unit ahead, and the "
                "peak of gathered parameters is exactly root + 2 blocks",
}


def _reference_shard(tensors, rank: int, world: int) -> np.ndarray:
    flat = np.concatenate([np.asarray(t).reshape(-1) for t in tensors])
    layout = flat_layout([flat.size], world)
    padded = np.concatenate([flat, np.zeros(layout.padding, flat.dtype)])
    b = layout.shards[rank]
    return padded[b.start:b.stop]


def _front_padded(flat: np.ndarray, world: int) -> np.ndarray:
    pad = padded_size(flat.size, world) - flat.size
    return np.concatenate([np.zeros(pad, flat.dtype), flat])


def _per_tensor_padded(tensors, world: int) -> np.ndarray:
    return np.concatenate([np.concatenate([t.reshape(-1), np.zeros(padded_size(t.size, world) - t.size, t.dtype)])
                           for t in tensors])


# -- Lab 03, exercise 1: flatten, concatenate, pad, keep one shard (pure, no ranks) ------------------
_FLAT_CASES = [([(17, 257), (257,)], 4, "float32"), ([(17, 257), (257,)], 3, "float32"), ([(5,), (2,)], 3, "float32"),
               ([(4, 3), (3,)], 16, "float32"), ([(8, 4)], 4, "float32"), ([(3, 5), (7,)], 4, "float64")]


def _flat_cases():
    """(shapes, world, dtype, tensors) of each case: the same numbers at every call (no zeros: padding shows)."""
    import torch
    g = torch.Generator().manual_seed(3)
    return [(shapes, world, getattr(torch, dtype), [(torch.randn(s, generator=g) + 1.0).to(getattr(torch, dtype))
                                                      for s in shapes]) for shapes, world, dtype in _FLAT_CASES]


def _tensor_facts(got, given=()) -> dict:
    """What a returned tensor holds, read without calling a method of its class (a subclass may say anything):
    its numbers, dtype, shape, the elements its storage holds and whether it shares memory with ``given``."""
    import torch
    if not isinstance(got, torch.Tensor):
        return {"tensor": False, "type": type(got).__name__, "shape": _plain.plain(getattr(got, "shape", ()))}
    with torch._C.DisableTorchFunction():
        t = torch.Tensor.as_subclass(got, torch.Tensor)
        facts = {"tensor": True, "type": type(got).__name__, "shape": tuple(t.shape), "dtype": str(t.dtype),
                 "held": t.untyped_storage().nbytes() // t.element_size(),
                 "shares": any(checks.compare.shares_memory(t, x) for x in given)}
    facts["values"] = _plain.plain(t)
    return facts


def run_flat_shard(fn) -> dict:
    """Run half: every rank's shard of each case, as the learner's function returned it (facts, no expected value)."""
    out = []
    for _, world, _, tensors in _flat_cases():
        given = [[t.clone() for t in tensors] for _ in range(world)]
        got = [fn(given[r], r, world) for r in range(world)]
        out.append([_tensor_facts(g_, given[r] if r == 0 else ()) for r, g_ in enumerate(got)])
    return {"cases": out}


def _shown(facts) -> str:
    shape = facts.get("shape") if isinstance(facts, dict) else None
    return (f"{facts.get('type') if isinstance(facts, dict) else type(facts).__name__} "
            f"{tuple(shape) if isinstance(shape, (list, tuple)) else ()}")


def judge_flat_shard(data: dict, name: str = "flat_shard") -> str:
    """Judge half: each case's shards against the padded flat buffer cut in ``world`` equal pieces, built here."""
    cases = _flat_cases()
    got_cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(got_cases, list) or len(got_cases) != len(cases):
        raise AssertionError(f"{name} was not run on every case; return a 1-D tensor for each rank of each case")
    for (shapes, world, dtype, tensors), facts in zip(cases, got_cases):
        if not isinstance(facts, list) or len(facts) != world:
            raise AssertionError(f"{name}(shapes {shapes}, world {world}) was not run on each of the {world} ranks")
        for r, f in enumerate(facts):
            if not (isinstance(f, dict) and f.get("tensor") is True and isinstance(f.get("values"), np.ndarray)
                    and f["values"].ndim == 1):
                raise AssertionError(f"{name}(shapes {shapes}, rank {r}, world {world}) returned {_shown(f)}; "
                                     "return a 1-D tensor")
        _judge_flat_case(name, shapes, world, dtype, [t.numpy() for t in tensors], facts)
    return (f"{len(cases)} cases (17×257 + 257 over 3 and 4 ranks, 7 elements over 3, 15 over 16, one in float64): "
            "equal shard sizes, padding zeros at the end, dtype kept, each shard a copy")


def _judge_flat_case(name, shapes, world, dtype, tensors, facts) -> None:
    flat = np.concatenate([t.reshape(-1) for t in tensors])
    sizes = [int(f["values"].size) for f in facts]
    S = padded_size(flat.size, world) // world
    if len(set(sizes)) > 1 or sizes[0] != S:
        ceil_k = [k for k in range(1, 65) if k != world and sizes[0] == padded_size(flat.size, k) // k]
        if flat.size % world == 0 and len(set(sizes)) == 1 and sizes[0] == flat.size // world + 1:
            why = (f"{flat.size} already divides by {world}: no padding is needed here, but your buffer got "
                   f"{world} zeros more (a pad of `world - numel % world` is `world` when the remainder "
                   "is 0); pad only up to the next multiple")
        elif len(set(sizes)) == 1 and ceil_k and sizes[0] != flat.size // world:
            why = (f"every shard has ceil({flat.size} / {ceil_k[0]}) = {sizes[0]} elements: sized for "
                   f"{ceil_k[0]} ranks, not for world = {world}; use the `world` argument (not the "
                   "notebook's N)")
        elif sum(sizes) == flat.size:
            why = (f"the last ranks' shards are short: pad the flat buffer with zeros to "
                   f"ceil({flat.size} / {world}) · {world} = {S * world} first (collectives need equal sizes)")
        elif sum(sizes) == sum(padded_size(t.size, world) for t in tensors):
            why = "each tensor was padded on its own; pad once, the concatenation of all of them"
        elif sizes[0] == flat.size // world:
            why = f"the shard size is rounded down ({flat.size} // {world}); it must be rounded UP"
        else:
            why = f"every shard must have ceil(numel / N) = {S} elements"
        raise AssertionError(f"shapes {shapes}, world {world}: shard sizes {sizes}, expected {S} "
                             f"on every rank\n   likely mistake: {why}")
    if any(f.get("dtype") != str(dtype) for f in facts):
        raise AssertionError(f"shapes {shapes} in {dtype}: the shards came back as {facts[0].get('dtype')}\n"
                             "   likely mistake: the padding zeros were made without the tensors' dtype "
                             "(torch.zeros(k) is float32): use flat.new_zeros(k), which keeps dtype and device")
    got = np.concatenate([f["values"] for f in facts])
    exp = np.concatenate([_reference_shard(tensors, r, world) for r in range(world)])
    front = _front_padded(flat, world)
    per_tensor = _per_tensor_padded(tensors, world)

    def padded_in_front(g_, e_, front=front):
        if g_.shape == front.shape and np.allclose(g_, front):
            return "the padding is at the front; FSDP pads at the END, so rank 0 starts at element 0"

    def padded_each(g_, e_, per=per_tensor):
        if g_.shape == per.shape and np.allclose(g_, per):
            return "each tensor was padded on its own; pad once, the concatenation of all of them"
    checks.assert_close(f"{name}: the {world} shards of {shapes}, concatenated", got, exp, rtol=0, atol=0,
                        hint=[padded_in_front, padded_each, checks.wrong_shard_offset(world)])
    held = facts[0].get("held")
    if isinstance(held, int) and held > S:
        raise AssertionError(f"shapes {shapes}, world {world}: rank 0's shard is a view that keeps the "
                             f"whole {held:,}-element buffer alive, not a {S:,}-element copy"
                             + (" (the buffer is the tensor you were given: the shard shares memory with "
                                "the model's parameter, and an in-place update to one changes the other)"
                                if facts[0].get("shares") else "") + "\n"
                             "   likely mistake: return the slice's .clone() — the point of sharding is "
                             "that the full buffer can be freed")


@exercise("03", 'flat_shard', cell='def flat_shard(', hints=HINTS['flat_shard'], tests=TESTS['flat_shard'],
          mistakes={'no padding': 'pad the flat buffer with zeros', 'pads when it divides': 'already divides by',
                    'world ignored': 'use the `world` argument', 'rank ignored': 'the offset ignores the rank',
                    'dtype dropped': "without the tensors' dtype", 'padded in front': 'the padding is at the front',
                    'wrong offset': 'wrong rank offset',
                    'rounded down': 'it must be rounded UP', 'each tensor padded': 'each tensor was padded on its own',
                    'a view, not a copy': 'keeps the whole'},
          guards=("boundary", "argument", "cost"), judge=judge_flat_shard)
def check_flat_shard(fn, name: str = "flat_shard") -> bool:
    """``fn(tensors, rank, world) -> 1-D tensor``: this rank's shard of the padded flat parameter."""
    fn = _guard(fn, "03", "flat_shard")
    return decide(name, lab="03", tests=TESTS["flat_shard"], run=lambda: run_flat_shard(fn), judge=judge_flat_shard,
                  params={"name": name})


# -- Lab 03, exercise 2: all-gather in forward, reduce-scatter ÷N in backward ------------------------
_IN, _OUT = 17, 257                                    # Linear(17, 257): weight (257, 17), bias (257,): 4,626 elements


def _unit_on_rank(fn_cls, dtype_name: str):
    """Run half, on one rank: the learner's Unshard forward, then backward of a loss whose gradient on rank r is
    ``_coef(r)``; what came out (the gathered buffer, the gradient shard, the flat's state), as plain data."""
    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.strategies.fsdp.scratch import FlatParameter
    r = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    lin = _linear(dtype)                               # the same module on every rank
    slots = [(f"lin.{a}", lin, a, p) for a, p in lin._parameters.items()]
    flat = FlatParameter("lin", slots, None)
    coef = [c.to(dtype) for c in _coef(r)]
    with blocking(fn_cls):
        with (lt.phase("forward") if dtype is torch.float32 else lt.paused()):
            full = fn_cls.apply(flat.sharded, flat)
        out = {"type": type(full).__name__, "dtype": str(getattr(full, "dtype", None)), "state_fwd": flat.state.name,
               "held": flat.unsharded is not None and flat.unsharded is full,
               "full_numel": full.numel() if isinstance(full, torch.Tensor) else -1}
        if not isinstance(full, torch.Tensor) or full.dim() != 1 or full.numel() != flat.layout.padded_numel:
            return _plain.plain(out)                   # no views of it to take a gradient through
        with (lt.phase("backward") if dtype is torch.float32 else lt.paused()):
            loss = sum((v * c_).sum() for v, c_ in zip(flat.views(full), coef))   # rank r's gradient is coef_r
            loss.backward()
    g = flat.sharded.grad
    out.update({"full": full.detach(), "grad": g, "grad_dtype": str(getattr(g, "dtype", None)),
                "state_bwd": flat.state.name})
    return _plain.plain(out)


def _linear(dtype):
    """The unit every rank builds: Linear(17, 257) from seed 0 (the kernel's random state left as it was)."""
    import torch
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Linear(_IN, _OUT).to(dtype)


def _coef(rank: int):
    """Rank ``rank``'s gradient of the test loss, per parameter (weight, bias), in float32."""
    import torch
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(s, generator=g) for s in ((_OUT, _IN), (_OUT,))]


def _unit_reference(n: int) -> dict:
    """Judge side: what ``n`` ranks should see -- the padded size, the module's flat values, and each rank's
    gradient shard (the mean over ranks of the ranks' gradients, FlatParameter's layout)."""
    import torch
    lin = _linear(torch.float32)
    values = torch.cat([p.detach().reshape(-1) for p in lin.parameters()]).numpy()
    layout = flat_layout([values.size], n)
    total = sum(np.concatenate([c.numpy().reshape(-1) for c in _coef(r)]) for r in range(n))
    mean = np.concatenate([total / n, np.zeros(layout.padding, np.float32)])
    return {"padded": layout.padded_numel, "values": values,
            "grads": [mean[b.start:b.stop] for b in layout.shards]}


def _dtype_failure(exc) -> dict | None:
    """Run half: the facts of a float64 run that failed on a dtype (a buffer allocated without dtype=), or None."""
    first = str(exc).split("\n")[0]
    if getattr(exc, "exc_type", "") in ("RuntimeError", "TypeError", "ValueError") and (
            "dtype" in first.lower() or "tensor type" in first.lower() or "float" in first.lower()):
        return {"rank": getattr(exc, "rank", None), "said": first.split(": ", 1)[-1].split(" (expected")[0][:160]}
    return None


def run_unshard(fn_cls, world_size: int) -> dict:
    """Run half: the learner's Unshard on ``world_size`` ranks in float32 (with rank 0's ledger), in float64, and on
    a second world size; a float64 run that fails on a dtype, or a second world size that fails at all, as facts."""
    from course_lib.launch import run
    out = run(_unit_on_rank, fn_cls, "float32", world_size=world_size)
    data = {"float32": list(out), "ledger": ledger_rows(out.ledger.filter(rank=0))}
    try:
        data["float64"] = list(run(_unit_on_rank, fn_cls, "float64", world_size=world_size))
    except Exception as e:  # noqa: BLE001 - a RankError from the float64 run
        failed = _dtype_failure(e)
        if failed is None:
            raise
        data["float64_failed"] = failed
    other = 2 if world_size != 2 else 3
    try:
        data["other"] = list(run(_unit_on_rank, fn_cls, "float32", world_size=other))
    except Exception as e:  # noqa: BLE001 - it ran on world_size ranks: a crash on `other` is a hard-coded size
        if not_implemented_todo(e) is not None:
            raise
        data["other_failed"] = {"rank": getattr(e, "rank", None),
                                "said": str(e).split("\n")[0].split(": ", 1)[-1][:160]}
    return data


def _ranks(data: dict, key: str, n: int) -> list:
    res = data.get(key)
    if not isinstance(res, list) or len(res) != n or not all(isinstance(o, dict) for o in res):
        raise AssertionError(f"no result from each of {n} ranks ({key} run)")
    return res


def unshard_wire_bytes(data: dict) -> float:
    """Rank 0's wire bytes in the float32 run (a measurement: MEASURED["Unshard wire bytes"])."""
    from course_lib.comm.ledger import Ledger
    return costs.ledger_wire_bytes(Ledger.from_dicts(data["ledger"]))


def judge_unshard(data: dict, world_size: int = 4, name: str = "Unshard") -> str:
    """Judge half: the gathered buffer and gradient shards against the module and the mean gradient built here;
    the state of the flat after each pass; the ledger's collectives; float64; a second world size."""
    n = world_size
    if not isinstance(data, dict):
        raise AssertionError(f"no result from each of {n} ranks")
    out = _ranks(data, "float32", n)
    ref = _unit_reference(n)
    padded = ref["padded"]
    if out[0].get("full_numel") != padded:
        got = out[0].get("full_numel")
        why = (f"that is one shard ({padded // n}): return the gathered buffer, not the input" if got == padded // n
               else "return the whole gathered buffer, padding included (N × shard)")
        raise AssertionError(f"forward returned {out[0].get('type')} of {got} elements, expected the padded all-gather "
                             f"output of {padded} elements\n   likely mistake: {why}")
    for r in range(n):
        full = out[r].get("full")
        full = full[:ref["values"].size] if isinstance(full, np.ndarray) else full
        checks.assert_close(f"{name}.forward on rank {r} (padding stripped)", full, ref["values"],
                            rtol=0, atol=0, hint=[checks.wrong_shard_offset(1)])
    if out[0].get("state_fwd") != "UNSHARDED" or out[0].get("held") is not True:
        raise AssertionError("after forward the flat is not UNSHARDED with its buffer: set flat.unsharded = the "
                             "gathered buffer and flat.state = State.UNSHARDED (the hooks read both)")
    for r in range(n):
        if out[r].get("grad") is None:
            raise AssertionError(f"rank {r}: flat.sharded.grad is None\n   likely mistake: backward must "
                                 "return the gradient shard as its first output (and None for `flat`)")
        checks.assert_close(f"{name}.backward: gradient shard on rank {r}", out[r]["grad"], ref["grads"][r],
                            rtol=1e-5, atol=1e-6, hint=[checks.summed_not_averaged(n), divided_twice(n),
                                                         _full_not_shard(None)])
    if out[0].get("state_bwd") != "SHARDED":
        raise AssertionError("the gradient is right, but the flat is still UNSHARDED after backward\n   likely "
                             "mistake: free it (ctx.flat.reshard()) once the gradient is reduce-scattered")
    _judge_unshard_ledger(data.get("ledger"))
    wire = unshard_wire_bytes(data)
    if "float64_failed" in data:
        failed = data["float64_failed"] if isinstance(data["float64_failed"], dict) else {}
        where = f"on rank {failed.get('rank')}, " if failed.get("rank") is not None else ""
        raise AssertionError(f"with a float64 shard your Unshard failed ({where}{failed.get('said')})\n   likely "
                             "mistake: a buffer allocated without dtype= (torch.empty(k) is float32): allocate like "
                             "the input, dtype=sharded.dtype, device=sharded.device (the lab's parity check runs in "
                             "float64)")
    out64 = _ranks(data, "float64", n)
    if out64[0].get("dtype") != "torch.float64" or out64[0].get("grad_dtype") != "torch.float64":
        raise AssertionError(f"with a float64 shard, forward returned {out64[0].get('dtype')} and the gradient "
                             f"came back {out64[0].get('grad_dtype')}\n   likely mistake: a buffer allocated "
                             "without dtype= (torch.empty(k) is float32): allocate like the input, "
                             "dtype=sharded.dtype, device=sharded.device (the lab's parity check runs in float64)")
    _judge_other_world(data, 2 if n != 2 else 3, n, name)
    return (f"gathers {padded:,} elements (2 of padding), gradient shard = mean over {n} ranks, in float32 and "
            f"float64; ledger: all_gather + reduce_scatter, {wire:,.0f} wire bytes on rank 0")


def _judge_unshard_ledger(rows) -> None:
    from course_lib.comm.ledger import Ledger
    if not isinstance(rows, list):
        raise AssertionError("no ledger came back from rank 0")
    led = Ledger.from_dicts(rows)
    fwd, bwd = [x.op for x in led.filter(phase="forward")], [x.op for x in led.filter(phase="backward")]
    if fwd != ["all_gather"] or bwd != ["reduce_scatter"]:
        why = []
        if "all_reduce" in bwd:
            why.append("backward all-reduced the whole gradient and kept a slice: an all_reduce sends 2× the "
                       "bytes of a reduce_scatter, and every rank holds the whole summed gradient")
        if "all_reduce" in fwd:
            why.append("forward all-reduced a zero-filled buffer holding the shard: that sends 2× the bytes of "
                       "an all_gather for the same result")
        if not why:
            why.append("one collective each way: an all_gather in forward, a reduce_scatter in backward")
        raise AssertionError(f"the numbers are right, but rank 0 issued forward {fwd}, backward {bwd}; "
                             "expected one all_gather in forward and one reduce_scatter in backward\n"
                             "   likely mistake: " + "; ".join(why))


@exercise("03", 'Unshard', cell='class Unshard(', hints=HINTS['Unshard'], tests=TESTS['Unshard'],
          mistakes={'dtype dropped': 'allocated without dtype=', 'world size hard-coded': 'use dist.get_world_size()',
                    'all-reduce in backward': 'all_reduce sends 2× the bytes of a reduce_scatter',
                    'forward not an all-gather': '2× the bytes of an all_gather',
                    'not freed': 'still UNSHARDED after backward', 'summed, not averaged': 'summed instead of averaging',
                    'divided twice': 'you divided twice', 'returns the shard': 'return the gathered buffer, not the input',
                    'state not set': 'flat.state = State.UNSHARDED'},
          guards=("argument", "cost"), judge=judge_unshard,
          references=("course_lib.strategies.fsdp.scratch.Unshard.forward",
                      "course_lib.strategies.fsdp.scratch.Unshard.backward"))
def check_unshard_function(fn_cls, world_size: int = 4, name: str = "Unshard") -> bool:
    """``fn_cls.apply(sharded, flat)``: forward all-gathers the padded flat buffer (flat UNSHARDED);
    backward reduce-scatters the gradient and divides by N (flat SHARDED again); in float32 and float64."""
    fn_cls = _guard(fn_cls, "03", "Unshard")
    ran: dict = {}
    ok = decide(name, lab="03", tests=TESTS["Unshard"],
                run=lambda: ran.setdefault("data", run_unshard(fn_cls, world_size)), judge=judge_unshard, params={"world_size": world_size, "name": name})
    if ok:
        MEASURED["Unshard wire bytes"] = unshard_wire_bytes(ran["data"])
    return ok


def _world_hard_coded(n: int, other: int):
    def detect(got, exp):
        if got.shape == exp.shape and np.any(exp != 0) and np.allclose(got, exp * n / other, rtol=1e-4, atol=1e-7):
            return (f"got is the mean × {n}/{other}: with {n} ranks you divided by {other}, the world size is "
                    "hard-coded (the notebook's N?); use dist.get_world_size()")
    return detect


def _judge_other_world(data: dict, n: int, usual: int, name: str) -> None:
    """The same unit on ``n`` ranks (not the usual ``usual``): the world size is an argument too."""
    failed = data.get("other_failed")
    if failed is not None:
        failed = failed if isinstance(failed, dict) else {}
        where = f"on rank {failed.get('rank')}, " if failed.get("rank") is not None else ""
        raise AssertionError(f"on {usual} ranks your Unshard is right, but on {n} ranks it failed "
                             f"({where}{failed.get('said')})\n   likely mistake: a size hard-coded for {usual} ranks "
                             "(the notebook's N?): use dist.get_world_size()")
    out, ref = _ranks(data, "other", n), _unit_reference(n)
    if out[0].get("full_numel") != ref["padded"]:
        raise AssertionError(f"on {n} ranks forward returned {out[0].get('full_numel')} elements, expected "
                             f"{ref['padded']}\n   likely mistake: a size hard-coded for {usual} ranks (the "
                             "notebook's N?): use dist.get_world_size()")
    for r in range(n):
        checks.assert_close(f"{name}.backward on {n} ranks: gradient shard on rank {r}", out[r].get("grad"),
                            ref["grads"][r], rtol=1e-5, atol=1e-6,
                            hint=[_world_hard_coded(n, usual), checks.summed_not_averaged(n), divided_twice(n)])


def _full_not_shard(_):
    def detect(got, exp):
        if got.size != exp.size:
            return "the gradient must have the shard's size: reduce-scatter into a shard-sized buffer"
    return detect


# -- Lab 03, exercise 3 and 4: the unit lifecycle, then prefetch (run and judged by checks.fsdp_harness) --------
def _training_facts(data, world_size: int, steps: int):
    """Judge side: rank 0's facts of the run (or the plumbing's diagnosis), the units, and DDP's numbers."""
    plumbing_failure(data)
    o = data["ranks"][0]
    units = units_of(LAB_CONFIG)
    names = [u for u, _, _ in units]
    flats = [flat_layout([int(np.prod(s)) for s in shapes], world_size).padded_numel * 4 for _, _, shapes in units]
    return o, [shapes for _, _, shapes in units], names, flats, ddp_reference(LAB_CONFIG, steps, world_size)


def _losses(o, steps: int) -> list:
    got = o.get("losses")
    if not isinstance(got, list) or len(got) != steps:
        raise AssertionError(f"rank 0 reported {got!r} as its losses, expected one per step ({steps})")
    return got


def judge_fsdp_class(data, world_size: int = 4, steps: int = 3, name: str = "MyFSDP") -> str:
    """Judge half: rank 0's step-0 gradient shards and every step's loss against DDP's (computed here in one
    process), the units' states, each step's ledger against the formula, and the peak of gathered bytes."""
    o, units, names, flats, ref = _training_facts(data, world_size, steps)
    left = o.get("left")
    if not isinstance(left, list) or any(x is not False for x in left):
        raise AssertionError("after the step some units are still UNSHARDED\n   likely mistake: post_forward "
                             "must call flat.reshard() (and Unshard.backward frees the unit after its backward)")
    grads_match_ddp(o, ref, name, world_size, names)
    checks.assert_close(f"{name} losses vs DDP ({steps} SGD steps)", _losses(o, steps), ref["losses"],
                        **checks.TOLERANCES["fp32"])
    analytic = ledger_matches_formula(data["ledger"], units, world_size, steps)
    root, blocks = flats[0], flats[1:]
    want, peak = root + max(blocks), o.get("peak")
    if not isinstance(peak, int):
        raise AssertionError(f"the run measured no peak of gathered bytes (got {peak!r})")
    if peak > want:
        raise AssertionError(f"the right values and bytes, but {peak:,} parameter bytes were gathered at once; "
                             f"FSDP holds the root and one block at a time, {want:,} bytes (all units: "
                             f"{sum(flats):,})\n   likely mistake: gather only the unit that is about to "
                             "run (pre_backward: flat.unshard() of this flat, not of every unit)")
    return (f"DDP's gradients and losses over {steps} steps; per step {len(units)} all-gathers forward + "
            f"{len(units)} backward + {len(units)} reduce-scatters = {analytic.wire_bytes:,.0f} wire bytes, the "
            "formula exactly")


@exercise("03", 'MyFSDP', cell='class MyFSDP(', hints=HINTS['MyFSDP'], tests=TESTS['MyFSDP'],
          mistakes={"crash in the learner's code": 'your code raised',
                    'never freed': 'post_forward must call flat.reshard()', 'gathers too much': 'gathered at once',
                    'no re-gather': 'pre_backward must gather the unit again', 'no views': 'flat.set_views(full)',
                    'bypasses autograd': 'did not go through the autograd Function',
                    'forgets the buffer': 'flat.unsharded = None alone', 'summed, not averaged': 'summed instead of averaging'},
          guards=("cost",), judge=judge_fsdp_class,
          references=("course_lib.strategies.fsdp.scratch.FlatFSDP.pre_forward",
                      "course_lib.strategies.fsdp.scratch.FlatFSDP.post_forward",
                      "course_lib.strategies.fsdp.scratch.FlatFSDP.pre_backward"))
def check_fsdp_class(cls, world_size: int = 4, steps: int = 3, name: str = "MyFSDP") -> bool:
    """``cls(model, units)`` trains the lab's GPT: DDP's gradients and losses, FSDP's ledger, units freed."""
    cls = _guard(cls, "03", "MyFSDP")
    return decide(name, lab="03", tests=TESTS["MyFSDP"], run=lambda: train_learner_class(cls, world_size, steps),
                  judge=judge_fsdp_class, params={"world_size": world_size, "steps": steps, "name": name})


def _check_prefetch_plan(events, names):
    """events: (where, unit, async) of every all-gather actually started. Want: in pre_forward of unit i,
    an async gather of unit i+1 (forward order root, blocks.0, ...), for every unit but the last."""
    if not isinstance(events, list) or not all(isinstance(e, (list, tuple)) and len(e) == 3 for e in events):
        raise AssertionError("the run recorded no all-gathers started in the last step")
    fwd = [tuple(e) for e in events if e[0] is not None]     # started inside a lifecycle method
    started = {}
    for where, unit, is_async in fwd:
        started.setdefault(where, []).append((unit, is_async))
    late = [w for w in started if str(w).startswith("post_forward")]
    if late:
        raise AssertionError(f"gathers started in {late[0]}\n   likely mistake: after a unit's forward is too late "
                             "to overlap anything; start the next unit's gather in pre_forward")
    for i, unit in enumerate(names[:-1]):
        here = [(u, a) for u, a in started.get(f"pre_forward:{unit}", []) if u != unit]
        want = names[i + 1]
        if not here:
            raise AssertionError(f"pre_forward of {unit} started no gather ahead\n   likely mistake: after "
                                 f"super().pre_forward(flat), start self.next_unit(flat) ({want}) with "
                                 "async_op=True")
        if len(here) > 1:
            raise AssertionError(f"pre_forward of {unit} started {len(here)} gathers ahead ({[u for u, _ in here]})\n"
                                 "   likely mistake: prefetch ONE unit, the next one: gathering every unit at once "
                                 "holds them all in memory, which is what FSDP exists to avoid")
        u, is_async = here[0]
        if u != want:
            raise AssertionError(f"pre_forward of {unit} prefetched {u}, but {want} runs next\n   likely mistake: "
                                 "use self.next_unit(flat), the unit that runs after this one")
        if not is_async:
            raise AssertionError(f"pre_forward of {unit} gathered {u} with async_op=False: it waited for it, so "
                                 "nothing overlaps (a synchronous \"prefetch\" only moves the wait)\n   likely "
                                 "mistake: nxt.unshard(async_op=True) starts it and returns at once")


def judge_prefetch(data, world_size: int = 4, steps: int = 2, name: str = "prefetch") -> str:
    """Judge half: DDP's gradients and losses (one process), the plan of the gathers started (the next unit,
    asynchronously, in each pre_forward), the ledger against the formula, the peak exactly root + 2 blocks."""
    o, units, names, flats, ref = _training_facts(data, world_size, steps)
    grads_match_ddp(o, ref, name, world_size, names)
    checks.assert_close(f"{name} losses vs DDP", _losses(o, steps), ref["losses"], **checks.TOLERANCES["fp32"])
    _check_prefetch_plan(o.get("events"), names)
    ledger_matches_formula(data["ledger"], units, world_size, steps)
    root, blocks = flats[0], sorted(flats[1:])
    want, peak = root + sum(blocks[-2:]), o.get("peak")
    if not isinstance(peak, int):
        raise AssertionError(f"the run measured no peak of gathered bytes (got {peak!r})")
    if peak != want:
        raise AssertionError(f"at most {peak:,} bytes were gathered at once; one unit ahead holds the root "
                             f"and two blocks, {want:,} bytes\n   likely mistake: prefetch exactly the next unit")
    return (f"losses and bytes unchanged; the next unit gathered asynchronously in each pre_forward; peak "
            f"unsharded {peak:,} bytes = root + 2 blocks (without prefetch: root + 1 block = {root + blocks[-1]:,})")


@exercise("03", 'prefetch', cell='class Prefetching(', hints=HINTS['prefetch'], tests=TESTS['prefetch'],
          mistakes={'synchronous prefetch': 'async_op=False', 'no prefetch': 'started no gather ahead',
                    'prefetches every unit': 'prefetch ONE unit', 'wrong unit': 'runs next',
                    'prefetch too late': 'too late to overlap'},
          guards=("cost",), judge=judge_prefetch)
def check_prefetch(cls, world_size: int = 4, steps: int = 2, name: str = "prefetch") -> bool:
    """``cls(model, units)`` prefetches the next unit: same losses and bytes, the next unit's all-gather
    started asynchronously in the current unit's pre_forward, root + two blocks unsharded at the peak."""
    cls = _guard(cls, "03", "prefetch")
    return decide(name, lab="03", tests=TESTS["prefetch"],
                  run=lambda: train_learner_class(cls, world_size, steps, log_prefetch=True),
                  judge=judge_prefetch, params={"world_size": world_size, "steps": steps, "name": name})
