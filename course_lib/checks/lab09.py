"""Lab 09's exercise checks (when it breaks): read a hang from every rank's stack, find the rank that drifted, find
where a NaN was born, and give an optimizer state the sharding that stops XLA resharding it every step.

Each check feeds the learner's function fixed cases built to separate the classic mistakes (the outermost or the
innermost frame read as the collective, a float sum as a checksum, list order as time order, a replicated state)
and names the one it sees. ``HINTS[name]``: the idea, the method, near-code (``checks.hint(name, level)``).

Longer than ~300 lines: four exercise checks, each with its fixed cases, its reference and its diagnoses.
"""
from __future__ import annotations

import math

from course_lib import checks
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "COLLECTIVES", "C10D", "stack_text", "HANG_CASES", "reference_hang_report", "check_hang_report",
           "drift_net", "drift_case", "DRIFT_CASES", "reference_diverged_ranks", "check_diverged_ranks",
           "nan_records", "NAN_CASES", "reference_first_nonfinite", "check_first_nonfinite",
           "spec_fix_params", "reference_spec_fix", "check_spec_fix"]

HINTS = {
    "hang_report": [
        "Every rank's stack ends (innermost) inside torch; the collective a rank waits in is the c10d function "
        "its code called. The ranks that are *not* waiting in the collective most ranks wait in are the culprits.",
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
        "Give each momentum exactly its parameter's layout: the same PartitionSpec (read it off the parameter, "
        "p.sharding.spec). Neither replicate it (every device holds all of it, and XLA gathers) nor cut every one "
        "the same way.",
        "return {name: p.sharding.spec for name, p in params.items()}",
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


#: (what happened, {rank: situation}, expected answer)
HANG_CASES = (
    ("rank 1 skipped the gradient all-reduce and returned", {0: "all_reduce", 1: "idle", 2: "all_reduce", 3: "all_reduce"},
     {"op": "all_reduce", "missing": [1]}),
    ("rank 2 broadcast a stop flag the others never broadcast; they wait in FSDP2's all-gather",
     {0: "fsdp_all_gather", 1: "fsdp_all_gather", 2: "broadcast", 3: "fsdp_all_gather"},
     {"op": "all_gather_into_tensor", "missing": [2]}),
    ("5 ranks: 1, 3 and 4 wait in all_gather_object, rank 2 returned, rank 0 still computes its forward",
     {0: "computing", 1: "object", 2: "idle", 3: "object", 4: "object"},
     {"op": "all_gather_object", "missing": [0, 2]}),
)


def _case_stacks(case) -> dict:
    return {r: stack_text(_frames_of(kind)) for r, kind in case[1].items()}


def reference_hang_report(stacks: dict) -> dict:
    """``{"op": the c10d collective most ranks wait in, "missing": sorted ranks not waiting in it}``."""
    import re
    from collections import Counter
    ops = {}
    for r, text in stacks.items():
        frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', text)
        ops[r] = next((fn for f, fn in frames if f.endswith(C10D)), None)
    op = Counter(o for o in ops.values() if o).most_common(1)[0][0]
    return {"op": op, "missing": sorted(r for r, o in ops.items() if o != op)}


def _hang_why(got, want, stacks) -> str:
    op, missing = got.get("op"), got.get("missing")
    if op != want["op"]:
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


@exercise("09", "hang_report", cell="def hang_report(", hints=HINTS["hang_report"],
          mistakes={"outermost frame": "that is the outermost frame", "innermost frame": "that is the innermost frame",
                    "a frame of the program": "a frame of the program, not the collective",
                    "the waiting ranks": "those are the ranks that wait",
                    "idle ranks only": "a rank elsewhere is missing too",
                    "not a dict": 'return {"op": '})
def check_hang_report(fn, name: str = "hang_report") -> bool:
    """``fn(stacks)``: ``stacks`` maps rank -> its stack as ``LaunchTimeout.stacks`` gives it (outermost first)."""
    with checks.check(name, tests="three hangs (a skipped all-reduce, a broadcast only one rank made during FSDP2's "
                                  "all-gather, all_gather_object with a rank still computing): the collective most "
                                  "ranks wait in, and the ranks missing from it") as c:
        for case in HANG_CASES:
            stacks = _case_stacks(case)
            want, got = case[2], fn(dict(stacks))
            if not isinstance(got, dict) or set(got) != {"op", "missing"}:
                raise AssertionError(f'{case[0]}: got {got!r}; return {{"op": <c10d function>, "missing": [ranks]}}')
            got = {"op": got["op"], "missing": sorted(int(r) for r in got["missing"])}
            if got != want:
                raise AssertionError(f"{case[0]}: got {got}, expected {want} → {_hang_why(got, want, stacks)}")
        c.ok(f"{len(HANG_CASES)} hangs read right: " + "; ".join(f"{w['op']} without rank(s) {w['missing']}"
                                                                  for _, _, w in HANG_CASES))
    return bool(c.passed)


# -- exercise 2: which rank drifted -------------------------------------------------------------------------------
def drift_net():
    """The small model every drift case starts from (seed 0 on every rank): six parameters, named in order."""
    import torch
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"embed": torch.nn.Embedding(11, 8),
                                "blocks": torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                                "head": torch.nn.Linear(8, 3, bias=False)})


