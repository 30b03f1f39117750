"""Lab 02's exercise checks: storage accounting, ZeRO-1's sharded optimizer step, ZeRO-3's gather and
free. Each runs the learner's function (on gloo ranks where it communicates), compares it with the
single-process answer and names the likely mistake (see :mod:`course_lib.checks`).

The references they stand in for: :func:`course_lib.measure.memory.storage_bytes` and
:class:`course_lib.strategies.zero.torch.FlatUnit` (whose ``gather_``/``free_`` and the ``step`` of :class:`~course_lib.strategies.zero.torch.ZeRO`).
The ZeRO checks use a 17x257 -> 257x5 MLP: 5,911 parameters, padded at every N > 1, and 12 rows of data
(equal slices at N = 2, 3, 4).

Longer than ~300 lines: three exercise checks, each with its rank-side harness (the overlap and storage
watches that tell a right value at the wrong cost) and the diagnoses of its classic mistakes.
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import nn

from course_lib import checks as _checks
from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.comm import torch_ledger
from course_lib.maths.sharding import flat_layout
from course_lib.strategies.zero.torch import FlatUnit

__all__ = ["check_storage_bytes", "check_sharded_step", "check_gather_free", "HINTS"]

HINTS = {
    "storage_bytes": [
        "Memory is allocated per storage, not per tensor: several tensors can view one storage, a storage can "
        "be bigger than the views (padding), and a freed storage holds 0 bytes.",
        "Walk the tensors, skip None, and count each distinct storage once, identified by its address, at the "
        "storage's own size.",
        "s = t.untyped_storage(); if s.data_ptr() not in seen: seen.add(s.data_ptr()); total += s.nbytes()",
    ],
    "sharded_step": [
        "ZeRO-1: each rank needs only the averaged gradient of ITS shard, updates only that shard, then everyone "
        "collects the updated shards.",
        "Reduce-scatter the full gradient into a new shard-sized buffer and divide by N; give it to the shard "
        "as its .grad; step; all-gather. The shard is a view of full_params, so the all-gather must read from "
        "a copy, never from memory it is writing.",
        "g = torch.empty_like(shard_params); reduce_scatter_flat(full_grads, out=g); shard_params.grad = g / N; "
        "optimizer.step(); all_gather_flat(shard_params.clone(), out=full_params)",
    ],
    "gather / free": [
        "The parameters are views of one flat buffer; ZeRO-3 frees that buffer's memory between uses and "
        "refills it when the layer is needed.",
        "gather: give the storage back its full size, then all-gather every rank's shard into it (in rank "
        "order). free: shrink the same storage to 0 bytes; never make a new tensor, the views would not see it.",
        "gather: full.untyped_storage().resize_(full.numel() * full.element_size()); all_gather_flat(shard, "
        "out=full). free: full.untyped_storage().resize_(0)",
    ],
}


def _storage_cases() -> list[tuple[str, list, int]]:
    """(what, tensors, expected bytes): the ways a naive count goes wrong."""
    flat = torch.zeros(13)                                      # a padded flat buffer: 11 real + 2 padding
    views = [flat[:6].view(2, 3), flat[6:11]]                   # two parameters viewing it
    freed = torch.zeros(8)
    freed_view = freed[2:6]
    freed.untyped_storage().resize_(0)                          # ZeRO-3 / FSDP: storage released
    bf16 = torch.zeros(10, dtype=torch.bfloat16)
    return [
        ("three separate float32 tensors", [torch.zeros(3), torch.zeros(4, 5), torch.zeros(1)], 4 * 24),
        ("two views of one padded flat buffer of 13 float32", views, 4 * 13),
        ("a tensor listed twice, and a view of it", [flat, flat, flat[3:5]], 4 * 13),
        ("None entries (parameters without a gradient) and a bfloat16 tensor", [None, bf16, None], 2 * 10),
        ("a view of a freed storage", [freed_view], 0),
    ]


def _storage_inputs() -> list[tuple[str, list]]:
    """(what, tensors): the inputs the run half hands the learner's function, made afresh for each call."""
    return [(what, tensors) for what, tensors, _ in _storage_cases()]


def run_storage_bytes(fn) -> dict:
    """Run half: the learner's count for each case, as plain data (no expected value here)."""
    return {"got": [fn(tensors) for _, tensors in _storage_inputs()]}


