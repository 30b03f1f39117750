"""Lab 09's exercise checks (when it breaks): read a hang from every rank's stack, find the rank that drifted, find
where a NaN was born, and give an optimizer state the sharding that stops XLA resharding it every step.

Each check feeds the learner's function fixed cases built to separate the classic mistakes (the outermost or the
innermost frame read as the collective, a float sum as a checksum, list order as time order, a replicated state)
and names the one it sees. ``HINTS[name]``: the idea, the method, near-code (``checks.hint(name, level)``).

Each check is split in two (:mod:`course_lib.checks.judge`): the *run half* runs the scenario with the learner's
function (on gloo ranks for ``diverged_ranks``) and returns plain facts -- what it returned, the collectives each
rank issued, the specs and the collectives XLA compiled with them; the *judge half* (``judge_*``) rebuilds the cases
and works out the expected answers itself (the hang's collective from the stacks, the drifted rank from every rank's
bits in one process, the first non-finite record, the reference step's collectives). The cases hold no answers; the
``reference_*`` functions are registered as the exercises' references.

Longer than ~300 lines: four exercise checks, each with its fixed cases, its reference, its run half and its judge
half with the diagnoses.
"""
from __future__ import annotations

import math

from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "COLLECTIVES", "C10D", "stack_text", "HANG_CASES", "reference_hang_report", "check_hang_report",
           "judge_hang_report", "drift_net", "drift_case", "DRIFT_CASES", "reference_diverged_ranks",
           "check_diverged_ranks", "judge_diverged_ranks", "nan_records", "NAN_CASES", "reference_first_nonfinite",
           "check_first_nonfinite", "judge_first_nonfinite", "spec_fix_params", "reference_spec_fix", "check_spec_fix",
           "judge_spec_fix"]

HINTS = {
    "hang_report": [
        "A rank that waits in a collective has torch's distributed code at the inner end of its stack; a rank that "
        "is not waiting (it returned, or is computing) ends elsewhere -- an idle rank in the launcher's pipe recv. "
        "The ranks that are *not* waiting in the collective most ranks wait in are the culprits.",
        "Stacks are outermost first. For each rank find the first (outermost) frame whose file is torch's "
        "distributed_c10d.py: its function is the collective (all_gather_object calls all_gather inside: the outer "
        "one is what was called). Count the ops; the most common is the hang's; the others are missing.",
        "frames = re.findall(r'File \"([^\"]+)\", line \\d+, in (\\w+)', text); op = next((fn for f, fn in frames "
        "if f.endswith(lab09.C10D)), None); then Counter(ops.values()).most_common(1) and the ranks whose op differs",
    ],
    "diverged_ranks": [
        "Summarise each parameter in a few exact bytes on every rank, bring every rank's summaries together in one "
        "collective, and compare each rank's with rank 0's.",
        "A float sum misses swapped elements and tiny changes: fingerprint the bits (course_lib.measure.fingerprint). "
        "One all_gather of the vector of fingerprints gives every rank the table (ranks x parameters); the first "
        "parameter (in named_parameters order) where some rank differs from rank 0, and the lowest such rank.",
        "names, fps = fingerprint.fingerprints(model); table = torch.empty(world, len(fps), dtype=torch.int64); "
        "dist.all_gather(list(table), fps); bad = table != table[0]; "
        "first column with bad.any(), then the first row set in it",
    ],
    "first_nonfinite": [
        "Put the records in the order things happened: step first, then the order modules ran in that step's forward; "
        "the first record whose output held a NaN *or an inf* is where it was born.",
        "Sort by (step, call), not by rank or list position: records arrive rank by rank, and by the next step the "
        "NaN has reached every rank through the gradient all-reduce. An overflow to inf comes before the NaN it makes.",
        "bad = [r for r in records if r['nan'] or r['inf']]; first = min(bad, key=lambda r: (r['step'], r['call'], "
        "r['rank'])) if bad else None; return (first['rank'], first['step'], first['module'])",
    ],
    "spec_fix": [
        "An optimizer state is combined element by element with its parameter and its gradient: if it is laid out "
        "differently, XLA must move it every step to make them meet.",
        "Read the ledger above: one extra all-gather per momentum whose parameter is sharded. Which layout would "
        "let XLA update a momentum with the gradient shard it already has on each device, moving nothing? Neither "
        "replicating a momentum nor cutting every one the same way does it: the embedding is cut on its columns.",
        "Each parameter is a jax.Array that carries its own NamedSharding; what you return per name is a "
        "PartitionSpec. Print params[name].sharding for two parameters and compare it with the extra collectives.",
    ],
}

# -- exercise 1: which collective hangs, and who is missing ---------------------------------------------------------
C10D = "torch/distributed/distributed_c10d.py"   #: the file of torch's collective API
#: the c10d functions a rank can be blocked in (the answer names one of these, as the learner's code called it)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all",
               "all_to_all_single", "reduce", "gather", "scatter", "send", "recv")
_SP = "/opt/venv/lib/python3.11/site-packages/"
_WORKER = (_SP + "course_lib/launch/rank.py", 188, "worker_main", "out = fn(*args, **kwargs)")
_IDLE = [(_SP + "course_lib/launch/rank.py", 181, "worker_main", "msg = conn.recv()"),
         ("/usr/lib/python3.11/multiprocessing/connection.py", 430, "_recv", "chunk = read(handle, remaining)")]
