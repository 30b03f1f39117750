"""Lab 10's exercise checks (pipeline, context and expert parallel): the 1F1B order of one stage, the bubble
fraction, the ring-attention merge and the all-to-all dispatch counts. Each has a run half (the learner's function
on the check's inputs, its values as plain data) and a judge half that rebuilds the inputs and computes the
expected values itself: the schedule from :mod:`course_lib.strategies.pp.schedule` and its simulated timeline, full
attention over all the keys, the dispatch matrix from :mod:`course_lib.strategies.ep.routing`.

Longer than ~300 lines: four exercises, each with its cases and the diagnoses of its classic mistakes (and the run
halves that keep the types a later cell relies on, and stop an endless 1F1B loop).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from course_lib.checks import plain as _plain
from course_lib.checks.judge import LINE_BUDGET, Endless, bounded, decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.strategies.cp.torch import block_attention, merge as _merge
from course_lib.strategies.ep import routing
from course_lib.strategies.pp import schedule

__all__ = ["check_one_f_one_b", "check_bubble_fraction", "check_ring_merge", "check_dispatch_counts",
           "judge_one_f_one_b", "judge_bubble_fraction", "judge_ring_merge", "judge_dispatch_counts",
           "reference_one_f_one_b", "reference_bubble_fraction", "reference_ring_merge", "reference_dispatch_counts",
           "MERGE_CASES", "DISPATCH_CASES", "HINTS"]

HINTS = {
    "one_f_one_b": [
        "1F1B keeps each stage busy with as few micro-batches in flight as the pipeline needs: fill the pipe, then "
        "alternate one forward and one backward, then drain.",
        "Stage s must run forwards until the first backward can reach it from the last stage: the later the stage, "
        "the fewer warm-up forwards (the last stage needs none). With few micro-batches the warm-up cannot exceed m.",
        "After the warm-up, each step is the next forward then the oldest backward still owed; when the forwards "
        "run out, the remaining backwards follow in micro-batch order. Count the ops: every F and every B once.",
    ],
    "bubble_fraction": [
        "Draw the GPipe or 1F1B timeline for p stages and m micro-batches: how long is the step, and how much of "
        "it does one stage spend computing?",
        "With a forward taking f and a backward b, the step lasts as long as m micro-batches plus the time the "
        "pipe takes to fill and to drain; each stage computes for m(f + b) of it.",
        "The fraction asked is idle time over the whole step (not over the useful time), and f and b cancel.",
    ],
    "ring_merge": [
        "Softmax over all keys = a weighted mix of the softmaxes over each block. The two weights are each block's "
        "share of the total exp-sum, so they are positive and sum to 1; lse is the log of an exp-sum.",
        "Never take exp of an lse on its own: with scores near 100 it is inf in float32 (near 1000, in float64 too), "
        "and inf/inf is nan. Write everything you need in terms of lse values, so that each exponent you take "
        "stays small (at most 0); the weights are ratios of exp-sums.",
        "log(exp(a) + exp(b)) has a numerically stable primitive in torch: look it up before you write it. lse has "
        "one value per query row and o has D values per row: line the shapes up before you multiply. The check "
        "merges three blocks in a row, so the lse you return must be right too, and in the inputs' dtype.",
    ],
    "dispatch_counts": [
        "Each row is one source rank's send buffer: how many token copies go to each destination rank once "
        "capacity has dropped the overflow.",
        "Capacity is per expert and per source group: an expert accepts at most C of the copies one rank routes to "
        "it. Which copies it keeps is the router's order (GShard: first choices first); how many does not depend on it.",
        "Expert e lives on rank e // (E / p). Row src, column dst: what src sends to dst (the combine all-to-all "
        "sends the transpose back).",
    ],
}


def _unplain(value) -> str | None:
    """The name of a value the run half could not turn into plain data, or None."""
    if isinstance(value, dict) and _plain.UNPLAIN in value:
        return value[_plain.UNPLAIN]
    return None


# == 1. the 1F1B order of one stage ===================================================================================
#: (p, m): enough micro-batches; fewer micro-batches than stages (the warm-up caps at m); one stage; odd sizes
ONE_F_ONE_B_CASES = [(4, 8), (4, 2), (3, 5), (1, 2)]


def reference_one_f_one_b(stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """The library's answer: :func:`course_lib.strategies.pp.schedule.one_f_one_b_order`."""
    return schedule.one_f_one_b_order(stage, p, m)


