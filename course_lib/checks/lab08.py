"""Lab 08's exercise checks (performance): a step time from the model, the compute-bound batch, a 70B plan,
and the price of full activation checkpointing.

Every check is pure arithmetic against :mod:`course_lib.maths.step_model` and :mod:`course_lib.maths.planner`
on fixed inputs (no timing), so a right answer always passes and each likely mistake gets its own diagnosis.

Each check is split in two (:mod:`course_lib.checks.judge`): the *run half* calls the learner's function on the
check's inputs and returns what came out as plain data (each value with its type's name and what kind of number it
is); the *judge half* (``judge_*``) builds the same inputs again, computes the model's or the planner's answer itself
and names the likely mistake. The ``reference_*`` functions are registered as the exercises' references.

``HINTS[name]`` holds three layers of hints per exercise: the idea, the method, then near-code; a learner asks
for them as in every lab, ``checks.hint(name, level)`` (the exercise registry registers them).

Longer than ~300 lines: four exercise checks, each with its fixed cases, its run half and its judge half with the
diagnoses of its likely mistakes.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.maths import planner, step_model
from course_lib.maths.costs import AlphaBeta

__all__ = ["HINTS", "REFERENCE_CAL", "reference_step_seconds", "check_step_seconds", "judge_step_seconds",
           "reference_compute_bound_batch", "check_compute_bound_batch", "judge_compute_bound_batch", "EX3_CLUSTER",
           "EX3_BUDGET", "EX3_SEQ", "reference_plan_70b", "check_plan_70b", "judge_plan_70b"]

HINTS = {
    "step_seconds": [
        "A step is compute, plus FSDP's own work around each all-gather and reduce-scatter, plus every "
        "collective's α-β time. Each term has its own fitted numbers.",
        "Walk cost.ops: each OpCost is `count` calls of one op over a group of `group_size` ranks, moving "
        "`wire_bytes` in all. Look up that (op, group) fit in comm; α is paid per call, β per wire byte. "
        "Compute is compute.seconds(flops); the framework term is γ per all-gather or reduce-scatter call "
        "(all-reduces get none).",
        "sum(o.count * ab.alpha_s + ab.beta_s_per_byte * o.wire_bytes for o in cost.ops with "
        "ab = comm.alpha_beta(o.op, o.group_size)) + compute.seconds(flops) + gamma * (all-gather and "
        "reduce-scatter calls)",
    ],
    "compute_bound_batch": [
        "Compute grows with the batch, FSDP's traffic does not: find where the first catches up with the second.",
        "Try per-GPU batches 1, 2, 3, ... with planner.plan(model, cluster, strategy, b, seq_len=...) and "
        "stop at the first plan whose compute_s >= comm_s (plan.compute_bound). Per GPU, in sequences.",
        "next(b for b in range(1, limit + 1) if planner.plan(model, cluster, strategy, b, seq_len=seq_len, "
        "checkpointing=checkpointing).compute_bound), or None when none is",
    ],
    "plan_70b": [
        "Model state alone is 16 bytes per parameter divided by the GPUs that share it; activations come on "
        "top and grow with the batch. Both must fit under the budget.",
        "Shard over as many GPUs as you can (which strategy keeps 16Ψ/N?), recompute activations "
        "(checkpointing='full'), then raise the batch while planner.plan(...).total stays under the budget.",
        "p = planner.plan(planner.LLAMA3_70B, cluster, 'fsdp', b, seq_len=EX3_SEQ, checkpointing='full'); "
        "keep the largest b with p.total <= budget; report memory_bytes=p.total",
    ],
}


# -- exercise 1: a step time from the model -------------------------------------------------------------
#: A calibration with round numbers (the shape of one measured on a 2-core laptop): the check's fixed input.
REFERENCE_CAL = {
    "compute": step_model.ComputeModel(8e-3, 40e9),
    "comm": step_model.CommModel({
        ("all_gather", 4): AlphaBeta(3e-3, 1 / 0.7e9), ("reduce_scatter", 4): AlphaBeta(4e-3, 1 / 0.4e9),
        ("all_reduce", 4): AlphaBeta(2.5e-3, 1 / 0.8e9), ("all_gather", 2): AlphaBeta(1.2e-3, 1 / 0.6e9),
        ("reduce_scatter", 2): AlphaBeta(2e-3, 1 / 0.35e9), ("all_reduce", 2): AlphaBeta(1.5e-3, 1 / 0.9e9)}),
    "gamma": 3e-3,
}
#: (strategy, N, batch, d_model, replicate, γ): γ differs in the last case, so that γ is an argument that matters.
_EX1_CASES = (("dp", 4, 16, 128, 1, 3e-3), ("fsdp", 4, 16, 128, 1, 3e-3), ("hsdp", 4, 16, 128, 2, 3e-3),
              ("fsdp", 2, 8, 256, 1, 1.5e-3))
_EX1_ARGS = ("strategy", "cost", "flops", "compute", "comm", "gamma")


def _ex1_args(strategy, n, batch, width, replicate, gamma) -> tuple:
    """One case's arguments: ``(strategy, cost, flops, compute, comm, gamma)`` -- the step's ops and FLOPs as
    :func:`~course_lib.maths.step_model.predict` starts from them, no predicted time."""
    from course_lib.models.config import GPTConfig
    cfg = GPTConfig(vocab_size=67, seq_len=64, d_model=width, n_heads=4, n_layers=2, d_ff=4 * width)
    cost = step_model.step_cost(strategy, step_model.gpt_units(cfg), n, padding="none" if strategy == "dp" else "dim0",
                                replicate=replicate, root_unit=None if strategy == "dp" else 0)
    flops = step_model.train_flops(cfg, batch // n * cfg.seq_len)
    return strategy, cost, flops, REFERENCE_CAL["compute"], REFERENCE_CAL["comm"], gamma


def _number(value) -> dict:
    """Run half: a returned value as plain data, with its type's name and the kind of number it is (``"bool"``,
    ``"int"``, ``"float"``, ``"real"`` for another numbers.Real such as NumPy's, ``"other"``), read without calling
    a method of the value's own class."""
    kind = ("bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float"
            if isinstance(value, float) else "real" if isinstance(value, numbers.Real) else "other")
    return {"value": _plain.plain(value), "type": type(value).__name__, "kind": kind}