_CELL = "/tmp/ipykernel_4242/1739254211.py"


def _c10d(op: str, line: int = 2800) -> list:
    return [(_SP + "torch/distributed/c10d_logger.py", 81, "wrapper", "return func(*args, **kwargs)"),
            (_SP + C10D, line, op, "work.wait()" if op != "all_gather_object" else "")]


def _frames_of(kind: str) -> list:
    """A rank's frames, outermost first, for one of the situations the cases use."""
    user = lambda n, fn, code: (_CELL, n, fn, code)  # noqa: E731
    if kind == "idle":
        return _IDLE
    if kind == "all_reduce":       # the learner's gradient average
        return [_WORKER, user(9, "train_step", "average_gradients(model)"), user(4, "average_gradients",
                                                                               "dist.all_reduce(p.grad)")] + _c10d("all_reduce")
    if kind == "broadcast":        # a rank-0-only decision broadcast from a branch the others skipped
        return [_WORKER, user(12, "train_step", "dist.broadcast(stop, src=0)")] + _c10d("broadcast", 2650)
    if kind == "fsdp_all_gather":  # FSDP2 gathering the next unit, deep inside torch
        return [_WORKER, user(8, "train_step", "loss = model(x).sum()"),
                (_SP + "torch/nn/modules/module.py", 1784, "_call_impl", "args_result = hook(self, args)"),
                (_SP + "torch/distributed/fsdp/_fully_shard/_fsdp_state.py", 243, "_pre_forward",
                 "args, kwargs = self._fsdp_param_group.pre_forward(module, args, kwargs)"),
                (_SP + "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", 337, "unshard",
                 "self._all_gather_result = foreach_all_gather("),
                (_SP + "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 215, "foreach_all_gather",
                 "all_gather_work = all_gather_comm("),
                (_SP + "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", 84, "__call__",
                 "return dist.all_gather_into_tensor(")] + _c10d("all_gather_into_tensor", 3990)
    if kind == "object":           # all_gather_object calls all_gather inside it
        return ([_WORKER, user(6, "check_config", "dist.all_gather_object(seen, cfg)")] + _c10d("all_gather_object", 3180)
                + [(_SP + C10D, 3215, "all_gather", "work.wait()")])
    if kind == "computing":        # a slow rank, still in its forward
        return [_WORKER, user(8, "train_step", "loss = model(x).sum()"),
                (_SP + "torch/nn/modules/module.py", 1784, "_call_impl", "return forward_call(*args, **kwargs)"),
                (_SP + "torch/nn/modules/linear.py", 134, "forward", "return F.linear(input, self.weight, self.bias)")]
    raise ValueError(f"unknown stack kind {kind!r}")


def stack_text(frames) -> str:
    """Frames ``(file, line, function, code)``, outermost first, as ``LaunchTimeout.stacks`` formats them."""
    out = []
    for f, n, fn, code in frames:
        out.append(f'  File "{f}", line {n}, in {fn}\n' + (f"    {code}\n" if code else ""))
    return "".join(out)


#: (what happened, {rank: situation}): the judge reads each expected answer off the stacks itself
HANG_CASES = (
    ("rank 1 skipped the gradient all-reduce and returned", {0: "all_reduce", 1: "idle", 2: "all_reduce", 3: "all_reduce"}),
    ("rank 2 broadcast a stop flag the others never broadcast; they wait in FSDP2's all-gather",
     {0: "fsdp_all_gather", 1: "fsdp_all_gather", 2: "broadcast", 3: "fsdp_all_gather"}),
    ("5 ranks: 1, 3 and 4 wait in all_gather_object, rank 2 returned, rank 0 still computes its forward",
     {0: "computing", 1: "object", 2: "idle", 3: "object", 4: "object"}),
)


def _case_stacks(case) -> dict:
    return {r: stack_text(_frames_of(kind)) for r, kind in case[1].items()}


def _hang_of(stacks: dict) -> dict:
    """The judge's answer (and the reference's): the outermost c10d frame of each rank, the most common one, and
    the ranks not in it."""
    import re
    from collections import Counter
    ops = {}
    for r, text in stacks.items():
        frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', text)
        ops[r] = next((fn for f, fn in frames if f.endswith(C10D)), None)
    op = Counter(o for o in ops.values() if o).most_common(1)[0][0]
    return {"op": op, "missing": sorted(r for r, o in ops.items() if o != op)}


def reference_hang_report(stacks: dict) -> dict:
    """``{"op": the c10d collective most ranks wait in, "missing": sorted ranks not waiting in it}``."""
    return _hang_of(stacks)