def run_one_f_one_b(fn) -> dict:
    """Run half: the learner's order for every stage of every case, as plain data; a call that never returns is
    stopped (:func:`course_lib.checks.judge.bounded`) and named."""
    got = []
    for p, m in ONE_F_ONE_B_CASES:
        got.append([])
        for s in range(p):
            try:
                got[-1].append(_plain.plain(bounded(fn, s, p, m)))
            except Endless:
                return {"got": got, "endless": f"stage={s}, p={p}, m={m}"}
    return {"got": got}


def _ops(value) -> list[tuple[str, int]] | None:
    """A plain value as a list of ``(kind, mb)``, or None when it is not one."""
    if not isinstance(value, (list, tuple)):
        return None
    out = []
    for op in value:
        if not (isinstance(op, (list, tuple)) and len(op) == 2 and op[0] in ("F", "B")
                and isinstance(op[1], int) and not isinstance(op[1], bool)):
            return None
        out.append((op[0], op[1]))
    return out


def _with_warmup(w: int, m: int) -> list[tuple[str, int]]:
    w = max(0, min(w, m))
    ops = [("F", i) for i in range(w)]
    for i in range(m - w):
        ops += [("F", w + i), ("B", i)]
    return ops + [("B", i) for i in range(m - w, m)]


def _backward_first(ops: list[tuple[str, int]]) -> tuple[int, int] | None:
    """(position, micro-batch) of the first ``('B', i)`` that comes before its own ``('F', i)``, or None."""
    seen = set()
    for k, (kind, mb) in enumerate(ops):
        if kind == "F":
            seen.add(mb)
        elif mb not in seen:
            return k, mb
    return None


def _around(ops: list, k: int, before: int = 2, after: int = 2) -> str:
    """The learner's ops around position ``k``, labelled with their positions."""
    lo, hi = max(0, k - before), min(len(ops), k + after + 1)
    return (f"your ops {lo}..{hi - 1}: " + ("..., " if lo else "") + ", ".join(map(repr, ops[lo:hi]))
            + (", ..." if hi < len(ops) else ""))


