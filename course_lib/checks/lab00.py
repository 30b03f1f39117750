"""Lab 00's exercise checks: all-reduce from its two halves (torch and JAX) and the ring cost.

Each check is split in two (:mod:`course_lib.checks.judge`): a *run half* calls the learner's function on the
check's inputs (on gloo ranks, or under ``jax.shard_map``) and returns what came out as plain data -- the values
with their dtype, whether the input was aliased, and the ledger of the collectives it issued (rank 0's records, or
the compiled program's) -- and a *judge half* rebuilds the inputs, computes the reference itself (the sum over
ranks in one process, :func:`course_lib.maths.costs.wire_bytes`) and names the likely mistake. Words as in
:mod:`course_lib.comm.ledger` (payload ``V``) and :mod:`course_lib.maths.costs` (wire bytes).

Longer than ~300 lines: three exercises, each with its run half and the diagnoses of its classic mistakes (the ❌
wording is the feedback a learner reads, so it stays beside the check that prints it).
"""
from __future__ import annotations

import math

import numpy as np

from course_lib import checks
from course_lib.checks import plain as _plain
from course_lib.checks.compare import shares_memory, untiled_collective
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.comm.collectives import RING_OPS
from course_lib.maths.costs import wire_bytes

__all__ = ["check_all_reduce", "check_ring_bytes", "check_jax_all_reduce", "judge_all_reduce", "judge_ring_bytes",
           "judge_jax_all_reduce", "HINTS"]

HINTS = {
    "my_all_reduce": [
        "An all-reduce is two halves: first every rank ends up with the SUM of one 1/N slice (reduce-scatter), "
        "then every rank collects all N summed slices (all-gather).",
        "The reduce-scatter's output is a shard of numel // N elements; divide that shard by N for mean=True "
        "(once, not again after gathering); the all-gather's input is that shard, not x.",
        "dist.reduce_scatter_tensor(shard, x) with shard = x.new_empty(x.numel() // N); then "
        "dist.all_gather_into_tensor(out, shard) with out = torch.empty_like(x).",
    ],
    "ring_bytes": [
        "In a ring, every step each rank sends one chunk of V/N to its neighbour; count the steps per phase.",
        "All-gather and reduce-scatter take N-1 steps; all-reduce is both phases; a broadcast pipelines the "
        "whole V through the ring once, which the course averages over the N ranks.",
        "all_gather / reduce_scatter / broadcast: (N-1)/N·V; all_reduce: 2·(N-1)/N·V; N = 1 gives 0.",
    ],
    "jax_all_reduce": [
        "Same two halves as the torch exercise, written as JAX collectives over the mesh axis inside shard_map.",
        "Each device's output must have the same shape as its input block: the collectives must split and "
        "concatenate along the existing axis, not add a new one.",
        "jax.lax.psum_scatter(block, 'x', tiled=True), then jax.lax.all_gather(shard, 'x', tiled=True).",
    ],
}


# -- what crosses the boundary: a learner's value, with its element type ------------------------------------
def _shown(sent) -> str:
    """Judge half: how to name a value that is not what was asked for."""
    value = sent.get("values") if isinstance(sent, dict) else sent
    kind = sent.get("type") if isinstance(sent, dict) else type(sent).__name__
    if isinstance(value, np.ndarray):
        return f"a {kind} of shape {tuple(value.shape)}"
    if isinstance(value, dict) and _plain.UNPLAIN in value:
        return f"a {value[_plain.UNPLAIN]}"
    return f"{value!r}" if value is None or isinstance(value, (bool, int, float, str)) else f"a {kind}"


def _received(sent, what: str, asked: str) -> np.ndarray:
    """Judge half: the array a :func:`_sent` value holds, typed as the learner's was (a bfloat16 answer stays
    bfloat16, so that :func:`checks.assert_close` names a lost cast); AssertionError when it holds none."""
    if not (isinstance(sent, dict) and isinstance(sent.get("values"), np.ndarray)):
        raise AssertionError(f"{what} returned {_shown(sent)}; return {asked}")
    if sent.get("dtype") == "bfloat16":
        import ml_dtypes
        return sent["values"].astype(ml_dtypes.bfloat16)
    return sent["values"]