def _hang_why(got, want, stacks) -> str:
    op, missing = got.get("op"), got.get("missing")
    if op != want["op"]:
        if isinstance(op, str) and "." in op and op.rsplit(".", 1)[1] == want["op"]:
            return (f"a format slip: {op!r} is the call as the code spells it; the op is the c10d function's own "
                    f"name, {want['op']!r}, without the module prefix")
        if op == "worker_main":
            return "that is the outermost frame (the launcher's); stacks are printed outermost first"
        if op in ("wrapper", "all_gather") or (op in COLLECTIVES and op != want["op"] and want["op"] == "all_gather_object"):
            return ("that is the innermost frame inside torch, not the collective that was called: take the outermost "
                    f"frame in {C10D} (all_gather_object calls all_gather)")
        if op in ("train_step", "average_gradients", "check_config", "forward", "__call__", "_call_impl"):
            return (f"{op!r} is a frame of the program, not the collective: the op is the c10d function the frame "
                    f"calls, in {C10D}")
        return f"most ranks wait in {want['op']!r}: count every rank's collective"
    if sorted(missing or []) == sorted(r for r in stacks if r not in want["missing"]):
        return "those are the ranks that wait: the culprits are the ranks *not* waiting in the collective"
    if set(missing or []) < set(want["missing"]):
        return ("a rank elsewhere is missing too: a rank in another collective, or still computing, is not in this one "
                "(only idle ranks counted?)")
    return f"the missing ranks are those not waiting in {want['op']}"


def _returned(got) -> dict:
    """Run half: a returned value as plain data, with its type's name; a set (which plain data has no room for)
    travels as its elements, under ``"set"``, read without calling a method of the value's own class."""
    out = {"value": _plain.plain(got), "type": type(got).__name__}
    missing = dict.get(got, "missing") if isinstance(got, dict) else None
    if isinstance(missing, (set, frozenset)):
        items = (set.__iter__ if isinstance(missing, set) else frozenset.__iter__)(missing)
        out["set"] = {"type": type(missing).__name__, "items": _plain.plain(list(items))}
    return out


def _ranks(values) -> list | None:
    """Judge side: a plain list of ranks as ints (0-d integer arrays too), or None if any is not one."""
    out = []
    for v in values:
        if getattr(v, "ndim", None) == 0 and getattr(getattr(v, "dtype", None), "kind", "") in "iu":
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            return None
        out.append(v)
    return out


def run_hang_report(fn) -> dict:
    """Run half: the learner's report for each hang's stacks (no expected answer here)."""
    return {"got": [_returned(fn(dict(_case_stacks(case)))) for case in HANG_CASES]}


def judge_hang_report(data) -> str:
    """Judge half: each report against the op and the missing ranks the judge reads off the same stacks."""
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(HANG_CASES):
        raise AssertionError(f'hang_report was not run on each of the {len(HANG_CASES)} hangs; return {{"op": '
                             '<c10d function>, "missing": [ranks]}')
    wants = []
    for case, record in zip(HANG_CASES, got_all):
        stacks = _case_stacks(case)
        want = _hang_of(stacks)
        wants.append(want)
        got = record.get("value") if isinstance(record, dict) else record
        as_set = record.get("set") if isinstance(record, dict) else None
        missing = got.get("missing") if isinstance(got, dict) else None
        items = as_set["items"] if isinstance(as_set, dict) and isinstance(as_set.get("items"), list) else missing
        ranks = _ranks(items) if isinstance(items, (list, tuple)) else None
        if not isinstance(got, dict) or set(got) != {"op", "missing"} or ranks is None:
            raise AssertionError(f'{case[0]}: got {got!r}; return {{"op": <c10d function>, "missing": [ranks]}}')
        norm = {"op": got["op"], "missing": sorted(ranks)}
        if norm != want:
            raise AssertionError(f"{case[0]}: got {norm}, expected {want} → {_hang_why(norm, want, stacks)}")
        if as_set is not None or ranks != sorted(ranks):
            what = f"a {as_set['type']}, which has no order" if isinstance(as_set, dict) else f"{ranks}, out of order"
            raise AssertionError(f'{case[0]}: the ranks are right, but "missing" is {what} → return the missing ranks '
                                 f"as a sorted list, {want['missing']}, as the exercise says")
    return f"{len(HANG_CASES)} hangs read right: " + "; ".join(f"{w['op']} without rank(s) {w['missing']}"
                                                            for w in wants)


@exercise("09", "hang_report", cell="def hang_report(", hints=HINTS["hang_report"],
          mistakes={"outermost frame": "that is the outermost frame", "innermost frame": "that is the innermost frame",
                    "a frame of the program": "a frame of the program, not the collective",
                    "the waiting ranks": "those are the ranks that wait",
                    "idle ranks only": "a rank elsewhere is missing too", "format slip": "a format slip",
                    "not sorted": "return the missing ranks as a sorted list", "not a dict": 'return {"op": '},
          judge=judge_hang_report, references=("course_lib.checks.lab09.reference_hang_report",))
def check_hang_report(fn, name: str = "hang_report") -> bool:
    """``fn(stacks)``: ``stacks`` maps rank -> its stack as ``LaunchTimeout.stacks`` gives it (outermost first)."""
    fn = _guard(fn, "09", "hang_report")
    return decide(name, lab="09", tests="three hangs (a skipped all-reduce, a broadcast only one rank made during "
                  "FSDP2's all-gather, all_gather_object with a rank still computing): the collective most ranks "
                  "wait in, and the ranks missing from it", run=lambda: run_hang_report(fn), judge=judge_hang_report)


# -- exercise 2: which rank drifted -------------------------------------------------------------------------------
def drift_net():
    """The small model every drift case starts from (seed 0 on every rank): six parameters, named in order."""
    import torch
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"embed": torch.nn.Embedding(11, 8),
                                "blocks": torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                "head": torch.nn.Linear(8, 3, bias=False)})