def judge_one_f_one_b(data: dict, name: str = "one_f_one_b") -> str:
    """Judge half: each stage's order against 1F1B's; GPipe's order (right ops, wrong memory), a warm-up off by one,
    ops missing or repeated, a backward before its own forward, and orders that deadlock are named. A mismatch shows
    the learner's own ops around the first difference and the one op 1F1B runs there, never the whole order."""
    if isinstance(data, dict) and data.get("endless"):
        raise AssertionError(f"{name}({data['endless']}) never returned: stopped after {LINE_BUDGET:,} lines, where "
                             "1F1B needs a few dozen: an endless loop (a while whose condition never changes: does "
                             "the counter it tests move?) appends until the memory runs out")
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(ONE_F_ONE_B_CASES):
        raise AssertionError(f"{name} was not run on every case; return a list of ('F', i) / ('B', i) ops")
    every = []                                   # (call, stage, p, m, ops) of every stage that is a list of all ops
    for (p, m), per_stage in zip(ONE_F_ONE_B_CASES, got_all):
        for s, value in enumerate(per_stage):
            call = f"{name}(stage={s}, p={p}, m={m})"
            ops = _ops(value)
            if ops is None:
                shown = _unplain(value) or f"{value!r}"[:80]
                raise AssertionError(f"{call} returned {shown}: not a list of ops; return a list of ('F', i) and "
                                     "('B', i) tuples (i: the micro-batch)")
            want = schedule.one_f_one_b_order(s, p, m)
            if sorted(ops) != sorted(want):
                extra = sorted(set(ops) - set(want))
                raise AssertionError(f"{call} is not an order of every ('F', i) and ('B', i), i in 0..{m - 1}, each "
                                     f"once: {len(ops)} ops, expected {len(want)}"
                                     + (f"; ops that do not exist: {extra[:4]}" if extra else
                                        f"; missing or repeated: {sorted(set(want) - set(ops))[:4] or 'a repeat'}"))
            every.append((call, s, p, m, ops))
    for call, s, p, m, ops in every:             # impossible on any stage: named before any other difference
        bad = _backward_first(ops)
        if bad is not None:
            k, mb = bad
            raise AssertionError(f"{call}: ('B', {mb}) at op {k} comes before its own forward ('F', {mb}): a backward "
                                 "before its own forward is impossible (it needs that forward's activations); in the "
                                 f"steady state each step is a forward, then a backward; {_around(ops, k)}")
    by_case: dict[tuple[int, int], list] = {}
    for call, s, p, m, ops in every:
        want = schedule.one_f_one_b_order(s, p, m)
        if ops != want:
            held, peak = schedule.peak_activations(ops), schedule.peak_activations(want)
            if ops == schedule.gpipe_order(s, p, m) and held > peak:
                raise AssertionError(f"{call}: that is GPipe's order (every forward, then every backward): the "
                                     f"same bubble, but stage {s} holds the activations of {held} micro-batches "
                                     f"at once, where 1F1B holds {peak} (at most p - stage)")
            w = p - s - 1
            for dw in (1, -1):
                if w + dw >= 0 and _with_warmup(w + dw, m) == ops and _with_warmup(w + dw, m) != want:
                    raise AssertionError(f"{call}: warm-up off by one: a warm-up of {min(w + dw, m)} forwards "
                                         f"before the first forward-backward step, expected {min(w, m)} "
                                         "(p - stage - 1, at most m)")
            first = next(k for k, (a, b) in enumerate(zip(ops, want)) if a != b)
            raise AssertionError(f"{call} differs from 1F1B at op {first}: you run {ops[first]} there, 1F1B runs "
                                 f"{want[first]}; {_around(ops, first)}")
        by_case.setdefault((p, m), []).append(ops)
    for orders in by_case.values():
        schedule.simulate(orders)          # the reference's orders never deadlock: a safety net for the judge itself
    p, m = ONE_F_ONE_B_CASES[0]
    return (f"1F1B on {len(ONE_F_ONE_B_CASES)} pipelines (incl. m < p and p = 1); at p={p}, m={m} the stages hold "
            f"{[schedule.peak_activations(schedule.one_f_one_b_order(s, p, m)) for s in range(p)]} micro-batches' "
            f"activations, GPipe {m} each")


@exercise("10", "one_f_one_b", cell="def one_f_one_b(", hints=HINTS["one_f_one_b"], guards=("cost", "boundary"),
          mistakes={"GPipe order": "that is GPipe's order", "warm-up off by one": "warm-up off by one",
                    "backward before forward": "before its own forward is impossible",
                    "endless loop": "never returned",
                    "not every op once": "is not an order of every", "not a list of ops": "not a list of ops",
                    "wrong order": "differs from 1F1B"},
          judge=judge_one_f_one_b, references=("course_lib.strategies.pp.schedule.one_f_one_b_order",))
def check_one_f_one_b(fn, name: str = "one_f_one_b") -> bool:
    """Exercise check: ``fn(stage, p, m)`` is stage ``stage``'s 1F1B order of ops."""
    fn = _guard(fn, "10", "one_f_one_b")
    return decide(name, lab="10", tests="every stage's order for p, m = 4, 8 / 4, 2 / 3, 5 / 1, 2 against 1F1B's, "
                  "and the activations each order holds", run=lambda: run_one_f_one_b(fn), judge=judge_one_f_one_b,
                  params={"name": name})


# == 2. the bubble fraction ===========================================================================================
BUBBLE_CASES = [(4, 8), (4, 1), (1, 5), (8, 32), (2, 3)]


def reference_bubble_fraction(p: int, m: int) -> float:
    """The library's answer: :func:`course_lib.strategies.pp.schedule.bubble_fraction`."""
    return schedule.bubble_fraction(p, m)


def run_bubble_fraction(fn) -> dict:
    """Run half: each value with its type's name (a tensor or NumPy scalar is named, not taken for a number)."""
    return {"got": [_plain.typed(fn(p, m), frameworks=("torch.", "jax", "numpy.")) for p, m in BUBBLE_CASES]}


def _number(sent):
    """Judge half: the Python number a :func:`run_bubble_fraction` value holds (an int or float, a subclass read as
    the number it holds), or None."""
    got = sent.get("values") if isinstance(sent, dict) else None
    if isinstance(sent, dict) and sent.get("type") == "numpy.float64" and isinstance(got, np.ndarray):
        return float(got)                          # a subclass of Python's float: the same number, the same prints
    return None if isinstance(got, bool) or not isinstance(got, (int, float)) or sent.get("dtype") else got