def _rows(records) -> list[dict]:
    """Run half: collective records (a ledger's, or a compiled program's) as plain rows."""
    return [{"phase": r.phase, "op": r.op, "nbytes": int(r.nbytes), "group_size": int(r.group_size)} for r in records]


def _records(rows) -> list[dict]:
    """Judge half: :func:`_rows` as they came back; AssertionError when they are not such rows."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("op"), str)
                                             and type(r.get("nbytes")) is int and type(r.get("group_size")) is int
                                             for r in rows):
        raise AssertionError("the record of the collectives did not come back: run the check as the lab's cell "
                             "calls it")
    return rows


# -- exercise 1: all-reduce = reduce-scatter + all-gather, in torch on ranks -------------------------
def _inputs(rank: int, numel: int):
    """Rank ``r``'s input: distinct in every rank and position, so a misplaced chunk shows."""
    import torch
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g) + 10.0 * rank


def _all_reduce_on_rank(fn, numel: int) -> dict:
    """Run half, on one rank: ``fn`` for the sum, then for the mean, each on its own copy of this rank's input;
    what came out, what became of the inputs it was handed, and which result shares memory with its input."""
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.launch import rank_info

    x = _inputs(dist.get_rank(), numel).to(rank_info().device)   # the rank's GPU under NCCL
    given = {"sum": x.clone(), "mean": x.clone()}     # the tensors handed to fn: aliased or overwritten?
    with lt.phase("sum"):
        got_sum = fn(given["sum"])
    with lt.phase("mean"):
        got_mean = fn(given["mean"], mean=True)
    got = {"sum": got_sum, "mean": got_mean}
    return _plain.plain({"sum": _plain.typed(got_sum), "mean": _plain.typed(got_mean), "given_after": given,
                         "alias": [k for k in got if shares_memory(got[k], given[k])]})


def run_all_reduce(fn, world_size: int, numel: int) -> dict:
    """Run half: every rank's outcome and rank 0's ledger (the collectives it issued, by phase)."""
    from course_lib.launch import run
    result = run(_all_reduce_on_rank, fn, numel, world_size=world_size)
    return {"ranks": list(result), "ledger": _rows(result.ledger.filter(rank=0))}


def _input_problem(ranks, x, name: str) -> str | None:
    """The values are right: was the input returned (aliased) or overwritten? The text asks for a NEW tensor."""
    call = {"sum": f"{name}(x)", "mean": f"{name}(x, mean=True)"}
    for r, o in enumerate(ranks):
        alias = [k for k in o.get("alias") or [] if k in call]
        if alias:
            return (f"the values are right, but on rank {r} {call[alias[0]]} returns a tensor that shares "
                    "memory with its input x (x itself, or a view of it, written in place) → returned the input "
                    "tensor, not a NEW one: the caller's x now holds the result, and a later in-place op on x "
                    "(or on the result) changes the other. Gather into torch.empty_like(x)")
        after = o.get("given_after") or {}
        overwritten = [k for k in call if not (isinstance(after.get(k), np.ndarray)
                                               and np.array_equal(after[k], x[r]))]
        if overwritten:
            return (f"the values are right, but on rank {r} {call[overwritten[0]]} changed its input x → "
                    "overwrote the input in place (x /= N, or a collective's output written into x): the caller's "
                    "x is not the caller's any more; compute into new tensors (x.new_empty, torch.empty_like)")
    return None


def _gathered_inputs(x: list) -> checks.Detector:
    """got is the all-gather of each rank's own *input* chunk: the reduce-scatter's output was unused."""
    n = len(x)
    wrong = np.concatenate([np.asarray(x[r]).reshape(n, -1)[r] for r in range(n)])

    def detect(got, exp):
        if got.shape == wrong.shape and np.allclose(got, wrong, rtol=1e-5, atol=1e-6):
            return ("got is rank r's own input chunk r, gathered → the all-gather was fed the input, "
                    "not the reduce-scatter's output shard")
    return detect