#: (what happened, {rank: [(parameter, change)]}): the judge finds each case's answer itself. Changes: "swap" two
#: elements (a float sum stays the same), "ulp" one element by one unit in the last place, "reseed" the whole tensor
#: redrawn. Two ranks differ in blocks.0.weight: the answer names the lowest.
DRIFT_CASES = (
    ("every rank identical", {}),
    ("rank 3 initialised head.weight from another seed", {3: [("head.weight", "reseed")]}),
    ("ranks 2 and 3 swapped two elements of blocks.0.weight (its sum stays the same)",
     {2: [("blocks.0.weight", "swap")], 3: [("blocks.0.weight", "swap")]}),
    ("rank 3 differs in blocks.0.bias by one ulp; rank 1 in blocks.1.weight and rank 2 in head.weight, later in the model",
     {1: [("blocks.1.weight", "reseed")], 3: [("blocks.0.bias", "ulp")], 2: [("head.weight", "reseed")]}),
)


def drift_case(k: int, rank: int):
    """Rank ``rank``'s model in case ``k`` of :data:`DRIFT_CASES`."""
    import torch
    model = drift_net()
    with torch.no_grad():
        for pname, change in DRIFT_CASES[k][1].get(rank, []):
            p = dict(model.named_parameters())[pname].view(-1)
            if change == "swap":
                p[[0, 1]] = p[[1, 0]].clone()
            elif change == "ulp":
                p[0] = torch.nextafter(p[0], torch.tensor(float("inf")))
            else:
                p.copy_(torch.randn(p.numel(), generator=torch.Generator().manual_seed(100 + rank)))
    return model


def _drift_of(k: int, world_size: int):
    """The judge's answer for case ``k``, in one process: every rank's model built here, each parameter's bits
    compared with rank 0's; ``(first parameter that differs, lowest rank that differs there)`` or None."""
    import torch
    models = [dict(drift_case(k, r).named_parameters()) for r in range(world_size)]
    bits = lambda t: t.detach().contiguous().view(torch.int32)  # noqa: E731   (float32: the exact bits)
    for name, p0 in models[0].items():
        ranks = [r for r in range(1, world_size) if not torch.equal(bits(models[r][name]), bits(p0))]
        if ranks:
            return name, ranks[0]
    return None


def reference_diverged_ranks(model):
    """On every rank: ``(first parameter that differs on some rank, lowest such rank)`` against rank 0, or None.
    One collective: an all-gather of every parameter's fingerprint."""
    import torch
    import torch.distributed as dist
    from course_lib.measure import fingerprint
    names, fps = fingerprint.fingerprints(model)
    table = torch.empty(dist.get_world_size(), len(fps), dtype=torch.int64)   # ranks x parameters
    dist.all_gather(list(table), fps)                       # one collective: row r is rank r's fingerprints
    bad = table != table[0]
    for j, name in enumerate(names):
        if bool(bad[:, j].any()):
            return name, int(bad[:, j].nonzero()[0, 0])
    return None


def _drift_on_rank(fn, k):
    """Run half, on one rank: the learner's answer on this rank's model of case ``k``, as plain data."""
    import torch.distributed as dist
    return _plain.plain(fn(drift_case(k, dist.get_rank())))


def _norm(a):
    """Judge side: ``(name, rank)`` from a plain pair; anything else as it came."""
    if isinstance(a, (tuple, list)) and len(a) == 2:
        rank = a[1]
        if getattr(rank, "ndim", None) == 0:
            rank = rank.item()
        if isinstance(rank, (int, float)) and not isinstance(rank, bool) and float(rank).is_integer():
            return (str(a[0]), int(rank))
    return a


def run_diverged_ranks(fn, world_size: int) -> dict:
    """Run half: each case on ``world_size`` gloo ranks -- every rank's answer and the collectives each issued."""
    from course_lib.launch import run
    out = []
    for k in range(len(DRIFT_CASES)):
        res = run(_drift_on_rank, fn, k, world_size=world_size, timeout=120)
        out.append({"answers": list(res), "ops": [[x.op for x in res.ledger.filter(rank=r)] for r in range(world_size)]})
    return {"cases": out}