def judge_storage_bytes(data: dict, name: str = "storage_bytes") -> str:
    """Judge half: each count against the storage actually allocated, with the likely mistake named."""
    cases = _storage_cases()
    got_all = data["got"]
    if not isinstance(got_all, list) or len(got_all) != len(cases):
        raise AssertionError(f"{name} was not run on every case; return a number of bytes for each")
    for (what, tensors, expected), got in zip(cases, got_all):
        if isinstance(got, bool) or not isinstance(got, int):
            shown = got.get("unplain") if isinstance(got, dict) and "unplain" in got else f"{type(got).__name__} {got!r}"
            raise AssertionError(f"{name}({what}) returned {shown}; return a number of bytes, an int "
                                 "(storage.nbytes() is one)")
        if got == expected:
            continue
        naive = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        msg = f"{name}({what}) = {got!r}, expected {expected} bytes"
        if got == naive:
            msg += ("\n   likely mistake: numel × element_size counts views twice and misses padding and "
                    "freed memory; count each distinct storage once, at the storage's own size")
        elif expected and got * 4 == expected and what != cases[3][0]:
            msg += ("\n   likely mistake: that is a count of elements; a storage's nbytes() is already in bytes")
        elif expected == 0 and got:
            msg += ("\n   likely mistake: a freed storage holds 0 bytes whatever the tensor's shape says: count "
                    "what the storage holds now, not what the tensor's shape would need")
        elif expected and got > expected and got % expected == 0:
            msg += (f"\n   likely mistake: one storage counted more than once ({got // expected}×): tensors that "
                    "view one storage start at different addresses; identify a storage by the storage's own "
                    "address, not the tensor's")
        elif expected and got and got < expected:
            msg += ("\n   likely mistake: a view's own size is not what was allocated (padding, the rest of the "
                    "buffer): use the whole storage's nbytes()")
        raise AssertionError(msg)
    return f"{len(cases)} cases: views counted once, padding counted, freed storage = 0 bytes"


@exercise("02", 'storage_bytes', cell='def storage_bytes(', hints=HINTS['storage_bytes'], guards=("boundary",),
          mistakes={'views counted twice': 'counts views twice', 'elements, not bytes': 'a count of elements',
                    'freed counted': 'a freed storage holds 0 bytes',
                    'storage counted twice': 'counted more than once',
                    'padding missed': "a view's own size is not what was allocated",
                    'not a number': 'return a number of bytes'},
          judge=judge_storage_bytes, references=("course_lib.measure.memory.storage_bytes",))
def check_storage_bytes(fn, name: str = "storage_bytes") -> bool:
    """Exercise check: ``fn(tensors)`` counts each distinct storage once, at its allocated size."""
    fn = _guard(fn, "02", "storage_bytes")
    return decide(name, lab="02", tests="each distinct storage counted once at its allocated size: views, a padded "
                  "flat buffer, None, bfloat16 and a freed storage",
                  run=lambda: run_storage_bytes(fn), judge=judge_storage_bytes, params={"name": name})