def _cost_problem(records: list[dict], numel: int, n: int, call: str) -> str | None:
    """What is wrong with how one call computed its (right) values, from rank 0's ledger rows: the op
    kinds, then the bytes, compared with a reduce-scatter + all-gather of ``V = numel`` floats."""
    ops = [r["op"] for r in records]
    v = numel * 4
    sent = sum(wire_bytes(r["op"], r["nbytes"], r["group_size"]) for r in records)
    best = wire_bytes("all_reduce", v, n)
    if "all_reduce" in ops:
        return (f"the values are right, but {call} called all_reduce itself (rank 0 issued {ops}); build it "
                "from its two halves, a reduce-scatter then an all-gather, in every case")
    whole = [r for r in records if r["op"] == "all_gather" and r["nbytes"] >= n * v]
    if whole and "reduce_scatter" not in ops:
        return (f"the values are right, but {call} gathered every rank's whole tensor (an all_gather of "
                f"{whole[0]['nbytes']} bytes = N × V) and summed locally: {sent:g} bytes sent per rank where "
                f"a reduce-scatter + all-gather sends {best:g}, and every rank holds N copies")
    if ops != ["reduce_scatter", "all_gather"]:
        return (f"the values are right, but for {call} rank 0 issued {ops}: {sent:g} bytes sent per rank; "
                f"expected exactly one reduce_scatter then one all_gather ({best:g} bytes)")
    if sent > best * (1 + 1e-9):
        return (f"the values are right, but {call} sent {sent:g} bytes per rank where a reduce-scatter + "
                f"all-gather of V = {v} bytes sends {best:g}: a collective moved more than the tensor")
    return None


def judge_all_reduce(data: dict, world_size: int = 4, numel: int = 24, name: str = "my_all_reduce") -> str:
    """Judge half: every rank's sum and mean against the sum of all ranks' inputs (one process), then how they
    were computed (rank 0's ledger) and whether the caller's input survived."""
    n, ranks = world_size, data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or len(ranks) != n or not all(isinstance(o, dict) for o in ranks):
        raise AssertionError(f"no result from each of {n} ranks")
    x = [_inputs(r, numel).numpy() for r in range(n)]
    ref = np.sum(x, axis=0)                                  # what dist.all_reduce gives every rank
    asked = "a new tensor, the shape of x"
    for r in range(n):
        checks.assert_close(f"{name}(x) on rank {r}", _received(ranks[r].get("sum"), f"{name}(x) on rank {r}", asked),
                            ref, rtol=1e-5, atol=1e-5,
                            hint=[checks.wrong_shard_offset(n), checks.skipped_collective(x), _gathered_inputs(x)])
    for r in range(n):
        what = f"{name}(x, mean=True) on rank {r}"
        checks.assert_close(what, _received(ranks[r].get("mean"), what, asked), ref / n, rtol=1e-5, atol=1e-5,
                            hint=[checks.summed_not_averaged(n), checks.averaged_twice(n),
                                  checks.wrong_shard_offset(n)])
    ledger = _records(data.get("ledger"))
    for phase, call in (("sum", f"{name}(x)"), ("mean", f"{name}(x, mean=True)")):
        problem = _cost_problem([r for r in ledger if r.get("phase") == phase], numel, n, call)
        if problem:
            raise AssertionError(problem)
    problem = _input_problem(ranks, x, name)
    if problem:
        raise AssertionError(problem)
    ops = [r["op"] for r in ledger if r.get("phase") == "sum"]
    v = numel * 4
    return (f"matches dist.all_reduce on {n} ranks (sum and mean); ledger: {' + '.join(ops)}, "
            f"{2 * wire_bytes('all_gather', v, n):g} wire bytes per rank = all-reduce's "
            f"{wire_bytes('all_reduce', v, n):g} for V = {v} bytes ({numel} floats)")