def judge_diverged_ranks(data, world_size: int = 4) -> str:
    """Judge half: every rank's answer against the first divergence the judge finds in one process, the same answer
    on every rank, and one collective per rank."""
    cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(cases, list) or len(cases) != len(DRIFT_CASES):
        raise AssertionError(f"diverged_ranks was not run on each of the {len(DRIFT_CASES)} cases")
    answers, calls = [], []
    for k, ((what, changes), case) in enumerate(zip(DRIFT_CASES, cases)):
        res = case.get("answers") if isinstance(case, dict) else None
        ops = case.get("ops") if isinstance(case, dict) else None
        if not isinstance(res, list) or len(res) != world_size or not isinstance(ops, list) or not ops:
            raise AssertionError(f"{what}: no answer from each of {world_size} ranks")
        want = _drift_of(k, world_size)
        got = [_norm(a) for a in res]
        answers.append(got[0])
        calls.append(len(ops[0]) if isinstance(ops[0], list) else 0)
        if len(set(map(repr, got))) > 1:
            raise AssertionError(f"{what}: ranks answered {got} → every rank must return the same answer (all-gather, "
                                 "not gather: every rank may need to stop or repair itself)")
        if got[0] != want:
            g = got[0]
            subtle = all(ch in ("swap", "ulp") for lst in changes.values() for _, ch in lst)
            if want is None:
                why = "none differs here: compare bits with rank 0's, not approximate values"
            elif g is None and subtle:
                why = ("a float sum (or mean, or norm) cannot see two swapped elements or a one-ulp change: "
                       "fingerprint the exact bits")
            elif g is None or not isinstance(g, tuple):
                why = f"compare every rank with rank 0, not only rank 1 (world size {world_size})"
            elif g[1] == 0:
                why = "rank 0 is the reference: name the rank that differs from it"
            elif g[0] != want[0]:
                why = f"not the first parameter in named_parameters() order that differs ({want[0]})"
            else:
                why = "the lowest rank that differs at that parameter"
            raise AssertionError(f"{what}: got {g!r}, expected {want!r} → {why}")
    most = max(calls)
    if most > 1:
        worst = cases[calls.index(most)]["ops"][0]
        if most >= 6:
            raise AssertionError(f"{most} collectives per rank for 6 parameters → one collective per parameter "
                                 "costs a latency each: gather every fingerprint at once (one all-gather)")
        raise AssertionError(f"the answers are right, but rank 0 issued {most} collectives ({', '.join(worst)}) → one "
                             "is enough: a single all-gather of every parameter's fingerprint gives every rank the "
                             "whole table; each extra collective is a latency every rank pays")
    return (f"{len(DRIFT_CASES)} cases on {world_size} ranks, {most} collective(s) per rank: "
            + "; ".join("none" if a is None else f"{a[0]} on rank {a[1]}" for a in answers))


@exercise("09", "diverged_ranks", cell="def diverged_ranks(", hints=HINTS["diverged_ranks"], guards=("cost", "argument"),
          mistakes={"float sum": "a float sum", "some ranks only": "compare every rank",
                    "not the first parameter": "not the first parameter", "rank 0 named": "rank 0 is the reference",
                    "not the lowest rank": "the lowest rank that differs",
                    "only rank 0 knows": "every rank must return the same answer",
                    "a collective per parameter": "one collective per parameter",
                    "more than one collective": "one is enough", "false alarm": "none differs"},
          judge=judge_diverged_ranks, references=("course_lib.checks.lab09.reference_diverged_ranks",))
def check_diverged_ranks(fn, name: str = "diverged_ranks", world_size: int = 4) -> bool:
    """``fn(model)`` runs on every rank: ``(parameter name, rank)`` of the first divergence against rank 0, or None."""
    fn = _guard(fn, "09", "diverged_ranks")
    return decide(name, lab="09", tests=f"{len(DRIFT_CASES)} cases on {world_size} ranks (none, two swapped elements, "
                  "a reseeded tensor, a one-ulp change beside later ones): the first parameter and rank that differ "
                  "from rank 0, the same answer on every rank, in one collective",
                  run=lambda: run_diverged_ranks(fn, world_size), judge=judge_diverged_ranks,
                  params={"world_size": world_size})


# -- exercise 3: where the NaN was born ---------------------------------------------------------------------------
#: The modules of the made-up model in the order their forward hooks fire: a forward hook runs when its module's
#: forward *returns*, so a child (``blocks.0.act``) records before its parent (``blocks.0``), and the root last.
_MODULES = ("embed", "blocks.0.act", "blocks.0", "blocks.1.act", "blocks.1", "head", "<root>")


def nan_records(world: int, steps: int, born: dict) -> list:
    """Records as :class:`~course_lib.measure.nonfinite.NonFiniteWatch` writes them, rank by rank. ``born``:
    {(rank, step): (call, "inf" or "nan")}: the output of that call is bad, and every later one in that forward is
    NaN (an inf turns NaN at the next op); from the next step on, every rank is NaN everywhere (the all-reduce)."""
    first_step = min((s for _, s in born), default=steps)
    out = []
    for r in range(world):
        for s in range(steps):
            start = born.get((r, s))
            for call, mod in enumerate(_MODULES):
                nan = s > first_step or (start is not None and (call > start[0] or call == start[0] and start[1] == "nan"))
                inf = start is not None and call == start[0] and start[1] == "inf"
                out.append({"rank": r, "step": s, "call": call, "module": mod, "nan": bool(nan), "inf": bool(inf)})
    return out


#: (what happened, world, steps, born): the judge finds each run's answer itself
NAN_CASES = (
    ("a healthy run", 4, 3, {}),
    ("blocks.1 overflowed to inf on rank 2 at step 1", 4, 3, {(2, 1): (_MODULES.index("blocks.1"), "inf")}),
    ("two ranks went bad in step 2: rank 1 at the head, rank 3 earlier, at blocks.0.act", 4, 4,
     {(1, 2): (_MODULES.index("head"), "nan"), (3, 2): (_MODULES.index("blocks.0.act"), "nan")}),
)