def _mlp_and_batch():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 257), nn.Tanh(), nn.Linear(257, 5, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, torch.randn(12, 17, generator=g), torch.randn(12, 5, generator=g)


def _sharded_step_on_rank(fn, lr: float = 1e-2) -> dict:
    """Run half, on one rank: the learner's step on this rank's slice of the batch; what came out, as plain data."""
    r, n = dist.get_rank(), dist.get_world_size()
    model, x, y = _mlp_and_batch()
    unit = FlatUnit(list(model.parameters()), r, n, sharded_params=False)
    rows = slice(r * 12 // n, (r + 1) * 12 // n)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()    # this rank's local gradient
    local = nn.functional.pad(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), (0, unit.layout.padding))
    torch_ledger.recorder().reset()
    with _overlap_watch() as overlaps:
        fn(unit.full, local, unit.shard, torch.optim.Adam([unit.shard], lr=lr))
    return _plain.plain({"grad_shard": unit.shard.grad, "full": unit.full.clone(),
                         "ops": [x.op for x in torch_ledger.recorder().ledger()], "overlaps": [list(o) for o in overlaps]})


def _sharded_step_reference(ws: int, lr: float = 1e-2) -> dict:
    """Judge side: what ``ws`` ranks should have computed -- one process, the whole batch, torch's Adam."""
    import numpy as np
    model, x, y = _mlp_and_batch()
    layout = flat_layout([p.numel() for p in model.parameters()], ws)
    flat = lambda ts: nn.functional.pad(torch.cat([t.detach().reshape(-1) for t in ts]),  # noqa: E731
                                        (0, layout.padding)).numpy()
    before = flat(model.parameters())
    local = []
    for r in range(ws):                                          # each rank's own gradient (a skipped collective)
        m, _, _ = _mlp_and_batch()
        rows = slice(r * 12 // ws, (r + 1) * 12 // ws)
        nn.functional.mse_loss(m(x[rows]), y[rows]).backward()
        local.append(flat([p.grad for p in m.parameters()]))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    nn.functional.mse_loss(model(x), y).backward()
    ref_grad = flat([p.grad for p in model.parameters()])
    opt.step()
    return {"S": layout.shard_size, "before": before, "ref_grad": ref_grad, "ref_full": flat(model.parameters()),
            "local": np.stack(local)}


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True if ``a`` and ``b`` share bytes of one storage (an all-gather reading what it overwrites)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class _overlap_watch:
    """Records every all-gather or reduce-scatter whose input overlaps its output (gloo happens to tolerate
    it; NCCL reads a buffer it is writing, which is undefined), as ``(op, input shape)``. Wraps the shim's
    and torch.distributed's entry points."""
    def __enter__(self) -> list:
        from course_lib.comm import shim
        self.found, self.saved = [], []
        for mod, attr, op in ((shim, "ALL_GATHER", "all_gather"), (dist, "all_gather_into_tensor", "all_gather"),
                              (dist, "all_gather_single", "all_gather"), (shim, "REDUCE_SCATTER", "reduce_scatter"),
                              (dist, "reduce_scatter_tensor", "reduce_scatter"),
                              (dist, "reduce_scatter_single", "reduce_scatter")):
            orig = getattr(mod, attr, None)
            if orig is None:
                continue

            def wrapped(output, input, *a, _orig=orig, _op=op, **k):
                if isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor) and _overlap(output, input):
                    self.found.append((_op, tuple(input.shape)))
                return _orig(output, input, *a, **k)
            self.saved.append((mod, attr, orig))
            setattr(mod, attr, wrapped)
        return self.found

    def __exit__(self, *exc) -> None:
        for mod, attr, orig in self.saved:
            setattr(mod, attr, orig)


def judge_sharded_step(data: dict, world_size: int = 4) -> str:
    """Judge half: every rank's gradient shard and parameters against one-process Adam, then the collectives."""
    other = 3 if world_size == 2 else 2
    for ws in (world_size, other):
        res = data.get(str(ws))
        if not isinstance(res, list) or len(res) != ws:
            raise AssertionError(f"no result from each of {ws} ranks")
        _verify_sharded_step(res, ws, world_size, _sharded_step_reference(ws))
    S = _sharded_step_reference(world_size)["S"]
    return f"on {world_size} ranks: reduce-scatter ÷N, Adam on {S} of {S * world_size} elements, all-gather"


def _verify_sharded_step(res, ws: int, asked: int, ref: dict) -> None:
    """Everything the judge asserts about one run of the learner's step on ``ws`` ranks (``asked``: the
    world size the lab runs; a second one catches a world size written into the answer)."""
    import numpy as np

    from course_lib import checks
    summed = lambda g, e: (f"got is {ws}× expected → you summed instead of averaging (forgot ÷{ws})"  # noqa: E731
                           if np.allclose(g, ws * e, rtol=1e-3, atol=1e-6) else None)  # loose: sum order
    S = ref["S"]
    for r, o in enumerate(res):
        if o["grad_shard"] is None:
            raise AssertionError(f"rank {r}: shard_params.grad is None; set it to the averaged gradient shard")
        exp = ref["ref_grad"][r * S:(r + 1) * S]
        if ws != asked and np.shape(o["grad_shard"]) == exp.shape \
                and np.allclose(o["grad_shard"], exp * ws / asked, rtol=1e-4, atol=1e-7) and not np.allclose(exp, 0):
            raise AssertionError(f"on {ws} ranks, rank {r}'s gradient shard is {ws}/{asked} of the mean: you divided "
                                 f"by {asked} whatever the world size; divide by the number of ranks in the group, "
                                 "asked at run time")
        local = [ref["local"][q][r * S:(r + 1) * S] for q in range(ws)]
        checks.assert_close(f"shard_params.grad (on {ws} ranks)", o["grad_shard"], exp, rtol=1e-5,
                            atol=1e-6, rank=r, hint=[summed, checks.averaged_twice(ws),
                                                     checks.skipped_collective(local)])
        full, before = np.asarray(o["full"]), ref["before"]
        stale = [q for q in range(ws) if full.shape == before.shape
                 and np.array_equal(full[q * S:(q + 1) * S], before[q * S:(q + 1) * S])]
        if 0 < len(stale) < ws:
            raise AssertionError(f"rank {r}: shards {stale} of full_params were never updated: all-gather "
                                 "the updated shards into full_params after optimizer.step()")
        checks.assert_close(f"full_params after the step (on {ws} ranks)", full, ref["ref_full"], rtol=1e-5,
                            atol=1e-6, rank=r, hint=checks.not_updated(before))
    for op, what, whose in (("all_gather", "all-gather's input (shard_params) is a view of its output (full_params)",
                             "gather from a copy of the shard"),
                            ("reduce_scatter", "reduce-scatter writes into a view of its own input (full_grads)",
                             "receive the shard into a new buffer")):
        bad = [r for r, o in enumerate(res) if any(found[0] == op for found in o["overlaps"])]
        if bad:
            raise AssertionError(f"the numbers are right, but on ranks {bad} the {what}: the collective reads memory "
                                 "it is overwriting. gloo happens to cope; NCCL does not. The input must not overlap "
                                 f"the output: {whose}")
    ops = list(res[0]["ops"])
    if ops.count("all_reduce"):
        raise AssertionError(f"the numbers are right, but rank 0 issued {ops}: an all_reduce moves the whole "
                             "gradient to every rank; ZeRO needs a reduce_scatter (each rank keeps only its "
                             "shard of the gradient), then an all_gather of the updated shards")
    if sorted(ops) != ["all_gather", "reduce_scatter"]:
        raise AssertionError(f"the numbers are right, but rank 0 issued {ops}: ZeRO needs one reduce_scatter "
                             "(each rank keeps only its shard of the gradient) and one all_gather")


@exercise("02", 'sharded_step', judge=judge_sharded_step, cell='def sharded_step(', hints=HINTS['sharded_step'], guards=("cost", "argument"),
          mistakes={'world size hard-coded': 'whatever the world size',
                    'summed, not averaged': 'summed instead of averaging', 'not gathered': 'were never updated',
                    'no reduction': 'collective was skipped', 'all-reduce': 'an all_reduce moves the whole gradient',
                    'gather into its own input': "the all-gather's input (shard_params) is a view of its output",
                    'scatter into its own gradient': "the reduce-scatter writes into a view of its own input"})
def check_sharded_step(fn, world_size: int = 4, name: str = "sharded_step") -> bool:
    """Exercise check: ``fn(full_params, full_grads, shard_params, optimizer)`` is ZeRO-1's step: the
    averaged gradient of this rank's shard in ``shard_params.grad``, then everyone's updated parameters;
    on ``world_size`` ranks, then on a second world size (2, or 3 when ``world_size`` is 2)."""
    from course_lib.launch import run
    other = 3 if world_size == 2 else 2
    fn = _guard(fn, "02", "sharded_step")
    return decide(name, lab="02", tests=f"on {world_size} ranks, then on {other}: each rank's gradient shard is the "
                  "mean over ranks, full_params equals one-process Adam afterwards, the ledger shows a reduce-scatter "
                  "and an all-gather (no all-reduce), and the all-gather's input does not overlap its output",
                  run=lambda: {str(ws): list(run(_sharded_step_on_rank, fn, world_size=ws)) for ws in (world_size, other)},
                  judge=judge_sharded_step, params={"world_size": world_size})


def _gather_free_on_rank(gather, free) -> dict:
    """Run half, on one rank: gather, use, free -- twice, as two steps would; what the storage held each time."""
    model, x, _ = _mlp_and_batch()
    unit = FlatUnit(list(model.parameters()), dist.get_rank(), dist.get_world_size(), sharded_params=True)
    p0, need = unit.params[0], unit.full.numel() * unit.full.element_size()   # the input's own size, in bytes
    out = {"shard": unit.shard.detach().clone()}
    for i in range(2):
        try:
            gather(unit.full, unit.shard)
        except Exception as exc:
            have = p0.untyped_storage().nbytes()
            if have >= need or type(exc).__name__ == "NotImplementedError":
                raise
            out["gather_error"] = {"step": i + 1, "type": type(exc).__name__, "have": have}
            return _plain.plain(out)
        out[f"gathered{i}"] = p0.untyped_storage().nbytes()
        out[f"full{i}"] = unit.full.detach().clone() if out[f"gathered{i}"] else None
        out[f"out{i}"] = model(x).detach() if out[f"gathered{i}"] else None
        before = out[f"gathered{i}"]
        free(unit.full)
        out[f"freed{i}"] = p0.untyped_storage().nbytes()
        out[f"zeroed{i}"] = bool(out[f"freed{i}"]) and not unit.full.detach().any().item()
        out[f"untouched{i}"] = out[f"freed{i}"] == before and not out[f"zeroed{i}"]
    return _plain.plain(out)


def _own_shard_everywhere(shard, n: int) -> _checks.Detector:
    import numpy as np
    mine = np.tile(np.asarray(shard), n)

    def detect(got, exp):
        if got.shape == mine.shape and np.allclose(got, mine) and not np.allclose(exp, mine):
            return ("every shard of `full` holds copies of this rank's own shard: the other ranks' shards "
                    "never arrived; they come from a collective, in rank order")
    return detect


def judge_gather_free(res: list, world_size: int = 4) -> str:
    """Judge half: the storage sizes, the gathered buffer and the model output against a one-process reference."""
    from course_lib import checks
    model, x, _ = _mlp_and_batch()
    layout = flat_layout([p.numel() for p in model.parameters()], world_size)
    padded_bytes, numel = layout.padded_numel * 4, layout.padded_numel
    flat = nn.functional.pad(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), (0, layout.padding))
    ref = model(x).detach().numpy()
    flat, S = flat.numpy(), layout.shard_size
    if not isinstance(res, list) or len(res) != world_size:
        raise AssertionError(f"no result from each of {world_size} ranks")
    for r, o in enumerate(res):
        err = o.get("gather_error")
        if err:
            raise AssertionError(
                f"rank {r}: gather #{err['step']} raised {err['type']} all-gathering into `full`: its storage holds "
                f"{err['have']} bytes but `full` needs {padded_bytes} ({numel} elements × 4 bytes each); give the "
                "storage its size in bytes before gathering into it")
    for (r, o), i in ((ro, i) for ro in enumerate(res) for i in range(2)):
        shard = flat[r * S:(r + 1) * S]
        if o[f"gathered{i}"] != padded_bytes:
            raise AssertionError(f"rank {r}, gather #{i + 1}: the parameters' storage holds {o[f'gathered{i}']} "
                                 f"bytes, expected {padded_bytes}: they are views of `full`'s storage, so "
                                 "refill that one: give it its size back and all-gather into `full` itself, "
                                 "not into a new tensor")
        checks.assert_close(f"`full` after gather #{i + 1}", o[f"full{i}"], flat, rtol=0, atol=0, rank=r,
                            hint=[_own_shard_everywhere(shard, world_size), checks.wrong_shard_offset(world_size)])
        checks.assert_close(f"model output after gather #{i + 1}", o[f"out{i}"], ref, rtol=1e-5, atol=1e-6,
                            rank=r, hint="all-gather every rank's shard into `full`, in rank order")
        if o[f"freed{i}"] != 0:
            held = f"rank {r}, free #{i + 1}: the parameters' storage still holds {o[f'freed{i}']} bytes"
            if o[f"zeroed{i}"]:
                raise AssertionError(f"{held}, all zeros: zeroing keeps the memory; release the storage itself "
                                     "(make it hold 0 bytes), keeping the tensor")
            if o[f"untouched{i}"]:
                raise AssertionError(f"{held}, untouched: dropping or rebinding a name frees nothing while the "
                                     "parameters view it; release the storage itself (make it hold 0 bytes)")
            raise AssertionError(f"{held}; release all of it: 0 bytes")
    return f"gathered {padded_bytes:,} bytes, output matches, freed to 0 bytes, twice"