def _measured_bubble(p: int, m: int) -> float:
    """Judge side: the idle fraction of a simulated 1F1B step (forward 1 unit, backward 2), the same for every
    stage."""
    idle, span = schedule.idle_units(schedule.simulate(schedule.orders("1f1b", p, m)), p)
    return idle[0] / span


def judge_bubble_fraction(data: dict, name: str = "bubble_fraction") -> str:
    """Judge half: each value against the idle fraction of a simulated timeline, the usual slips named."""
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(BUBBLE_CASES):
        raise AssertionError(f"{name} was not run on every case; return a fraction for each")
    numbers = [_number(sent) for sent in got_all]
    for (p, m), sent, got in zip(BUBBLE_CASES, got_all, numbers):
        exp = _measured_bubble(p, m)
        if got is None:
            kind = sent.get("type") if isinstance(sent, dict) else type(sent).__name__
            value = sent.get("values") if isinstance(sent, dict) else sent
            shown = (f"a {kind} holding {np.asarray(value).ravel()[:3].tolist()}" if isinstance(value, np.ndarray)
                     else f"a {kind}" if _unplain(value) else f"{value!r}"[:60] + f" (a {kind})")
            raise AssertionError(f"{name}(p={p}, m={m}) returned {shown}: not a Python number; return a Python "
                                 "float between 0 and 1, the idle fraction (float(x) converts a tensor or a NumPy "
                                 "scalar)")
        if math.isclose(got, exp, rel_tol=1e-9, abs_tol=1e-12):
            continue
        msg = f"{name}(p={p}, m={m}) = {got!r}, expected {exp:.6g} (the idle share of the simulated step)"
        same_m = [g for (pp, mm), g in zip(BUBBLE_CASES, numbers) if pp == p and mm != m]
        if type(got) is int and not float(exp).is_integer():
            msg += (f"\n   likely mistake: integer division: the answer is the int {got}; // (or int()) rounds the "
                    "fraction down to a whole number, and the bubble lies between 0 and 1")
        elif m > 0 and math.isclose(got, (p - 1) / m, rel_tol=1e-9):
            msg += ("\n   likely mistake: (p-1)/m is the bubble relative to the useful time (Megatron-LM's ratio); "
                    "the question asks its share of the whole step, which also holds the bubble")
        elif math.isclose(got, p / (m + p), rel_tol=1e-9):
            msg += "\n   likely mistake: p/(m+p) counts one stage too many: filling the pipe takes p-1 slots, not p"
        elif math.isclose(got, m / (m + p - 1), rel_tol=1e-9):
            msg += "\n   likely mistake: that is the busy share of the step; the bubble is the idle share"
        elif math.isclose(got, 100 * exp, rel_tol=1e-9):
            msg += "\n   likely mistake: a percentage; return a fraction between 0 and 1"
        elif same_m and all(isinstance(g, (int, float)) and math.isclose(g, got) for g in same_m) and exp:
            msg += (f"\n   likely mistake: the answer ignores m: it is the same for p={p} at every m, but more "
                    "micro-batches shrink the bubble")
        raise AssertionError(msg)
    return "; ".join(f"p={p}, m={m}: {_measured_bubble(p, m):.4f}" for p, m in BUBBLE_CASES[:2]) + \
        " -- (p-1)/(m+p-1), the idle share of a simulated 1F1B step"


@exercise("10", "bubble_fraction", cell="def bubble_fraction(", hints=HINTS["bubble_fraction"], guards=("argument",),
          mistakes={"relative to useful time": "relative to the useful time", "one stage too many": "one stage too many",
                    "busy share": "busy share", "percentage": "a percentage", "ignores m": "ignores m",
                    "not a number": "not a Python number", "integer division": "integer division"},
          judge=judge_bubble_fraction, references=("course_lib.strategies.pp.schedule.bubble_fraction",))