@exercise("00", 'my_all_reduce', cell='def my_all_reduce(', hints=HINTS['my_all_reduce'],
          guards=("argument", "cost"),
          mistakes={'averaged twice': 'averaged twice', 'shard not gathered': 'all-gather it first',
                    'input gathered': 'the all-gather was fed the input', 'shifted shards': 'shifted by',
                    'mean ignored': 'summed instead of averaging',
                    'all_reduce called': 'called all_reduce itself',
                    'whole tensors gathered': "gathered every rank's whole tensor",
                    'input returned': 'returned the input tensor, not a NEW one',
                    'input overwritten': 'overwrote the input in place', 'dtype changed': 'where the reference is'},
          judge=judge_all_reduce, references=("course_lib.comm.collectives.all_reduce_by_parts",))
def check_all_reduce(fn, world_size: int = 4, numel: int = 24, name: str = "my_all_reduce") -> bool:
    """Exercise check: ``fn(x, mean=False)`` on every rank equals ``dist.all_reduce(x)`` (÷N if mean),
    and is built from a reduce-scatter and an all-gather (read from the ledger), for the sum and the mean."""
    fn = _guard(fn, "00", "my_all_reduce")
    return decide(name, lab="00", tests=f"on {world_size} ranks, sum and mean=True equal dist.all_reduce, and the "
                  "ledger shows one reduce-scatter then one all-gather (no all_reduce)",
                  run=lambda: run_all_reduce(fn, world_size, numel), judge=judge_all_reduce,
                  params={"world_size": world_size, "numel": numel, "name": name})


# -- exercise 2: the ring cost per rank ----------------------------------------------------------------
_CASES = [(op, v, n) for op in RING_OPS for v, n in ((4096, 4), (4 * 2**20, 8), (96, 3), (1000, 2), (512, 1))]
#: The grid that shows an argument the answer never reads: every op, several N > 1, several V.
_GRID = [(op, v, n) for op in RING_OPS for v in (96, 4096) for n in (2, 3, 4, 8)]


def run_ring_bytes(fn) -> dict:
    """Run half: the learner's bytes for every case, then over :data:`_GRID`; each value as plain data with its
    type's name (a number that says it equals anything is the number it holds)."""
    got = [fn(op, v, n) for op, v, n in _CASES]
    try:
        grid = [fn(op, v, n) for op, v, n in _GRID]
    except Exception:                                 # noqa: BLE001 - the cases above report the answer itself
        grid = None
    return {"got": [{"type": _plain.type_name(g), "values": _plain.plain(g)} for g in got],
            "grid": None if grid is None else [_plain.plain(g) for g in grid]}