@exercise("02", 'gather / free', cell='def gather(', hints=HINTS['gather / free'], guards=("cost",),
          mistakes={'storage too small': "but `full` needs", 'gathered elsewhere': 'refill that one',
                    'no communication': "copies of this rank's own shard",
                    'zeroed, storage kept': 'zeroing keeps the memory',
                    'name dropped, storage kept': 'frees nothing while the parameters view it'},
          judge=judge_gather_free,
          references=("course_lib.strategies.zero.torch.FlatUnit.gather_", "course_lib.strategies.zero.torch.FlatUnit.free_"))
def check_gather_free(gather, free, world_size: int = 4, name: str = "gather / free") -> bool:
    """Exercise check: ``gather(full, shard)`` refills the storage the parameters view and all-gathers
    into it; ``free(full)`` releases that storage -- twice in a row, as every training step does."""
    from course_lib.launch import run
    gather, free = _guard(gather, "02", "gather / free"), _guard(free, "02", "gather / free")
    return decide(name, lab="02", tests="twice in a row: after gather the parameters' storage is the full padded size "
                  "and the model output is right; after free it is 0 bytes",
                  run=lambda: list(run(_gather_free_on_rank, gather, free, world_size=world_size)),
                  judge=judge_gather_free, params={"world_size": world_size})