#: (what happened, {rank: [(parameter, change)]}, expected answer). Changes: "swap" two elements (a float sum
#: stays the same), "ulp" one element by one unit in the last place, "reseed" the whole tensor redrawn.
DRIFT_CASES = (
    ("every rank identical", {}, None),
    ("rank 3 initialised head.weight from another seed", {3: [("head.weight", "reseed")]}, ("head.weight", 3)),
    ("rank 2 swapped two elements of blocks.0.weight (a float sum cannot see it)", {2: [("blocks.0.weight", "swap")]},
     ("blocks.0.weight", 2)),
    ("rank 3 differs in blocks.0.bias by one ulp; rank 1 in blocks.1.weight and rank 2 in head.weight, later in the model",
     {1: [("blocks.1.weight", "reseed")], 3: [("blocks.0.bias", "ulp")], 2: [("head.weight", "reseed")]},
     ("blocks.0.bias", 3)),
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
    import torch.distributed as dist
    return fn(drift_case(k, dist.get_rank()))


def _norm(a):
    if isinstance(a, (tuple, list)) and len(a) == 2:
        return (str(a[0]), int(a[1]))
    return a


@exercise("09", "diverged_ranks", cell="def diverged_ranks(", hints=HINTS["diverged_ranks"], guards=("cost", "argument"),
          mistakes={"float sum": "a float sum", "some ranks only": "compare every rank",
                    "not the first parameter": "not the first parameter", "rank 0 named": "rank 0 is the reference",
                    "only rank 0 knows": "every rank must return the same answer",
                    "a collective per parameter": "one collective per parameter", "false alarm": "none differs"})
def check_diverged_ranks(fn, name: str = "diverged_ranks", world_size: int = 4) -> bool:
    """``fn(model)`` runs on every rank: ``(parameter name, rank)`` of the first divergence against rank 0, or None."""
    from course_lib.launch import run
    with checks.check(name, tests=f"{len(DRIFT_CASES)} cases on {world_size} ranks (none, two swapped elements, a "
                                  "reseeded tensor, a one-ulp change beside later ones): the first parameter and rank "
                                  "that differ from rank 0, the same answer on every rank, in one collective") as c:
        answers, calls = [], []
        for k, (what, _, want) in enumerate(DRIFT_CASES):
            res = run(_drift_on_rank, fn, k, world_size=world_size, timeout=120)
            got = [_norm(a) for a in res]
            per_rank = len(res.ledger.filter(rank=0))
            answers.append(got[0])
            calls.append(per_rank)
            if len(set(map(repr, got))) > 1:
                raise AssertionError(f"{what}: ranks answered {got} → every rank must return the same answer (all-gather, "
                                     "not gather: every rank may need to stop or repair itself)")
            if got[0] != want:
                g = got[0]
                subtle = all(ch in ("swap", "ulp") for lst in DRIFT_CASES[k][1].values() for _, ch in lst)
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
        if max(calls) > 2:
            raise AssertionError(f"{max(calls)} collectives per rank for 6 parameters → one collective per parameter "
                                 "costs a latency each: gather every fingerprint at once (one all-gather)")
        c.ok(f"{len(DRIFT_CASES)} cases on {world_size} ranks, {max(calls)} collective(s) per rank: "
             + "; ".join("none" if a is None else f"{a[0]} on rank {a[1]}" for a in answers))
    return bool(c.passed)


# -- exercise 3: where the NaN was born ---------------------------------------------------------------------------
_MODULES = ("embed", "blocks.0", "blocks.0.act", "blocks.1", "blocks.1.act", "head", "<root>")


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


#: (what happened, world, steps, born, expected)
NAN_CASES = (
    ("a healthy run", 4, 3, {}, None),
    ("blocks.1 overflowed to inf on rank 2 at step 1", 4, 3, {(2, 1): (3, "inf")}, (2, 1, "blocks.1")),
    ("two ranks went bad in step 2: rank 1 at the head, rank 3 earlier, at blocks.0.act", 4, 4,
     {(1, 2): (5, "nan"), (3, 2): (2, "nan")}, (3, 2, "blocks.0.act")),
)


def reference_first_nonfinite(records):
    """``(rank, step, module)`` of the first record (by step, then call order, then rank) with a NaN or an inf."""
    bad = [r for r in records if r["nan"] or r["inf"]]
    if not bad:
        return None
    first = min(bad, key=lambda r: (r["step"], r["call"], r["rank"]))
    return first["rank"], first["step"], first["module"]


@exercise("09", "first_nonfinite", cell="def first_nonfinite(", hints=HINTS["first_nonfinite"],
          mistakes={"list order": "came later", "NaN only": "an inf is non-finite too",
                    "later in the forward": "later in the same forward", "rank order": "rank order is not time order",
                    "false alarm": "nothing is non-finite", "not a triple": "return (rank, step, module)"})
def check_first_nonfinite(fn, name: str = "first_nonfinite") -> bool:
    """``fn(records)`` -> ``(rank, step, module)`` of the first non-finite output, or None."""
    with checks.check(name, tests="three runs' records from every rank (healthy; an overflow to inf on one rank that "
                                  "spreads to all in the next step; two ranks going bad in one step): the rank, step "
                                  "and module where the first NaN or inf was born") as c:
        for what, world, steps, born, want in NAN_CASES:
            recs = nan_records(world, steps, born)
            got = fn([dict(r) for r in recs])
            if got is not None and not (isinstance(got, (tuple, list)) and len(got) == 3):
                raise AssertionError(f"{what}: got {got!r}; return (rank, step, module), or None when all is finite")
            got = None if got is None else (int(got[0]), int(got[1]), str(got[2]))
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
                elif got == reference_first_nonfinite([dict(r, inf=False) for r in recs]):
                    why = f"an inf is non-finite too: {want[2]} overflowed to inf, the NaN came one op later"
                elif rec["rank"] == first["rank"]:
                    why = "that module ran later in the same forward: order by `call`, the order modules ran"
                else:
                    why = (f"rank order is not time order: rank {want[0]} went bad at call {first['call']}, before "
                           f"rank {got[0]} did at call {rec['call']}")
            raise AssertionError(f"{what}: got {got!r}, expected {want!r} → {why}")
        c.ok(f"{len(NAN_CASES)} runs: " + "; ".join("none" if w is None else f"rank {w[0]}, step {w[1]}, {w[2]}"
                                                     for *_, w in NAN_CASES))
    return bool(c.passed)


# -- exercise 4: the sharding that stops the per-step resharding ----------------------------------------------------
def spec_fix_params(mesh):
    """A small MLP's parameters on a 1-D ``("fsdp",)`` mesh, as FSDP lays them out: big kernels cut along a dim that
    divides, small ones (the bias) replicated, and an embedding whose rows do not divide cut along its columns."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    n = mesh.shape["fsdp"]
    shapes = {"emb": ((10, 16 * n), P(None, "fsdp")), "w1": ((16 * n, 8 * n), P("fsdp", None)),
              "b1": ((8 * n,), P()), "w2": ((8 * n, 6), P("fsdp", None))}
    return {k: jax_put(jnp.full(s, 0.01, jnp.float32), NamedSharding(mesh, spec)) for k, (s, spec) in shapes.items()}


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


_REFERENCE_LEDGER: dict = {}   # device ids -> the reference step's ledger (one compile per process, not per check)


def _reference_ledger(params, mesh):
    key = tuple(d.id for d in mesh.devices.flat)
    if key not in _REFERENCE_LEDGER:
        _REFERENCE_LEDGER[key] = step_ledger(params, reference_spec_fix(params), mesh)
    return _REFERENCE_LEDGER[key]


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


@exercise("09", "spec_fix", cell="def spec_fix(", hints=HINTS["spec_fix"], guards=("cost", "argument"),
          mistakes={"replicated state": "holds all of it on every device", "another dim": "along another dim",
                    "one spec for all": "the same spec for every state", "sharded a replicated parameter":
                    "its parameter is replicated", "not specs": "return {name: PartitionSpec"})
def check_spec_fix(fn, name: str = "spec_fix") -> bool:
    """``fn(params)`` -> ``{name: PartitionSpec}`` for each parameter's momentum; the compiled step must hold no
    collective beyond the reference's, and no state may be held whole where its parameter is cut."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    with checks.check(name, tests="a 4-parameter MLP on a 4-device mesh (a kernel cut along rows, one along columns, a "
                                  "replicated bias): your momentum specs compiled into the step, whose collectives "
                                  "(read from the HLO) must be the reference's, with no state replicated") as c:
        mesh = spec_mesh()
        params = spec_fix_params(mesh)
        specs = fn(dict(params))
        if not isinstance(specs, dict) or set(specs) != set(params) or not all(isinstance(s, P) for s in specs.values()):
            raise AssertionError(f"got {specs!r} → return {{name: PartitionSpec}} for every parameter {sorted(params)}")
        same = {}
        for k, p in params.items():
            try:
                same[k] = NamedSharding(mesh, specs[k]).is_equivalent_to(p.sharding, p.ndim)
                NamedSharding(mesh, specs[k]).shard_shape(p.shape)
            except ValueError as exc:         # an axis the mesh lacks, or a cut that does not divide
                if "not found in mesh" in str(exc) or "is not found" in str(exc):
                    raise AssertionError(f"{k}: {specs[k]} names an axis this mesh does not have → use the mesh's "
                                         f"axis names {mesh.axis_names}") from None
                same[k] = False
        bad = [k for k in params if not same[k]]
        if not bad:
            want = _reference_ledger(params, mesh)
            got = step_ledger(params, specs, mesh)
            assert got.counts() == want.counts(), f"the step's collectives {dict(got.counts())} vs {dict(want.counts())}"
        else:
            k, p = bad[0], params[bad[0]]
            try:
                want = _reference_ledger(params, mesh)
                extra = step_ledger(params, specs, mesh).counts() - want.counts()
                moved = ", ".join(f"{op} x{n}" for op, n in sorted(extra.items()))
                where = f"XLA adds {moved} to every step" if moved else "laid out unlike its parameter"
            except ValueError:
                where = f"{specs[k]} does not even divide its shape {tuple(p.shape)} over {mesh.size} devices"
            if len({repr(s) for s in specs.values()}) == 1 and len(bad) > 1:
                why = (f"the same spec for every state ({specs[k]}): each parameter has its own layout (emb is cut "
                       "along its columns, b1 replicated)")
            elif all(a is None for a in specs[k]):
                why = (f"the momentum of {k} holds all of it on every device ({p.size * 4:,} B instead of "
                       f"{p.size * 4 // mesh.size:,} B), and XLA gathers to make it meet its parameter's shard")
            elif all(a is None for a in p.sharding.spec):
                why = f"its parameter is replicated ({k} is small): cutting its momentum makes XLA gather it back"
            else:
                why = f"{k}'s momentum is cut along another dim than its parameter ({specs[k]} vs {p.sharding.spec})"
            raise AssertionError(f"{k}: {where} → {why}")
        c.ok(f"no resharding: the step's collectives are the reference's ({', '.join(f'{op} x{n}' for op, n in sorted(want.counts().items()))})")
    return bool(c.passed)