def _number(value, kind: str = "float") -> float | None:
    """The number a plain value is (an int, a float, a NumPy scalar), or None."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf" and kind.startswith("numpy."):
        return float(value)
    return None


def _diagnose(op, v, n, got, exp) -> str:
    """A likely mistake, from what ``got`` is a multiple of."""
    if n == 1:
        return "with one rank nothing leaves the device: the cost is 0 (the (N-1) factor does it)"
    guesses = {
        "(N-1)·V": (n - 1) * v, "V/N (one step only)": v / n, "V": v, "2·(N-1)/N·V": 2 * (n - 1) / n * v,
        "(N-1)/N·V": (n - 1) / n * v, "2·(N-1)·V": 2 * (n - 1) * v,
    }
    why = {
        "(N-1)·V": "each of the N-1 ring steps sends one chunk of V/N, not the whole V",
        "V/N (one step only)": "that is one ring step; the ring takes N-1 of them",
        "V": "a rank does not send all of V: it keeps (or already has) its own 1/N",
        "2·(N-1)/N·V": "that is all-reduce's cost; only all-reduce has two phases",
        "(N-1)/N·V": "all-reduce is reduce-scatter THEN all-gather: two phases of (N-1)/N·V",
        "2·(N-1)·V": "two phases, but each step sends V/N, not V",
    }
    if op in ("broadcast", "reduce"):                 # rooted ops: the reasoning is not a ring all-gather's
        why.update({
            "(N-1)·V": "(N-1)·V is what all ranks send together in the pipelined ring; the cost is per rank, "
                       "averaged over the N ranks",
            "V": "only the root sends all of V (the last rank sends nothing); averaged over the N ranks it is "
                 "(N-1)·V / N",
            "V/N (one step only)": "a rooted op pipelines the whole V through N-1 hops, (N-1)·V in all; "
                                   "per rank that is (N-1)·V / N",
            "2·(N-1)/N·V": "that is all-reduce's cost; a " + op + " moves V once along the ring",
            "2·(N-1)·V": "a " + op + " moves V once along the ring, not twice",
        })
    for label, value in guesses.items():
        if math.isclose(got, value, rel_tol=1e-9) and not math.isclose(exp, value, rel_tol=1e-9):
            return f"got = {label} → {why[label]}"
    return "compare with the table above the exercise"


def _ignored(grid) -> str | None:
    """An argument the answer never looks at: its bytes over :data:`_GRID` do not change when that argument does
    (while the reference's do)."""
    if not isinstance(grid, list) or len(grid) != len(_GRID):
        return None
    values = [_number(g) for g in grid]
    if None in values:
        return None
    table = dict(zip(_GRID, values))
    ns, vs = sorted({n for _, _, n in _GRID}), sorted({v for _, v, _ in _GRID})
    same = lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)  # noqa: E731
    if all(same(table[(op, v, n)], table[(RING_OPS[0], v, n)]) for op in RING_OPS for v in vs for n in ns):
        return ("your answer gives the same bytes for every op: `op` is never used, but all-reduce runs two "
                "ring phases where the other three run one")
    if all(same(table[(op, v, n)], table[(op, v, ns[0])]) for op in RING_OPS for v in vs for n in ns):
        return ("your answer gives the same bytes for every N: `N` is never used, but each rank sends N-1 "
                "chunks of V/N, which depends on N")
    if all(same(table[(op, v, n)], table[(op, vs[0], n)]) for op in RING_OPS for v in vs for n in ns):
        return "your answer gives the same bytes for every V: the cost must grow with the payload V"
    return None


def judge_ring_bytes(data: dict, name: str = "ring_bytes") -> str:
    """Judge half: each case against :func:`course_lib.maths.costs.wire_bytes`, the mistake named from what the
    wrong value is a multiple of and from the arguments the answer never reads."""
    got_all = data.get("got") if isinstance(data, dict) else None
    if not isinstance(got_all, list) or len(got_all) != len(_CASES):
        raise AssertionError(f"{name} was not run on every case; return a number of bytes for each")
    for (op, v, n), sent in zip(_CASES, got_all):
        sent = sent if isinstance(sent, dict) else {}
        got, exp = _number(sent.get("values"), str(sent.get("type"))), wire_bytes(op, v, n)
        if got is None:
            raise AssertionError(f"{name}({op!r}, V={v}, N={n}) returned {_shown(sent)}; return a number of bytes")
        if not math.isfinite(got):
            raise AssertionError(f"{name}({op!r}, V={v}, N={n}) returned {got}; return a number of bytes "
                                 "(a division by zero, or by N - 1 with N = 1?)")
        if not math.isclose(got, exp, rel_tol=1e-9, abs_tol=1e-9):
            ignored = _ignored(data.get("grid")) if n > 1 else None
            raise AssertionError(f"{name}({op!r}, V={v}, N={n}) = {got:g}, expected {exp:g}\n"
                                 + (f"   likely mistake: {ignored}\n" if ignored else "")
                                 + f"   {'also' if ignored else 'likely mistake'}: {_diagnose(op, v, n, got, exp)}")
    return f"{len(_CASES)} cases match costs.wire_bytes (4 ops, N = 1, 2, 3, 4, 8)"