def _first_of(records):
    """The judge's answer (and the reference's): the first bad record by step, then call order, then rank."""
    bad = [r for r in records if r["nan"] or r["inf"]]
    if not bad:
        return None
    first = min(bad, key=lambda r: (r["step"], r["call"], r["rank"]))
    return first["rank"], first["step"], first["module"]


def reference_first_nonfinite(records):
    """``(rank, step, module)`` of the first record (by step, then call order, then rank) with a NaN or an inf."""
    return _first_of(records)


def _triple(got):
    """Judge side: a plain ``(rank, step, module)`` as ``(int, int, str)``, None for None, or False if it is neither."""
    if got is None:
        return None
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return False
    r, s, m = (v.item() if getattr(v, "ndim", None) == 0 else v for v in got)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer() for v in (r, s)):
        return False
    return int(r), int(s), str(m)


def run_first_nonfinite(fn) -> dict:
    """Run half: the learner's answer for each run's records (no expected answer here)."""
    return {"got": [_plain.plain(fn([dict(r) for r in nan_records(world, steps, born)]))
                    for _, world, steps, born in NAN_CASES]}


def judge_first_nonfinite(data) -> str:
    """Judge half: each answer against the first bad record in time order, found by the judge in the same records."""
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(NAN_CASES):
        raise AssertionError(f"first_nonfinite was not run on each of the {len(NAN_CASES)} runs; return (rank, step, "
                             "module), or None when all is finite")
    wants = []
    for (what, world, steps, born), raw in zip(NAN_CASES, got_all):
        recs = nan_records(world, steps, born)
        want = _first_of(recs)
        wants.append(want)
        got = _triple(raw)
        if got is False:
            raise AssertionError(f"{what}: got {raw!r}; return (rank, step, module), or None when all is finite")
        if got == want:
            continue
        if want is None:
            raise AssertionError(f"{what}: got {got!r} → nothing is non-finite here: return None")
        why = "find the first record with r['nan'] or r['inf'], in time order"
        if got is not None:
            rec = next((r for r in recs if (r["rank"], r["step"], r["module"]) == got), None)
            first = next(r for r in recs if (r["rank"], r["step"], r["module"]) == want)
            if rec is None or not (rec["nan"] or rec["inf"]):
                why = "that output was finite"
            elif rec["step"] > first["step"]:
                why = ("that came later: records arrive rank by rank, and by the next step the gradient all-reduce "
                       "has spread the NaN to every rank; order by step, then call")
            elif got == _first_of([dict(r, inf=False) for r in recs]):
                why = f"an inf is non-finite too: {want[2]} overflowed to inf, the NaN came one op later"
            elif rec["rank"] == first["rank"]:
                why = "that module ran later in the same forward: order by `call`, the order modules ran"
            else:
                why = (f"rank order is not time order: rank {want[0]} went bad at call {first['call']}, before "
                       f"rank {got[0]} did at call {rec['call']}")
        raise AssertionError(f"{what}: got {got!r}, expected {want!r} → {why}")
    return f"{len(NAN_CASES)} runs: " + "; ".join("none" if w is None else f"rank {w[0]}, step {w[1]}, {w[2]}"
                                                  for w in wants)


@exercise("09", "first_nonfinite", cell="def first_nonfinite(", hints=HINTS["first_nonfinite"],
          mistakes={"list order": "came later", "NaN only": "an inf is non-finite too",
                    "later in the forward": "later in the same forward", "rank order": "rank order is not time order",
                    "false alarm": "nothing is non-finite", "not a triple": "return (rank, step, module)"},
          judge=judge_first_nonfinite, references=("course_lib.checks.lab09.reference_first_nonfinite",))
def check_first_nonfinite(fn, name: str = "first_nonfinite") -> bool:
    """``fn(records)`` -> ``(rank, step, module)`` of the first non-finite output, or None."""
    fn = _guard(fn, "09", "first_nonfinite")
    return decide(name, lab="09", tests="three runs' records from every rank (healthy; an overflow to inf on one rank "
                  "that spreads to all in the next step; two ranks going bad in one step): the rank, step and module "
                  "where the first NaN or inf was born", run=lambda: run_first_nonfinite(fn),
                  judge=judge_first_nonfinite)


# -- exercise 4: the sharding that stops the per-step resharding ----------------------------------------------------
def _spec_layout(n: int) -> dict:
    """{name: (shape, spec entries)}: the parameters' shapes and PartitionSpecs on an ``n``-device ``("fsdp",)`` mesh,
    as plain data (the judge's copy of the inputs: no JAX needed)."""
    return {"emb": ((10, 16 * n), (None, "fsdp")), "w1": ((16 * n, 8 * n), ("fsdp", None)), "b1": ((8 * n,), ()),
            "w2": ((8 * n, 6), ("fsdp", None))}