def _as_number(got, kinds=("int", "float")):
    """Judge side: the number a :func:`_number` record holds if its kind is one of ``kinds``, else None."""
    if not isinstance(got, dict) or got.get("kind") not in kinds:
        return None
    v = got.get("value")
    if hasattr(v, "ndim") and getattr(v, "ndim", 1) == 0 and getattr(v, "dtype", None) is not None \
            and v.dtype.kind in "iuf":
        v = v.item()
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _shown(got) -> str:
    """A :func:`_number` record (or anything) as the ❌ line shows what was returned."""
    if isinstance(got, dict) and "value" in got:
        v = got["value"]
        if isinstance(v, dict) and set(v) == {_plain.UNPLAIN}:
            return f"a {got.get('type', v[_plain.UNPLAIN])}"
        return repr(v)
    return repr(got)


def _gots(data, count: int, name: str) -> list:
    """Judge side: the run's list of ``count`` values, or an AssertionError saying what came instead."""
    got = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got, list) or len(got) != count:
        raise AssertionError(f"{name} was not run on each of the {count} cases (the run sent {_shown(data)[:200]})")
    return got


def reference_step_seconds(strategy, cost, flops, compute, comm, gamma) -> float:
    """The model's step (no overlap): compute + γ · (all-gather and reduce-scatter calls) + Σ count·α + β·wire."""
    return (compute.seconds(flops) + gamma * step_model.framework_calls(cost)
            + sum(comm.seconds(o) for o in cost.ops))


def _ex1_mistakes(strategy, cost, flops, compute, comm, gamma) -> dict:
    """Likely wrong answers, by diagnosis."""
    fw = gamma * step_model.framework_calls(cost)
    every = gamma * sum(o.count for o in cost.ops)
    ab = lambda o: comm.alpha_beta(o.op, o.group_size)  # noqa: E731
    return {
        "left out α: every call pays the latency α, however small the message": compute.seconds(flops) + fw + sum(
            ab(o).beta_s_per_byte * o.wire_bytes for o in cost.ops),
        "paid α once per op kind: α is per *call*, and an op runs `count` times a step": compute.seconds(flops) + fw + sum(
            ab(o).alpha_s + ab(o).beta_s_per_byte * o.wire_bytes for o in cost.ops),
        "used payload bytes: β multiplies the *wire* bytes (ring: (N-1)/N of the payload, 2(N-1)/N for an "
        "all-reduce)": compute.seconds(flops) + fw + sum(
            o.count * ab(o).alpha_s + ab(o).beta_s_per_byte * o.payload_bytes for o in cost.ops),
        "used the all-reduce fit for every op: each op has its own α and β (gloo's reduce-scatter costs about "
        "an all-reduce)": compute.seconds(flops) + fw + sum(
            o.count * comm.alpha_beta("all_reduce", o.group_size).alpha_s
            + comm.alpha_beta("all_reduce", o.group_size).beta_s_per_byte * o.wire_bytes for o in cost.ops),
        "left out compute: the step also runs forward, backward and the optimizer": fw + sum(
            comm.seconds(o) for o in cost.ops),
        "left out the framework term γ · calls (FSDP2's hooks and copies around each all-gather and "
        "reduce-scatter)": compute.seconds(flops) + sum(comm.seconds(o) for o in cost.ops),
        "charged γ on all-reduces too: γ is FSDP's copy-in/copy-out around all-gathers and reduce-scatters; an "
        "all-reduce (DDP's buckets, HSDP's replicate step) reduces in place": compute.seconds(flops) + every + sum(
            comm.seconds(o) for o in cost.ops),
    }