def check_bubble_fraction(fn, name: str = "bubble_fraction") -> bool:
    """Exercise check: ``fn(p, m)`` is the share of a GPipe / 1F1B step each stage is idle."""
    fn = _guard(fn, "10", "bubble_fraction")
    return decide(name, lab="10", tests="p, m = " + ", ".join(f"{p}, {m}" for p, m in BUBBLE_CASES)
                  + " against the idle share of a simulated 1F1B timeline", run=lambda: run_bubble_fraction(fn),
                  judge=judge_bubble_fraction, params={"name": name})


# == 3. the ring-attention merge ======================================================================================
#: (what, scale of q, block sizes): blocks of keys merged left to right; q scaled up gives scores near 100 (past
#: float32's exp, ~88) and up to ~1300 (past float64's, ~709: computing in float64 does not save exp of an lse)
MERGE_CASES = [("two blocks", 1.0, (5, 7)), ("large scores (lse near 100)", 60.0, (4, 4)),
               ("three blocks in a row", 1.0, (3, 6, 2)), ("huge scores (lse up to ~1300)", 400.0, (4, 4))]


def _merge_inputs(k: int):
    """q (2, 3, 5, 4) and the keys/values of case ``k``, cut into its blocks."""
    _, scale, sizes = MERGE_CASES[k]
    g = torch.Generator().manual_seed(10 + k)
    q = torch.randn(2, 3, 5, 4, generator=g) * scale
    keys = torch.randn(2, 3, sum(sizes), 4, generator=g)
    vals = torch.randn(2, 3, sum(sizes), 4, generator=g)
    return q, keys, vals, list(keys.split(sizes, dim=2)), list(vals.split(sizes, dim=2))


def reference_ring_merge(o_a, lse_a, o_b, lse_b):
    """The library's answer: :func:`course_lib.strategies.cp.torch.merge`."""
    return _merge(o_a, lse_a, o_b, lse_b)


def _typed_pair(out):
    """Run half: a returned pair as two :func:`plain.typed` values (each keeps its type and dtype), anything else
    as plain data."""
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return tuple(_plain.typed(a) for a in out)
    return _plain.plain(out)


def run_ring_merge(fn) -> dict:
    """Run half: the learner's merge folded over each case's blocks; the last (o, lse), typed, as plain data."""
    got = []
    for k in range(len(MERGE_CASES)):
        q, _, _, ks, vs = _merge_inputs(k)
        o, lse = block_attention(q, ks[0], vs[0])
        out = None
        for kb, vb in zip(ks[1:], vs[1:]):
            out = fn(o, lse, *block_attention(q, kb, vb))
            if not (isinstance(out, (tuple, list)) and len(out) == 2
                    and all(isinstance(a, torch.Tensor) for a in out)):
                break                          # the judge names what came back; the next merge would only crash
            o, lse = out
        got.append(_typed_pair(out))
    return {"got": got}