def spec_fix_params(mesh):
    """A small MLP's parameters on a 1-D ``("fsdp",)`` mesh, as FSDP lays them out: big kernels cut along a dim that
    divides, small ones (the bias) replicated, and an embedding whose rows do not divide cut along its columns."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    return {k: jax_put(jnp.full(shape, 0.01, jnp.float32), NamedSharding(mesh, P(*spec)))
            for k, (shape, spec) in _spec_layout(mesh.shape["fsdp"]).items()}


def jax_put(x, sharding):
    import jax
    return jax.device_put(x, sharding)


def _spec_step(params, m, tokens):
    import jax
    import jax.numpy as jnp

    def loss(p):
        h = jnp.take(p["emb"], tokens, axis=0) @ p["w1"] + p["b1"]
        return jnp.mean((jax.nn.relu(h) @ p["w2"]) ** 2)
    g = jax.grad(loss)(params)
    m = jax.tree.map(lambda m_, g_: 0.9 * m_ + g_, m, g)
    return jax.tree.map(lambda p_, m_: p_ - 0.1 * m_, params, m), m


def step_ledger(params, m_specs, mesh):
    """The collectives XLA compiles into one momentum-SGD step when the momentum has ``m_specs`` (and keeps them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from course_lib.comm import jax_ledger
    m = {k: jax.device_put(jnp.zeros_like(p), NamedSharding(mesh, m_specs[k])) for k, p in params.items()}
    tokens = jax.device_put(jnp.arange(4 * mesh.shape["fsdp"]) % 10, NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    outs = ({k: p.sharding for k, p in params.items()}, {k: v.sharding for k, v in m.items()})
    compiled = jax.jit(_spec_step, out_shardings=outs).lower(params, m, tokens).compile()
    return jax_ledger.from_compiled(compiled, mesh)


def reference_spec_fix(params):
    """Each momentum laid out exactly as its parameter."""
    return {k: p.sharding.spec for k, p in params.items()}


def spec_mesh(n: int = 4):
    """A 1-D mesh ``("fsdp",)`` over the first ``n`` devices (Auto axes: the partitioner may reshard silently)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh
    devs = jax.devices()
    if len(devs) < n:
        raise RuntimeError(f"spec_fix's check needs {n} JAX devices, this process has {len(devs)}: "
                           f"course_lib.setup_jax({n}) before JAX is first used")
    return Mesh(np.array(devs[:n]), ("fsdp",), axis_types=(AxisType.Auto,))


_REFERENCE_COUNTS: dict = {}   # n -> the reference step's collectives (one compile per process, not per check)


def _reference_counts_here(n: int) -> dict:
    """The collectives of the step whose momenta are laid out as their parameters, compiled in this process."""
    mesh = spec_mesh(n)
    params = spec_fix_params(mesh)
    return dict(sorted(step_ledger(params, {k: p.sharding.spec for k, p in params.items()}, mesh).counts().items()))


def _reference_counts(n: int) -> dict:
    """Judge side: the reference step's collectives -- compiled here when this process's JAX already has ``n``
    devices (a lab, the tests), else in a fresh process asked for ``n`` CPU devices (a grader)."""
    if n not in _REFERENCE_COUNTS:
        from course_lib.runtime import devices
        import sys
        if devices.jax_is_initialised() and len(sys.modules["jax"].devices()) >= n:
            _REFERENCE_COUNTS[n] = _reference_counts_here(n)
        else:
            import json
            import os
            import subprocess
            from pathlib import Path
            root = str(Path(__file__).resolve().parents[2])
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
            code = ("import json; from course_lib.runtime import devices; devices.setup_jax(%d); "
                    "from course_lib.checks import lab09; print(json.dumps(lab09._reference_counts_here(%d)))" % (n, n))
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                                 check=True)
            _REFERENCE_COUNTS[n] = json.loads(out.stdout.strip().splitlines()[-1])
    return _REFERENCE_COUNTS[n]


def _spec_plain(spec):
    """Run half: a PartitionSpec as ``{"P": [entries]}`` (read through PartitionSpec's own methods), anything else
    as ``{"unplain": its type}``."""
    from jax.sharding import PartitionSpec as P
    if not isinstance(spec, P):
        return {_plain.UNPLAIN: _plain.type_name(spec)}
    return {"P": _plain.plain(list(P.__iter__(spec)))}


def run_spec_fix(fn, n: int = 4) -> dict:
    """Run half: the learner's specs, and the collectives XLA compiles into the step with them (a measurement of
    the answer; None when the specs are not PartitionSpecs for every parameter)."""
    from jax.sharding import PartitionSpec as P
    mesh = spec_mesh(n)
    params = spec_fix_params(mesh)
    specs = fn(dict(params))
    if not isinstance(specs, dict):
        return {"specs": {_plain.UNPLAIN: _plain.type_name(specs)}, "step": None}
    out = {"specs": {str(k): _spec_plain(v) for k, v in dict.items(specs)}, "step": None}
    if set(dict.keys(specs)) == set(params) and all(isinstance(v, P) for v in dict.values(specs)):
        try:
            out["step"] = {"counts": dict(step_ledger(params, dict(specs), mesh).counts())}
        except ValueError as exc:            # an axis the mesh lacks, or a cut that does not divide
            out["step"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return out


def _entries(spec) -> list | None:
    """Judge side: a plain spec's entries as tuples of axis names (None -> ()), or None if it is not a spec."""
    if not isinstance(spec, dict) or set(spec) != {"P"} or not isinstance(spec["P"], (list, tuple)):
        return None
    out = []
    for e in spec["P"]:
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        elif isinstance(e, (list, tuple)) and all(isinstance(a, str) for a in e):
            out.append(tuple(e))
        else:
            return None
    return out


def _spec_text(spec) -> str:
    """A plain spec as JAX prints it: ``P(None, 'fsdp')``."""
    return "P(" + ", ".join(repr(tuple(e) if isinstance(e, list) else e) for e in spec["P"]) + ")"


def _same_layout(entries, ref, shape, n: int) -> bool:
    """The learner's entries lay the array out as ``ref`` does: equal once trailing unsharded dims are dropped, and
    a valid cut (no longer than the array's rank, each dim divisible, no axis twice)."""
    strip = lambda es: list(es[:max([i + 1 for i, e in enumerate(es) if e] or [0])])  # noqa: E731
    axes = [a for e in entries for a in e]
    if len(entries) > len(shape) or len(axes) != len(set(axes)):
        return False
    if any(dim % (n ** len(e)) for dim, e in zip(shape, entries)):
        return False
    return strip(entries) == strip([() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in ref])


def judge_spec_fix(data, world_size: int = 4, axis: str = "fsdp") -> str:
    """Judge half: each momentum's layout against its parameter's (the inputs rebuilt here, as plain data), then the
    step's collectives against the reference step's, compiled by the judge."""
    layout = _spec_layout(world_size)
    specs = data.get("specs") if isinstance(data, dict) else None
    entries = {k: _entries(v) for k, v in specs.items()} if isinstance(specs, dict) else {}
    if not isinstance(specs, dict) or set(specs) != set(layout) or any(e is None for e in entries.values()):
        shown = (specs.get(_plain.UNPLAIN) if isinstance(specs, dict) and _plain.UNPLAIN in specs else
                 {k: _spec_text(v) if _entries(v) is not None else (v.get(_plain.UNPLAIN) if isinstance(v, dict) else v)
                  for k, v in specs.items()} if isinstance(specs, dict) else specs)
        raise AssertionError(f"got {shown} → return {{name: PartitionSpec}} for every parameter {sorted(layout)}")
    same = {}
    for k, (shape, ref) in layout.items():
        unknown = [a for e in entries[k] for a in e if a != axis]
        if unknown:
            raise AssertionError(f"{k}: {_spec_text(specs[k])} names an axis this mesh does not have → use the mesh's "
                                 f"axis names {(axis,)}")
        same[k] = _same_layout(entries[k], ref, shape, world_size)
    step = data.get("step") if isinstance(data, dict) else None
    counts = step.get("counts") if isinstance(step, dict) else None
    if not (isinstance(counts, dict) and all(isinstance(c, int) and not isinstance(c, bool) for c in counts.values())):
        counts = None
    want = _reference_counts(world_size)
    bad = [k for k in layout if not same[k]]
    if not bad:
        assert counts == want, f"the step's collectives {counts} vs {want}"
        return f"no resharding: the step's collectives are the reference's ({', '.join(f'{op} x{c}' for op, c in sorted(want.items()))})"
    k, (shape, ref) = bad[0], layout[bad[0]]
    if isinstance(counts, dict):
        extra = {op: c - want.get(op, 0) for op, c in counts.items() if c > want.get(op, 0)}
        moved = ", ".join(f"{op} x{c}" for op, c in sorted(extra.items()))
        where = f"XLA adds {moved} to every step" if moved else "laid out unlike its parameter"
    else:
        where = f"{_spec_text(specs[k])} does not even divide its shape {tuple(shape)} over {world_size} devices"
    size = math.prod(shape)
    if len({repr(v) for v in specs.values()}) == 1 and len(bad) > 1:
        why = (f"the same spec for every state ({_spec_text(specs[k])}): each parameter has its own layout (emb is cut "
               "along its columns, b1 replicated)")
    elif not any(entries[k]):
        why = (f"the momentum of {k} holds all of it on every device ({size * 4:,} B instead of "
               f"{size * 4 // world_size:,} B), and XLA gathers to make it meet its parameter's shard")
    elif not any(ref):
        why = f"its parameter is replicated ({k} is small): cutting its momentum makes XLA gather it back"
    else:
        why = (f"{k}'s momentum is cut along another dim than its parameter ({_spec_text(specs[k])} vs "
               f"{_spec_text({'P': list(ref)})})")
    raise AssertionError(f"{k}: {where} → {why}")


@exercise("09", "spec_fix", cell="def spec_fix(", hints=HINTS["spec_fix"], guards=("cost", "argument"),
          mistakes={"replicated state": "holds all of it on every device", "another dim": "along another dim",
                    "one spec for all": "the same spec for every state", "sharded a replicated parameter":
                    "its parameter is replicated", "not specs": "return {name: PartitionSpec"},
          judge=judge_spec_fix, references=("course_lib.checks.lab09.reference_spec_fix",))
def check_spec_fix(fn, name: str = "spec_fix") -> bool:
    """``fn(params)`` -> ``{name: PartitionSpec}`` for each parameter's momentum; the compiled step must hold no
    collective beyond the reference's, and no state may be held whole where its parameter is cut."""
    fn = _guard(fn, "09", "spec_fix")
    return decide(name, lab="09", tests="a 4-parameter MLP on a 4-device mesh (a kernel cut along rows, one along "
                  "columns, a replicated bias): your momentum specs compiled into the step, whose collectives (read "
                  "from the HLO) must be the reference's, with no state replicated", run=lambda: run_spec_fix(fn),
                  judge=judge_spec_fix)