def _ex1_terms(strategy, cost, flops, compute, comm, gamma) -> dict:
    """The model's three terms, each with its likely wrong versions: ``{term: {mistake or None: seconds}}``
    (None: the right one). Two wrong terms at once are told apart by trying every combination."""
    ab = lambda o: comm.alpha_beta(o.op, o.group_size)  # noqa: E731
    ar = lambda o: comm.alpha_beta("all_reduce", o.group_size)  # noqa: E731
    m = list(_ex1_mistakes(strategy, cost, flops, compute, comm, gamma))   # the same wording as one mistake alone
    return {
        "compute": {None: compute.seconds(flops), m[4]: 0.0},
        "framework": {None: gamma * step_model.framework_calls(cost), m[5]: 0.0,
                      m[6]: gamma * sum(o.count for o in cost.ops)},
        "communication": {
            None: sum(comm.seconds(o) for o in cost.ops),
            m[0]: sum(ab(o).beta_s_per_byte * o.wire_bytes for o in cost.ops),
            m[1]: sum(ab(o).alpha_s + ab(o).beta_s_per_byte * o.wire_bytes for o in cost.ops),
            m[2]: sum(o.count * ab(o).alpha_s + ab(o).beta_s_per_byte * o.payload_bytes for o in cost.ops),
            m[3]: sum(o.count * ar(o).alpha_s + ar(o).beta_s_per_byte * o.wire_bytes for o in cost.ops)},
    }


def _ex1_two_terms(cases, gots) -> str | None:
    """Two or three terms wrong at once: the one combination of wrong versions that gives the learner's numbers
    in every case, each wrong term named; None if no combination does (or more than one does)."""
    import itertools
    per_case = [_ex1_terms(*args) for args in cases]
    names = list(per_case[0])
    found = []
    for combo in itertools.product(*(list(per_case[0][t]) for t in names)):
        if sum(k is not None for k in combo) < 2:
            continue
        values = [sum(terms[t][k] for t, k in zip(names, combo)) for terms in per_case]
        if _same_everywhere(gots, values):
            found.append(combo)
    if len(found) != 1:
        return None
    return "more than one term is wrong:" + "".join(
        f"\n   - {t}: {k}" for t, k in zip(names, found[0]) if k is not None)


def _same_everywhere(gots, values) -> bool:
    return all(math.isclose(g, v, rel_tol=1e-6) for g, v in zip(gots, values))


def _ignored_argument(reference, cases, gots, names, same) -> str | None:
    """The argument the learner's answers behave as if it were a constant: ``reference`` with that argument fixed
    to one value the cases use gives the learner's answer in *every* case. None if no argument fits."""
    for i, arg in enumerate(names):
        seen = []
        for case in cases:
            if not any(case[i] is v or case[i] == v for v in seen):
                seen.append(case[i])
        for v in seen:
            fixed = [reference(*case[:i], v, *case[i + 1:]) for case in cases]
            if all(same(g, f) for g, f in zip(gots, fixed)) and \
                    not all(same(f, reference(*case)) for f, case in zip(fixed, cases)):
                shown = f"{v:g}" if isinstance(v, (int, float)) else getattr(v, "name", type(v).__name__)
                return (f"your answers are those of {arg} = {shown} in every case: the answer ignores its argument "
                        f"`{arg}` (use the value passed in; each argument changes the answer in some case)")
    return None


def run_step_seconds(fn) -> dict:
    """Run half: the learner's seconds for each case of :data:`_EX1_CASES` (no expected value here); each call gets
    its own copy of the calibration, so an answer that edits ``comm.fits`` changes nothing the judge reads."""
    import copy
    return {"got": [_number(fn(*copy.deepcopy(_ex1_args(*case)))) for case in _EX1_CASES]}