def judge_ring_merge(data: dict, name: str = "ring_merge") -> str:
    """Judge half: the merged (o, lse) against attention over all the keys at once; a plain average, weights
    without the rescale, a missing denominator and a wrong lse are named."""
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(MERGE_CASES):
        raise AssertionError(f"{name} was not run on every case; return (o, lse)")
    for k, ((what, _, sizes), got) in enumerate(zip(MERGE_CASES, got_all)):
        q, keys, vals, ks, vs = _merge_inputs(k)
        exp_o, exp_lse = (t.numpy() for t in block_attention(q, keys, vals))
        if not (isinstance(got, (tuple, list)) and len(got) == 2
                and all(isinstance(a, dict) and isinstance(a.get("values"), np.ndarray) for a in got)):
            shown = _unplain(got) or (
                f"({', '.join(str(a.get('type')) if isinstance(a, dict) else '?' for a in got)})"
                if isinstance(got, (list, tuple)) and len(got) == 2 else
                f"a {type(got).__name__} of {len(got)}" if isinstance(got, (list, tuple)) else repr(got)[:60])
            raise AssertionError(f"{name} ({what}) returned {shown}: not a pair; return (o, lse), two tensors")
        (o, lse), kinds = (a["values"] for a in got), [(a["type"], a["dtype"]) for a in got]
        if any(kind != "torch.Tensor" for kind, _ in kinds):
            raise AssertionError(f"{name} ({what}) returned ({kinds[0][0]}, {kinds[1][0]}): return torch tensors, "
                                 "as the inputs are: the next merge and later cells use your output with torch "
                                 "operations")
        if o.shape != exp_o.shape or lse.shape != exp_lse.shape:
            raise AssertionError(f"{name} ({what}): o {tuple(o.shape)} and lse {tuple(lse.shape)}, expected "
                                 f"{tuple(exp_o.shape)} and {tuple(exp_lse.shape)}: line lse's one value per row up "
                                 "with o's D values per row")
        o_ok = np.allclose(o, exp_o, rtol=1e-4, atol=1e-5)
        lse_ok = np.allclose(lse, exp_lse, rtol=1e-5, atol=1e-4)
        if o_ok and lse_ok:
            if any(dtype != "float32" for _, dtype in kinds):
                raise AssertionError(f"{name} ({what}) returned o in {kinds[0][1]} and lse in {kinds[1][1]}: the "
                                     "right numbers, but return the inputs' dtype, float32; later cells mix your "
                                     "output with float32 tensors")
            continue
        msg = f"{name} ({what}, blocks of {list(sizes)} keys): " + ("o" if not o_ok else "lse") + \
            " differs from attention over all the keys at once"
        (oa, la), (ob, lb) = block_attention(q, ks[0], vs[0]), block_attention(q, ks[1], vs[1])
        if not np.all(np.isfinite(o)) or not np.all(np.isfinite(lse)):
            msg += ("\n   likely mistake: overflow: exp of an lse on its own is inf once lse passes ~88 in float32 "
                    "(~709 in float64, so a cast does not save it), and inf/inf = nan; take exp only of quantities "
                    "that cannot be large, never of an lse alone")
        elif len(sizes) == 2 and np.allclose(o, ((oa + ob) / 2).numpy(), rtol=1e-4, atol=1e-5):
            msg += ("\n   likely mistake: a plain average weights both blocks equally; each block counts by its "
                    "share of the merged exp-sum, and the block with the larger lse counts more")
        elif len(sizes) == 2 and np.allclose(o, (la.exp()[..., None] * oa + lb.exp()[..., None] * ob).numpy(),
                                             rtol=1e-4, atol=1e-5):
            msg += ("\n   likely mistake: the weights do not sum to 1: divide by the merged exp-sum "
                    "(the denominator), exp(lse_merged)")
        elif len(sizes) == 2 and np.allclose(
                o, (torch.exp(lb - torch.logaddexp(la, lb))[..., None] * oa
                    + torch.exp(la - torch.logaddexp(la, lb))[..., None] * ob).numpy(), rtol=1e-4, atol=1e-5):
            msg += ("\n   likely mistake: the weights are swapped: o_a must be weighted by block a's own share of "
                    "the exp-sum, o_b by b's")
        elif o_ok and not lse_ok:
            msg += ("\n   likely mistake: the merged lse is wrong: it must be the log of both blocks' exp-sums "
                    "together, not the max or the sum of the two lse; the next merge reads it")
        elif len(sizes) > 2 and not o_ok:
            msg += ("\n   likely mistake: two blocks merge right but the third does not: the merged lse you return "
                    "is what the next merge reads: the log of both blocks' exp-sums together")
        raise AssertionError(msg)
    return (f"{len(MERGE_CASES)} cases (two blocks, scores near 100, three blocks in a row, scores near 1000) equal "
            "full attention, in float32")


@exercise("10", "ring_merge", cell="def ring_merge(", hints=HINTS["ring_merge"],
          mistakes={"overflow": "overflow", "plain average": "plain average", "no denominator": "do not sum to 1",
                    "lse wrong": "the merged lse is wrong", "third block": "the third does not",
                    "shapes": "line lse's one value per row up", "not a pair": "not a pair",
                    "swapped weights": "the weights are swapped", "float64": "return the inputs' dtype, float32",
                    "not tensors": "return torch tensors, as the inputs"},
          judge=judge_ring_merge, references=("course_lib.strategies.cp.torch.merge",))
def check_ring_merge(fn, name: str = "ring_merge") -> bool:
    """Exercise check: ``fn(o_a, lse_a, o_b, lse_b)`` returns the (o, lse) of attention over both blocks' keys."""
    fn = _guard(fn, "10", "ring_merge")
    return decide(name, lab="10", tests="two blocks, scores near 100, three blocks merged in a row, scores near "
                  "1000, each against attention over all the keys at once, in float32", run=lambda: run_ring_merge(fn),
                  judge=judge_ring_merge, params={"name": name})