@exercise("00", 'ring_bytes', cell='def ring_bytes(', hints=HINTS['ring_bytes'], guards=("boundary", "argument"),
          mistakes={'op ignored': '`op` is never used', 'N ignored': '`N` is never used',
                    'V ignored': 'must grow with the payload V', 'N = 1': 'with one rank nothing leaves the device',
                    "broadcast as the root's bytes": 'only the root sends all of V',
                    'broadcast total': 'what all ranks send together', 'whole V per step': 'not the whole V',
                    'one step': 'that is one ring step', 'not a number': 'return a number of bytes'},
          judge=judge_ring_bytes, references=("course_lib.maths.costs.wire_bytes",))
def check_ring_bytes(fn, name: str = "ring_bytes") -> bool:
    """Exercise check: ``fn(op, V, N)`` equals :func:`course_lib.maths.costs.wire_bytes` for the ring ops."""
    fn = _guard(fn, "00", "ring_bytes")
    return decide(name, lab="00", tests="the per-rank bytes of all four ring ops for N = 1, 2, 3, 4, 8 and several V",
                  run=lambda: run_ring_bytes(fn), judge=judge_ring_bytes, params={"name": name})


# -- exercise 3: the same composition in JAX, under shard_map --------------------------------------------
def _blocks(n: int, numel: int) -> np.ndarray:
    """(n, numel): device d's block, distinct in every device and position."""
    return np.stack([np.random.default_rng(2000 + d).standard_normal(numel).astype(np.float32) + 10 * d
                     for d in range(n)])