def judge_step_seconds(data) -> str:
    """Judge half: each case's seconds against the model's, with the likely omission named."""
    got_all = _gots(data, len(_EX1_CASES), "step_seconds")
    for (strategy, n, *_), got in zip(_EX1_CASES, got_all):
        value = _as_number(got)
        if value is None or not math.isfinite(value):
            raise AssertionError(f"{strategy} N={n}: returned {_shown(got)}; return the step time in seconds (a float)")
    cases, gots = [_ex1_args(*case) for case in _EX1_CASES], [_as_number(got) for got in got_all]
    wants = [reference_step_seconds(*args) for args in cases]
    wrong = [i for i, (g, w) in enumerate(zip(gots, wants)) if not math.isclose(g, w, rel_tol=1e-6)]
    if wrong:
        i = wrong[0]
        strategy, n, batch, width, r, gamma = _EX1_CASES[i]
        got, want = gots[i], wants[i]
        where = f"{strategy} N={n} B={batch} d={width}: got {got * 1e3:.3f} ms, the model says {want * 1e3:.3f} ms"
        per_case = [_ex1_mistakes(*args) for args in cases]     # the same mistakes, priced case by case
        why = next((w for w in per_case[0] if _same_everywhere(gots, [m[w] for m in per_case])), None)
        if why is None and _same_everywhere(gots, [1e3 * w for w in wants]):
            why = "that is milliseconds: return seconds"
        if why is None and _same_everywhere(gots, [w / 1e3 for w in wants]):
            why = "looks like milliseconds / 1000 twice? return seconds"
        if why is None:
            why = _ex1_two_terms(cases, gots)
        if why is None:
            why = _ignored_argument(reference_step_seconds, cases, gots, _EX1_ARGS,
                                    lambda a, b: math.isclose(a, b, rel_tol=1e-6))
        if why is None:     # one case only: what differs there, and whether it depends on the strategy
            why = next((w for w, v in _ex1_mistakes(*cases[i]).items()
                        if math.isclose(got, v, rel_tol=1e-6) and not math.isclose(v, want, rel_tol=1e-6)), None)
            right = sorted({_EX1_CASES[k][0] for k in range(len(cases)) if k not in wrong})
            if right and _EX1_CASES[i][0] not in right:
                why = (f"right for {', '.join(right)} but not for {strategy}: the model is the same for every "
                       f"strategy (the ops in cost.ops say what runs)" + (f"; here you {why}" if why else ""))
        raise AssertionError(f"{where} → {why or 'compare term by term with step_model.predict(...).comm_by_op'}")
    return f"{len(_EX1_CASES)} configurations (DP, FSDP, HSDP 2x2, FSDP on 2 ranks) match the model"


@exercise("08", 'step_seconds', cell='def step_seconds(', hints=HINTS['step_seconds'], guards=("argument", "cost"),
          mistakes={'strategy branch': 'the same for every strategy', 'α left out': 'left out α',
                    'α once per op': 'α is per *call*', 'payload bytes': 'used payload bytes',
                    'one fit for every op': 'each op has its own α and β', 'compute left out': 'left out compute',
                    'γ left out': 'left out the framework term', 'γ on all-reduces': 'charged γ on all-reduces',
                    'argument ignored': 'ignores its argument', 'milliseconds': 'that is milliseconds',
                    'not a float': 'return the step time in seconds',
                    'two terms wrong': 'more than one term is wrong'},
          judge=judge_step_seconds, references=("course_lib.checks.lab08.reference_step_seconds",))
def check_step_seconds(fn, name: str = "step_seconds") -> bool:
    """``fn(strategy, cost, flops, compute, comm, gamma)`` returns the model's step time in seconds."""
    fn = _guard(fn, "08", "step_seconds")
    return decide(name, lab="08", tests="DP, FSDP, HSDP 2x2 and FSDP on 2 ranks, with fixed calibration numbers (γ "
                  "differs in one): your seconds against the course's model, and each classic omission named",
                  run=lambda: run_step_seconds(fn), judge=judge_step_seconds)


# -- exercise 2: the compute-bound batch ----------------------------------------------------------------
_EX2_CASES = (
    (planner.LLAMA3_8B, planner.Cluster(planner.H100, 8, 1), "fsdp", 8192, "full"),
    (planner.LLAMA3_8B, planner.Cluster(planner.H100, 8, 4, inter=planner.ETH_100G), "fsdp", 4096, "full"),
    (planner.LLAMA3_70B, planner.Cluster(planner.H100, 8, 8, inter=planner.IB_NDR), "fsdp", 4096, "full"),
    (planner.LLAMA3_8B, planner.Cluster(planner.A100_80GB, 1, 8, planner.NVLINK_A100, planner.ETH_10G), "fsdp",
     2048, "none"),
    # the boundaries the text states: at batch 7 compute time *equals* the traffic to the last bit (">=" covers
    # it); on a slow link the first compute-bound batch is 4096 itself ("up to 4096" includes it)
    (planner.LLAMA3_8B, planner.Cluster(planner.H100, 8, 2, inter=planner.Link(
        "a 449 GB/s link", 448812297649.2413, 20e-6, 0.85, 4 * 2**20)), "fsdp", 128, "full"),
    (planner.LLAMA3_8B, planner.Cluster(planner.H100, 8, 2, inter=planner.Link(
        "a 1.06 GB/s link", 1.059e9, 20e-6, 0.85, 4 * 2**20)), "fsdp", 128, "full"),
)
LIMIT = 4096
#: Not in the ✅ line: the same 32-GPU cluster under other strategies and checkpointing, so that an answer that
#: reads `strategy`, `checkpointing` or `seq_len` as a constant (every case above is FSDP) is caught and named.
_EX2_PROBES = (
    (planner.LLAMA3_8B, planner.Cluster(planner.H100, 8, 4, inter=planner.ETH_100G), "dp", 2048, "selective"),
    (planner.LLAMA3_8B, planner.Cluster(planner.H100, 8, 4, inter=planner.ETH_100G), "hsdp", 4096, "full"),
)