# == 4. the all-to-all dispatch counts ================================================================================
#: (what, world, n_experts, top_k, tokens per rank, capacity, seed)
DISPATCH_CASES = [("4 ranks, 8 experts, top-2", 4, 8, 2, 24, 6, 0),
                  ("2 ranks, 6 experts, top-1, skewed router", 2, 6, 1, 9, 2, 1),
                  ("3 ranks, 3 experts, top-2, where first choices fill an expert", 3, 3, 2, 5, 3, 2)]


def dispatch_inputs(k: int) -> list[torch.Tensor]:
    """Case ``k``'s expert ids per source rank, each (tokens, top_k), from a seeded router (skewed in case 1)."""
    _, world, E, top, T, _, seed = DISPATCH_CASES[k]
    g = torch.Generator().manual_seed(100 + seed)
    bias = torch.linspace(2.0, 0.0, E) if k == 1 else torch.zeros(E)
    return [routing.top_k(torch.randn(T, E, generator=g) + bias, top)[0] for _ in range(world)]


def reference_dispatch_counts(ids_per_rank, n_experts: int, cap: int) -> list[list[int]]:
    """The library's answer: :func:`course_lib.strategies.ep.routing.dispatch_matrix`."""
    return routing.dispatch_matrix(list(ids_per_rank), n_experts, len(ids_per_rank), cap)


_SHOWN_TYPES = 64     # the run half names the types of at most this many rows and entries


def _items(value) -> list:
    """Run half: a list's or tuple's items by its real type's iterator (a subclass's own methods are not called)."""
    items = list.__iter__(value) if _plain._is(value, list) else tuple.__iter__(value)
    return [x for _, x in zip(range(_SHOWN_TYPES), items)]


def _typed_matrix(value) -> dict:
    """Run half: a returned matrix as plain data with the names of its own, its rows' and its entries' types (a
    tensor or an array of counts is not a list of ints, though its numbers are)."""
    sent = {"type": _plain.type_name(value), "values": _plain.plain(value)}
    if _plain._is(value, (list, tuple)):
        rows = _items(value)
        sent["row_types"] = sorted({_plain.type_name(r) for r in rows})
        sent["entry_types"] = sorted({_plain.type_name(x) for r in rows if _plain._is(r, (list, tuple))
                                      for x in _items(r)})
    return sent


def run_dispatch_counts(fn) -> dict:
    return {"got": [_typed_matrix(fn([t.clone() for t in dispatch_inputs(k)], case[2], case[5]))
                    for k, case in enumerate(DISPATCH_CASES)]}


def _square(values, world: int) -> bool:
    """Judge half: ``values`` holds world x world numbers, whatever their types (list rows, arrays, scalars)."""
    if isinstance(values, np.ndarray):
        return values.shape == (world, world) and values.dtype.kind in "biuf"
    return (isinstance(values, (list, tuple)) and len(values) == world
            and all((isinstance(r, np.ndarray) and r.shape == (world,) and r.dtype.kind in "biuf")
                    or (isinstance(r, (list, tuple)) and len(r) == world
                        and all(isinstance(x, (int, float)) or (isinstance(x, np.ndarray) and x.shape == ()
                                                                 and x.dtype.kind in "biuf") for x in r))
                    for r in values))


def _matrix(values, world: int) -> list[list[int]] | None:
    """Judge half: ``values`` as rows of ints when it is a list or tuple of ``world`` lists or tuples of ``world``
    plain ints (no bool, no float, no tensor or array), else None."""
    if not (isinstance(values, (list, tuple)) and len(values) == world):
        return None
    if not all(isinstance(r, (list, tuple)) and len(r) == world and all(type(x) is int for x in r) for r in values):
        return None
    return [list(r) for r in values]


def _types_shown(sent: dict) -> str:
    """Judge half: what a matrix of the right size but the wrong types is made of, in the learner's words."""
    kind = sent.get("type")
    if kind not in ("list", "tuple"):
        return f"a {kind}"
    rows = [t for t in sent.get("row_types", []) if t not in ("list", "tuple")]
    if rows:
        return f"a {kind} of {' / '.join(map(str, rows))} rows"
    return f"a {kind} of rows holding {' / '.join(t for t in sent.get('entry_types', []) if t != 'int')} entries"