def run_jax_all_reduce(fn, mesh, numel: int) -> dict:
    """Run half: ``fn`` under ``jax.shard_map`` over ``mesh``'s one axis; every device's output side by side
    (``out_specs=P(axis)``) and the compiled program's collectives -- or JAX's error for an untiled collective."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from course_lib.comm.jax_ledger import from_compiled

    (axis,), n = mesh.axis_names, mesh.devices.size
    x = jax.device_put(_blocks(n, numel).reshape(-1), NamedSharding(mesh, P(axis)))
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))
    try:
        got = f(x)
    except ValueError as e:                   # JAX names the sizes; the judge names the flag
        if untiled_collective(e) is None:
            raise
        return {"devices": n, "error": {"type": type(e).__name__, "message": str(e)}}
    return {"devices": n, "got": _plain.typed(got), "hlo": _rows(from_compiled(f.lower(x).compile(), mesh))}


def _averaged(n: int) -> checks.Detector:
    """got = expected / n where the exercise asks for the sum."""
    def detect(got, exp):
        if np.any(exp != 0) and np.allclose(got, exp / n, rtol=1e-4, atol=1e-6):
            return (f"got is expected ÷{n} → a mean (pmean, or a division by the device count) where the "
                    "exercise asks for the sum over devices")
    return detect


def judge_jax_all_reduce(data: dict, mesh_shape: tuple = (8,), axis_names: tuple = ("x",), numel: int = 24,
                         name: str = "jax_all_reduce") -> str:
    """Judge half: every device's output against the sum of all blocks (NumPy), then the compiled collectives.
    ``mesh_shape``/``axis_names``: the lab's mesh, ``jax.make_mesh((8,), ("x",))``."""
    n = math.prod(mesh_shape)
    if not isinstance(data, dict) or data.get("devices") != n:
        raise AssertionError(f"the check ran on {data.get('devices') if isinstance(data, dict) else None} devices; "
                             f"the lab's mesh has {n} (axis {axis_names[0]!r}): pass the lab's mesh")
    err = data.get("error")
    if err is not None:
        err = err if isinstance(err, dict) else {}
        msg = str(err.get("message", ""))
        flag = untiled_collective(msg) or "compare each collective's shapes with the block's"
        raise AssertionError(f"{name} raised {err.get('type')}: {(msg.splitlines() or [''])[0]}\n"
                             f"   likely mistake: {flag}")
    blocks = _blocks(n, numel)
    got = _received(data.get("got"), name, f"an array of the block's shape ({numel},)")
    ref = blocks.sum(axis=0)
    if got.shape != (n * numel,):             # per device: out_specs P(axis) stacks along axis 0
        per = (got.shape[0] // n,) + got.shape[1:] if got.ndim else got.shape
        raise AssertionError(
            f"each device returned shape {per}, but its input block is ({numel},): a device must return "
            f"the whole reduced block, same shape as its input\n   likely mistake: "
            + ("all_gather without tiled=True adds a new leading axis of size N instead of concatenating"
               if len(per) == 2 and per[0] == n else
               "a shard of 1/N of the block: the reduce-scatter's output was not all-gathered"
               if per == (numel // n,) else "compare each step's shape with the block's"))
    per_device = got.reshape(n, numel)
    for d in range(n):
        checks.assert_close(f"{name} on device {d}", per_device[d], ref, rtol=1e-5, atol=1e-4,
                            hint=[checks.wrong_shard_offset(n), checks.skipped_collective(list(blocks)),
                                  _averaged(n)])
    records = _records(data.get("hlo"))
    ops, v = [r["op"] for r in records], numel * 4
    sent = sum(wire_bytes(r["op"], r["nbytes"], r["group_size"]) for r in records)
    if "all_reduce" in ops:
        raise AssertionError(f"the values are right, but the compiled program issues {ops}: a psum (one "
                             "all-reduce), not the exercise's two halves, a reduce-scatter then an all-gather")
    whole = [r for r in records if r["op"] == "all_gather" and r["nbytes"] >= n * v]
    if whole and "reduce_scatter" not in ops:
        raise AssertionError(f"the values are right, but the compiled program issues {ops}: it gathers every "
                             f"device's whole block ({whole[0]['nbytes']} bytes = N × the block) and sums "
                             f"locally, {sent:g} bytes sent per device where a reduce-scatter + all-gather "
                             f"sends {wire_bytes('all_reduce', v, n):g}")
    if sorted(ops) != ["all_gather", "reduce_scatter"] or sent > wire_bytes("all_reduce", v, n) * (1 + 1e-9):
        raise AssertionError(f"the values are right, but the compiled program issues {ops} ({sent:g} bytes "
                             f"sent per device); expected one reduce_scatter and one all_gather of the block "
                             f"({wire_bytes('all_reduce', v, n):g} bytes)")
    return f"equals psum on all {n} devices; compiled HLO: reduce-scatter + all-gather"


@exercise("00", 'jax_all_reduce', cell='def jax_all_reduce(', hints=HINTS['jax_all_reduce'], guards=("cost",),
          mistakes={'stacked gather': 'all_gather without tiled=True',
                    'shard not gathered': "the reduce-scatter's output was not all-gathered",
                    'averaged': 'where the exercise asks for the sum', 'psum': 'a psum (one all-reduce)',
                    'untiled scatter': 'psum_scatter was called without tiled=True',
                    'dtype changed': 'where the reference is',
                    'whole blocks gathered': "gathers every device's whole block"},
          judge=judge_jax_all_reduce)
def check_jax_all_reduce(fn, mesh, numel: int = 24, name: str = "jax_all_reduce") -> bool:
    """Exercise check: ``fn(block)`` under ``jax.shard_map`` over ``mesh``'s one axis equals the sum
    of all devices' blocks on every device, and compiles to a reduce-scatter and an all-gather."""
    fn = _guard(fn, "00", "jax_all_reduce")
    n = mesh.devices.size
    return decide(name, lab="00", tests=f"on {n} devices each device returns its whole block summed over devices, "
                  "same shape as its input, and the compiled program is one reduce-scatter + one all-gather",
                  run=lambda: run_jax_all_reduce(fn, mesh, numel), judge=judge_jax_all_reduce,
                  params={"mesh_shape": tuple(mesh.devices.shape), "axis_names": tuple(mesh.axis_names),
                          "numel": numel, "name": name})