def _ex2_ignored(got, model, cluster, strategy, seq, ac) -> str | None:
    """An argument the answer reads as a constant: ``got`` is the answer for another value of it."""
    asked = {"strategy": strategy, "seq_len": seq, "checkpointing": ac}
    others = [("strategy", s) for s in ("fsdp", "dp", "hsdp", "zero1", "zero2")]
    others += [("checkpointing", a) for a in ("none", "full", "selective")]
    others += [("seq_len", q) for q in (model.seq_len, 4096, 2048)]
    for arg, value in others:
        if value == asked[arg]:
            continue
        kw = {**asked, arg: value}
        if got == reference_compute_bound_batch(model, cluster, kw["strategy"], kw["seq_len"], kw["checkpointing"]):
            return (f" → that is the answer for {arg}={value!r}, not the {arg}={asked[arg]!r} asked: `{arg}` is "
                    "ignored (pass every argument on to planner.plan)")
    return None


def reference_compute_bound_batch(model, cluster, strategy, seq_len, checkpointing="full"):
    """The smallest per-GPU batch (sequences) whose compute time >= communication time, or None up to LIMIT."""
    lo, hi = 1, LIMIT
    bound = lambda b: planner.plan(model, cluster, strategy, b, seq_len=seq_len,  # noqa: E731
                                   checkpointing=checkpointing).compute_bound
    if not bound(hi):
        return None
    while lo < hi:                       # compute grows with b, comm does not: bisect
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if bound(mid) else (mid + 1, hi)
    return lo


def _ex2_order() -> list:
    """(case, probe?) in the order the check asks: the probes before the last case (an answer that searches
    linearly reaches batch 4096 only if it passed them)."""
    return [(case, False) for case in _EX2_CASES[:-1]] + [(p, True) for p in _EX2_PROBES] + [(_EX2_CASES[-1], False)]


def run_compute_bound_batch(fn) -> dict:
    """Run half: the learner's batch for each case and probe, in :func:`_ex2_order` (no expected value here)."""
    return {"got": [_number(fn(model, cluster, strategy, seq, ac)) for (model, cluster, strategy, seq, ac), _
                    in _ex2_order()]}


def judge_compute_bound_batch(data) -> str:
    """Judge half: each batch against the planner's smallest compute-bound batch, with the likely slip named."""
    order = _ex2_order()
    got_all = _gots(data, len(order), "compute_bound_batch")
    rows = []
    for ((model, cluster, strategy, seq, ac), probe), record in zip(order, got_all):
        want = reference_compute_bound_batch(model, cluster, strategy, seq, ac)
        got = _as_number(record, ("int", "float", "real"))
        where = (f"{model.name} on {cluster.nodes}x{cluster.gpus_per_node} {cluster.gpu.name} "
                 f"({cluster.inter.name if cluster.nodes > 1 else cluster.intra.name}), {strategy}, seq {seq}, "
                 f"checkpointing {ac!r}")
        if got is None and not (isinstance(record, dict) and record.get("kind") == "other"
                                and record.get("value") is None):
            raise AssertionError(f"{where}: got {_shown(record)}, expected {want} → returned a "
                                 f"{record.get('type') if isinstance(record, dict) else type(record).__name__}: "
                                 "return a batch, a whole number of sequences per GPU (an int), or None")
        if got == want:
            if not probe:
                rows.append(f"{model.name} {cluster.nodes * cluster.gpus_per_node} GPUs: {want}")
            continue
        msg = f"{where}: got {got!r}, expected {want}"
        at = planner.plan(model, cluster, strategy, want, seq_len=seq, checkpointing=ac) if want else None
        ignored = (_ex2_ignored(got, model, cluster, strategy, seq, ac)
                   if isinstance(got, numbers.Integral) and not isinstance(got, bool) else None)
        if at is not None and got == want + 1 and at.compute_s == at.comm_s:
            msg += (f" → at batch {want} compute time equals the communication time exactly, and equal covers "
                    "it: 'covers' is >= (plan.compute_bound), not >")
        elif want == LIMIT and got is None:
            msg += " → batch 4096 is compute-bound: 'up to 4096' includes 4096 (search 1..4096, both ends)"
        elif got is None:
            msg += f" → batch {want} is compute-bound (plan(...).compute_bound); search every batch up to {LIMIT}"
        elif want is not None and isinstance(got, numbers.Real) and not isinstance(got, bool):
            if got == want - 1:
                msg += " → off by one: that is the last batch that is NOT yet compute-bound"
            elif got == want * seq:
                msg += " → that is tokens; the answer is in sequences per GPU"
            elif got == want * cluster.world:
                msg += " → that is the global batch; the answer is per GPU"
            elif not float(got).is_integer() or (got < want and math.ceil(got) == want):
                msg += " → a batch is a whole number of sequences: round the crossing point up"
            elif ignored:
                msg += ignored
            elif got < want:
                msg += " → too small: at that batch communication still takes longer than compute"
            else:
                msg += " → not the smallest: a smaller batch is already compute-bound"
        raise AssertionError(msg)
    return "; ".join(rows)