def _variant(ids_per_rank, E: int, cap: int, *, drop: bool = True, slack: int = 0,
             round_robin: bool = False) -> list[list[int]]:
    """Judge side: the dispatch matrix computed the wrong ways the diagnoses name."""
    world = len(ids_per_rank)
    per = E // world
    out = []
    for ids in ids_per_rank:
        pos = routing.positions(ids, E)
        keep = pos < cap + slack if drop else torch.ones_like(ids, dtype=torch.bool)
        dst = ids[keep] % world if round_robin else ids[keep] // per
        out.append(torch.bincount(dst, minlength=world).tolist())
    return out


def judge_dispatch_counts(data: dict, name: str = "dispatch_counts") -> str:
    """Judge half: each matrix against :func:`routing.dispatch_matrix`; the dropped copies counted, the matrix
    transposed, capacity off by one and experts dealt round-robin are named."""
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(DISPATCH_CASES):
        raise AssertionError(f"{name} was not run on every case; return a matrix of counts")
    for k, ((what, world, E, _, _, cap, _), sent) in enumerate(zip(DISPATCH_CASES, got_all)):
        ids = dispatch_inputs(k)
        exp = routing.dispatch_matrix(ids, E, world, cap)
        got = sent.get("values") if isinstance(sent, dict) else sent
        rows = _matrix(got, world)
        if rows is None and _square(got, world):
            raise AssertionError(f"{name} ({what}) returned {_types_shown(sent)}: return plain Python ints, a list "
                                 "of rows of int (int(x) or .tolist() converts a tensor or an array); later cells "
                                 "compare and print your counts as ints")
        if rows is None:
            shown = _unplain(got) or repr(got)[:80]
            raise AssertionError(f"{name} ({what}) returned {shown}: not a {world}x{world} matrix of counts; return "
                                 "a list of rows, row src = what rank src sends to each rank")
        if rows == exp:
            continue
        src, dst = next((i, j) for i in range(world) for j in range(world) if rows[i][j] != exp[i][j])
        msg = (f"{name} ({what}, capacity {cap}): row {src} (what rank {src} sends) is {rows[src]}; at column {dst} "
               f"you count {rows[src][dst]} copies, {exp[src][dst]} reach rank {dst}")
        if rows == [list(c) for c in zip(*exp)]:
            msg += "\n   likely mistake: transposed: row = source rank, column = destination rank"
        elif rows == _variant(ids, E, cap, drop=False):
            msg += ("\n   likely mistake: that counts dropped copies: an expert accepts at most C copies per group; "
                    "the rest never leave their rank")
        elif rows == _variant(ids, E, cap, slack=1):
            msg += "\n   likely mistake: capacity off by one: an expert takes exactly C copies, no more"
        elif rows == _variant(ids, E, cap, slack=-1):
            msg += "\n   likely mistake: capacity off by one: an expert takes exactly C copies, not C - 1"
        elif rows == _variant(ids, E, cap, round_robin=True):
            msg += ("\n   likely mistake: experts dealt round-robin; rank r holds the contiguous experts "
                    "r·E/p .. (r+1)·E/p - 1")
        raise AssertionError(msg)
    return f"{len(DISPATCH_CASES)} routings: each row what a rank sends, at most C copies per expert and group"


@exercise("10", "dispatch_counts", cell="def dispatch_counts(", hints=HINTS["dispatch_counts"],
          guards=("boundary", "argument"),
          mistakes={"transposed": "transposed", "dropped counted": "counts dropped copies",
                    "capacity off by one": "capacity off by one",
                    "round-robin experts": "round-robin", "not a matrix": "matrix of counts",
                    "not plain ints": "return plain Python ints"},
          judge=judge_dispatch_counts, references=("course_lib.strategies.ep.routing.dispatch_matrix",))
def check_dispatch_counts(fn, name: str = "dispatch_counts") -> bool:
    """Exercise check: ``fn(ids_per_rank, n_experts, capacity)`` is the dispatch all-to-all's count matrix."""
    fn = _guard(fn, "10", "dispatch_counts")
    return decide(name, lab="10", tests="three routings (4, 2 and 3 ranks; top-2 and top-1; a skewed router) against "
                  "the matrix of kept copies each rank sends each rank", run=lambda: run_dispatch_counts(fn),
                  judge=judge_dispatch_counts, params={"name": name})