@exercise("08", 'compute_bound_batch', cell='def compute_bound_batch(', hints=HINTS['compute_bound_batch'],
          guards=("feasible", "boundary", "argument"),
          mistakes={'tie not covered': "'covers' is >=", 'limit excluded': "'up to 4096' includes 4096",
                    'off by one': 'off by one', 'tokens': 'that is tokens', 'global batch': 'that is the global batch',
                    'fraction': 'round the crossing point up', 'too small': 'too small',
                    'not the smallest': 'not the smallest', 'none found': 'is compute-bound',
                    'strategy ignored': '`strategy` is ignored', 'checkpointing ignored': '`checkpointing` is ignored',
                    'seq_len ignored': '`seq_len` is ignored', 'not a number': 'return a batch, a whole number'},
          judge=judge_compute_bound_batch, references=("course_lib.checks.lab08.reference_compute_bound_batch",))
def check_compute_bound_batch(fn, name: str = "compute_bound_batch") -> bool:
    """``fn(model, cluster, strategy, seq_len, checkpointing)`` returns the smallest compute-bound batch per GPU."""
    fn = _guard(fn, "08", "compute_bound_batch")
    return decide(name, lab="08", tests="six model x cluster cases: the smallest batch per GPU at which the planner "
                  "says compute time covers the traffic (one exact tie, one answer of 4096 itself), and one cluster "
                  "under DP and HSDP with other checkpointing",
                  run=lambda: run_compute_bound_batch(fn), judge=judge_compute_bound_batch)


# -- exercise 3: a 70B run under a memory budget ---------------------------------------------------------
EX3_CLUSTER = planner.Cluster(planner.H100, 8, 4, inter=planner.IB_NDR)   #: 32 H100s, 4 nodes
EX3_BUDGET = 70 * planner.GiB                                            #: per GPU, leaving 10 GiB of headroom
EX3_SEQ = 4096
_KEYS = ("strategy", "batch", "checkpointing", "replicate", "memory_bytes")


def reference_plan_70b(cluster=EX3_CLUSTER, budget=EX3_BUDGET) -> dict:
    """FSDP over every GPU, full checkpointing, the largest batch that fits."""
    best = None
    for b in range(1, 65):
        p = planner.plan(planner.LLAMA3_70B, cluster, "fsdp", b, seq_len=EX3_SEQ, checkpointing="full")
        if p.total > budget:
            break
        best = {"strategy": "fsdp", "batch": b, "checkpointing": "full", "replicate": 1, "memory_bytes": p.total}
    return best


def _largest_batch(strategy, checkpointing, replicate, cluster, budget, limit=64):
    """The largest batch (1..limit) whose plan fits ``budget`` with these choices, or 0."""
    best = 0
    for b in range(1, limit + 1):
        try:
            p = planner.plan(planner.LLAMA3_70B, cluster, strategy, b, seq_len=EX3_SEQ, checkpointing=checkpointing,
                             replicate=replicate)
        except ValueError:
            return best
        if p.total > budget:
            break
        best = b
    return best


def _cluster_from(plain_cluster) -> "planner.Cluster":
    """A :class:`~course_lib.maths.planner.Cluster` from its plain form (``dataclasses.asdict``); None: the lab's."""
    if plain_cluster is None:
        return EX3_CLUSTER
    d = dict(plain_cluster)
    return planner.Cluster(planner.GPU(**d["gpu"]), d["gpus_per_node"], d["nodes"], planner.Link(**d["intra"]),
                           planner.Link(**d["inter"]))


def run_plan_70b(answer) -> dict:
    """Run half: the learner's plan (the dict, or what the function returns), as plain data."""
    return {"answer": _plain.plain(answer() if callable(answer) else answer)}


def judge_plan_70b(data, cluster=None, budget: float = EX3_BUDGET) -> str:
    """Judge half: the planner prices the plan; it must fit, be the largest batch that fits (the judge searches it
    itself) and carry an estimate within 10%. ``cluster``: a :class:`~course_lib.maths.planner.Cluster` in plain
    form (None: :data:`EX3_CLUSTER`, the lab's)."""
    cluster = _cluster_from(cluster)
    a = data.get("answer") if isinstance(data, dict) else data
    if not isinstance(a, dict) or set(a) != set(_KEYS):
        raise AssertionError(f"return a dict with exactly the keys {_KEYS}, got {a!r}")
    try:
        p = planner.plan(planner.LLAMA3_70B, cluster, a["strategy"], a["batch"], seq_len=EX3_SEQ,
                         checkpointing=a["checkpointing"], replicate=a["replicate"])
    except ValueError as exc:
        raise AssertionError(f"the planner refuses this plan: {exc}") from None
    g = lambda b: f"{b / planner.GiB:.1f} GiB"  # noqa: E731
    if p.total > budget:
        why = (f"{a['strategy']} keeps {g(p.state)} of model state per GPU alone" if p.state > budget else
               f"activations take {g(p.activations)} at batch {a['batch']}"
               + (" without checkpointing" if a["checkpointing"] == "none" else ""))
        raise AssertionError(f"does not fit: {g(p.total)} per GPU (state {g(p.state)}, buffers {g(p.buffers)}, "
                             f"activations {g(p.activations)}) > budget {g(budget)} → {why}")
    best = reference_plan_70b(cluster, budget)["batch"]
    if a["batch"] < best:
        b = a["batch"]
        mine = _largest_batch(a["strategy"], a["checkpointing"], a["replicate"], cluster, budget)
        q = planner.plan(planner.LLAMA3_70B, cluster, a["strategy"], max(mine, b + 1), seq_len=EX3_SEQ,
                         checkpointing=a["checkpointing"], replicate=a["replicate"])
        gib = budget / planner.GiB
        decimal = _largest_batch(a["strategy"], a["checkpointing"], a["replicate"], cluster, gib * 1e9)
        raise AssertionError(
            f"batch {b} fits ({g(p.total)}), but it is not the largest batch that fits → "
            + (f"batch {q.batch} fits too with your choices ({g(q.total)} of {g(budget)})" if mine > b else
               f"with {a['strategy']} and checkpointing {a['checkpointing']} no larger batch fits, but another "
               "choice fits a larger one: which strategy keeps the least state per GPU, which checkpointing "
               "the fewest activations?")
            + (f"; the budget is {gib:g} GiB = {budget / 1e9:.1f} GB (a GiB is 2³⁰ bytes, not 10⁹)"
               if decimal == b and mine > b else ""))
    est = a["memory_bytes"]
    if not isinstance(est, (int, float)) or est <= 0:
        raise AssertionError(f"memory_bytes={est!r}: give your estimate of one GPU's memory in bytes")
    if abs(est - p.total) > 0.1 * p.total:
        if abs(est - (p.state + p.buffers)) <= 0.1 * p.total or abs(est - p.state) <= 0.1 * p.state:
            raise AssertionError(f"your estimate {g(est)} ignores activations: the planner says {g(p.total)}, of "
                                 f"which {g(p.activations)} are activations (and logits) at batch {a['batch']}")
        raise AssertionError(f"your estimate {g(est)} is off: the planner says {g(p.total)} (state {g(p.state)}, "
                             f"buffers {g(p.buffers)}, activations {g(p.activations)})")
    return (f"{a['strategy']}, batch {a['batch']} x {EX3_SEQ}, checkpointing {a['checkpointing']}: {g(p.total)} of "
            f"{g(budget)}; {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {p.mfu:.0%} (model)")


@exercise("08", 'plan_70b', cell='def plan_70b(', hints=HINTS['plan_70b'], guards=("feasible", "boundary"),
          mistakes={'does not fit': 'does not fit', 'estimate ignores activations': 'ignores activations',
                    'estimate off': 'is off', 'not the largest batch': 'not the largest batch that fits',
                    'planner refuses': 'the planner refuses', 'not a dict': 'exactly the keys'},
          judge=judge_plan_70b, references=("course_lib.checks.lab08.reference_plan_70b",))
def check_plan_70b(answer, name: str = "plan_70b", cluster=EX3_CLUSTER, budget=EX3_BUDGET) -> bool:
    """``answer`` (a dict, or a function returning one): strategy, batch, checkpointing, replicate and your own
    estimate ``memory_bytes`` of one GPU's memory. It must fit ``budget`` and the estimate must be right."""
    answer = _guard(answer, "08", "plan_70b") if callable(answer) else answer
    params = {"budget": budget, "cluster": None if cluster == EX3_CLUSTER else dataclasses.asdict(cluster)}
    return decide(name, lab="08", tests="the planner prices your plan (activations included) within the memory budget "
                  "(in GiB), the batch is the largest that fits, and your own estimate of one GPU's memory is within "
                  "10% of the planner's", run=lambda: run_plan_70b(answer), judge=judge_plan_70b, params=params)


# -- exercise 4: price a change (selective -> full activation checkpointing) -----------------------------
__all__ += ["EX4_CASES", "reference_full_ac_cost", "check_full_ac_cost", "judge_full_ac_cost"]
HINTS["full_ac_cost"] = [
    "Price both configurations with the planner and compare what a user gets out of them: tokens per second.",
    "Plan the same model, cluster, batch and sequence length twice with FSDP, once with selective and once "
    "with full checkpointing, and read each plan's tokens per second per GPU.",
    "The cost is one minus the ratio of the two throughputs, full over selective: a fraction between 0 and 1."]
EX4_CASES = (
    (planner.LLAMA3_8B, planner.Cluster(planner.H100_TT500W, 8, 1), 2, 8192),
    (planner.LLAMA3_8B, planner.Cluster(planner.A100_80GB, 8, 8, planner.NVLINK_A100, planner.IB_HDR), 1, 8192),
    (planner.LLAMA3_70B, planner.Cluster(planner.H100, 8, 8), 1, 4096),
)


def _ex4_plans(model, cluster, batch, seq_len):
    return {a: planner.plan(model, cluster, "fsdp", batch, seq_len=seq_len, checkpointing=a) for a in planner.CHECKPOINTING}


def reference_full_ac_cost(model, cluster, batch, seq_len) -> float:
    """Fraction of tokens/s lost going from selective to full checkpointing (FSDP, the planner's prices)."""
    p = _ex4_plans(model, cluster, batch, seq_len)
    return 1 - p["full"].tokens_per_s_per_gpu / p["selective"].tokens_per_s_per_gpu


def _ex4_mistakes(model, cluster, batch, seq_len) -> dict:   # likely wrong answers, by diagnosis
    p = _ex4_plans(model, cluster, batch, seq_len)
    sel, full, none = (p[k].tokens_per_s_per_gpu for k in ("selective", "full", "none"))
    return {"that is the fraction of throughput KEPT (full / selective); the question asks what is lost": full / sel,
            "that is a percentage; return a fraction between 0 and 1": 100 * (1 - full / sel),
            "the sign is flipped: full checkpointing recomputes more, so it is slower, not faster": full / sel - 1,
            "you compared with no checkpointing at all; the change to price starts from selective": 1 - full / none,
            "you compared HFU: it counts the recomputed work as useful, so full checkpointing looks *better*; price "
            "what the user gets, tokens/s (or MFU)": 1 - p["full"].hfu / p["selective"].hfu,
            "you compared step times: full / selective - 1 is the extra time per step, not the throughput lost "
            "(1 - selective / full)": p["full"].step_s / p["selective"].step_s - 1}


def run_full_ac_cost(fn) -> dict:
    """Run half: the learner's fraction for each case of :data:`EX4_CASES` (no expected value here)."""
    return {"got": [_number(fn(model, cluster, batch, seq)) for model, cluster, batch, seq in EX4_CASES]}


def judge_full_ac_cost(data) -> str:
    """Judge half: each fraction against the planner's two plans, with the likely slip named."""
    got_all = _gots(data, len(EX4_CASES), "full_ac_cost")
    rows, gots = [], []
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6)  # noqa: E731
    for (model, cluster, batch, seq), record in zip(EX4_CASES, got_all):
        got = _as_number(record)
        where = f"{model.name} on {cluster.world} x {cluster.gpu.name}, batch {batch} x {seq}"
        if got is None or not math.isfinite(got):
            raise AssertionError(f"{where}: returned {_shown(record)}; return a float, the fraction of tokens/s lost")
        gots.append(got)
    for (model, cluster, batch, seq), got in zip(EX4_CASES, gots):
        want = reference_full_ac_cost(model, cluster, batch, seq)
        where = f"{model.name} on {cluster.world} x {cluster.gpu.name}, batch {batch} x {seq}"
        if not close(got, want):
            why = next((w for w, v in _ex4_mistakes(model, cluster, batch, seq).items() if close(got, v)), None)
            why = why or _ignored_argument(reference_full_ac_cost, EX4_CASES, gots,
                                           ("model", "cluster", "batch", "seq_len"), close)
            why = why or ("compare plan(..., checkpointing='full') with 'selective', same model, cluster, batch "
                          "and seq_len, strategy 'fsdp'")
            raise AssertionError(f"{where}: got {got:.4g}, the planner says {want:.4g} → {why}")
        rows.append(f"{model.name} {cluster.world} GPUs: {want:.1%} lost")     # a loss, positive as defined
    return "; ".join(rows)


@exercise("08", "full_ac_cost", cell="def full_ac_cost(", hints=HINTS["full_ac_cost"], guards=("argument",),
          mistakes={"argument ignored": "ignores its argument", "not a float": "return a float", "the fraction kept": "the fraction of throughput KEPT", "a percentage": "that is a percentage",
                    "sign flipped": "the sign is flipped", "compared with no checkpointing": "compared with no checkpointing",
                    "compared HFU": "you compared HFU", "compared step times": "you compared step times"},
          judge=judge_full_ac_cost, references=("course_lib.checks.lab08.reference_full_ac_cost",))
def check_full_ac_cost(fn, name: str = "full_ac_cost") -> bool:
    """``fn(model, cluster, batch, seq_len)``: the fraction of tokens/s lost going from selective to full activation
    checkpointing under FSDP, as the planner prices both, on :data:`EX4_CASES` (model, cluster, batch, seq_len)."""
    fn = _guard(fn, "08", "full_ac_cost")
    return decide(name, lab="08", tests="three model x cluster cases: the fraction of tokens/s that full checkpointing "
                  "costs compared with selective, and each likely slip named",
                  run=lambda: run_full_ac_cost(fn), judge=judge_full_ac_cost)
