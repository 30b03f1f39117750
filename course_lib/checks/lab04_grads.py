"""Lab 04's gradient accumulation and clipping exercise (FSDP2): ``k`` micro-batches, one gradient sync, and the
global gradient norm clipped over sharded (DTensor) gradients.

``accumulate_and_clip(model, micro_batches, loss_fn, max_norm) -> total_norm``: ``model`` is the lab's GPT, already
sharded by ``fully_shard`` (every block, then the root) over 4 gloo ranks; ``micro_batches`` is this rank's list of
``k`` ``(x, y)`` pairs. The learner accumulates the mean gradient of the ``k`` micro-batches with FSDP2's
``set_requires_gradient_sync`` (FSDP1's ``no_sync``: reduce-scatter only after the last micro-batch), clips the
*global* gradient norm to ``max_norm`` and returns the norm before clipping (what ``clip_grad_norm_`` returns).

The check is split (:mod:`course_lib.checks.judge`):

* **run half** -- on 4 ranks: builds and shards the GPT, calls the learner's function, then reads, as plain data,
  every parameter's whole gradient (``full_tensor()``, rank 0), what each rank returned, and rank 0's collectives
  of the call (from the course's ledger: reduce-scatters, all-reduces);
* **judge half** (:func:`judge_accumulate_and_clip`) -- computes the reference itself in one process: the same GPT,
  the same ``k`` global micro-batches, the mean gradient, its norm and the clipped gradient; then compares and names
  the classic mistakes: clipping by the local shard's norm, gradient sync never re-enabled (nothing reduced), a sync
  after every micro-batch (right numbers at ``k`` times the reduce-scatters), the loss not divided by ``k``.
"""
from __future__ import annotations

import math

import numpy as np

from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.models import LAB_CONFIG

__all__ = ["HINTS", "K", "MAX_NORM", "BATCH", "check_accumulate_and_clip", "judge_accumulate_and_clip",
           "reference_grads"]

K = 3             #: micro-batches per optimizer step
BATCH = 8         #: global micro-batch (2 rows per rank on 4 ranks)
MAX_NORM = 1.0    #: below the gradient's norm (about 3): the clip is active, so clipping wrong shows
_RTOL, _ATOL = 1e-4, 1e-6   # fp32, k backward passes, reduce-scatter order vs one process: last bits differ

HINTS = {
    "accumulate_and_clip": [
        "Accumulating is k backward passes into the same gradients, each on loss / k, so that they add up to the "
        "mean. FSDP2 reduce-scatters after every backward unless told not to: tell it, and undo that before the "
        "last one. Then clip the norm of the whole gradient -- every rank holds only a shard of it, and the norm "
        "of a shard is not the norm of the gradient.",
        "The root FSDPModule has set_requires_gradient_sync(bool) (it applies to every unit inside): False for the "
        "first k-1 micro-batches, True for the last. Gradients of a model sharded by fully_shard are DTensors, "
        "and torch.nn.utils.clip_grad_norm_ on the model's parameters computes their norm across the ranks (one "
        "all-reduce) and returns it.",
        "for i, (x, y) in enumerate(micro_batches): model.set_requires_gradient_sync(i == k - 1); "
        "(loss_fn(model(x), y) / k).backward() -- then return torch.nn.utils.clip_grad_norm_(model.parameters(), "
        "max_norm)",
    ],
}

TESTS = {
    "accumulate_and_clip": f"on 4 gloo ranks, the lab's GPT sharded by fully_shard, {K} micro-batches of {BATCH} "
                           f"rows, max_norm={MAX_NORM}: every parameter's gradient (whole) and the norm returned, "
                           "against one process on the same batches; one reduce-scatter per unit in all (sync on "
                           "the last micro-batch only) and the norm computed across the ranks",
}


def _batches(rank: int | None, world: int, k: int = K):
    """The ``k`` micro-batches: rank ``rank``'s rows, or (``rank=None``) the whole global micro-batches."""
    from course_lib.models import TokenTask
    task = TokenTask(LAB_CONFIG.vocab_size, LAB_CONFIG.seq_len, seed=0)
    return [task.global_batch(s, BATCH) if rank is None else task.rank_batch(s, BATCH, rank, world)
            for s in range(k)]


def _on_rank(fn, k: int, max_norm: float) -> dict:
    """Run half, on one rank: the sharded GPT, the learner's call, then its gradients and collectives as facts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from course_lib.comm import torch_ledger as lt
    from course_lib.launch import rank_info
    from course_lib.models import TorchGPT, loss_fn, torch_init_
    from course_lib.strategies.fsdp.torch import shard_gpt
    r, n = dist.get_rank(), dist.get_world_size()
    dev = torch.device(rank_info().device)
    with torch.device("meta"):
        model = TorchGPT(LAB_CONFIG)
    shard_gpt(model, init_device_mesh(dev.type, (n,)))
    model.to_empty(device=dev)
    torch_init_(model, LAB_CONFIG, seed=0)
    micro = [tuple(torch.from_numpy(a).to(dev) for a in xy) for xy in _batches(r, n, k)]
    lt.recorder().reset()
    returned = fn(model, micro, loss_fn, max_norm)
    rows = [(rec.op, rec.phase) for rec in lt.recorder().ledger()]
    with lt.paused():                            # reading the result is the check's business, not the answer's
        if type(returned) is DTensor:            # clip_grad_norm_ over DTensors returns a replicated DTensor
            returned = returned.full_tensor()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            grads[name] = None if g is None else (g.full_tensor() if type(g) is DTensor else g).detach().cpu()
    return _plain.plain({"returned": _plain.typed(returned), "ops": rows,
                         "grads": grads if r == 0 else None})


def run_accumulate_and_clip(fn, world_size: int = 4, k: int = K, max_norm: float = MAX_NORM) -> dict:
    """Run half: every rank's facts (rank 0's gradients, whole)."""
    from course_lib.launch import run
    out = run(_on_rank, fn, k, max_norm, world_size=world_size)
    return {"ranks": list(out)}


def reference_grads(k: int = K, world_size: int = 4) -> list[dict[str, np.ndarray]]:
    """Judge side: each global micro-batch's gradient of ``loss / k``, in one process (their sum is the mean)."""
    import torch

    from course_lib.models import TorchGPT, loss_fn, torch_init_
    model = TorchGPT(LAB_CONFIG)
    torch_init_(model, LAB_CONFIG, seed=0)
    out = []
    for x, y in _batches(None, world_size, k):
        model.zero_grad(set_to_none=True)
        (loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y)) / k).backward()
        out.append({n: p.grad.detach().numpy().astype(np.float64) for n, p in model.named_parameters()})
    return out


def _clip(grads: dict, max_norm: float) -> dict:
    """``clip_grad_norm_``'s arithmetic: scale by min(1, max_norm / (norm + 1e-6))."""
    coef = min(1.0, max_norm / (_norm(grads) + 1e-6))
    return {n: g * coef for n, g in grads.items()}


def _per_shard(grads: dict, world: int, max_norm: float) -> dict:
    """The classic bug, computed: each rank clips its own dim-0 shard (torch.chunk's rows) by its shard's norm."""
    out = {n: g.copy() for n, g in grads.items()}
    for r in range(world):
        pieces = {}
        for n, g in grads.items():
            rows = -(-g.shape[0] // world)
            pieces[n] = slice(r * rows, min((r + 1) * rows, g.shape[0]))
        coef = min(1.0, max_norm / (_norm({n: grads[n][sl] for n, sl in pieces.items()}) + 1e-6))
        for n, sl in pieces.items():
            out[n][sl] = grads[n][sl] * coef
    return out


def _norm(grads) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(g, dtype=np.float64) ** 2)) for g in grads.values()))


def _close(got: dict, want: dict) -> bool:
    return all(got.get(n) is not None and np.shape(got[n]) == np.shape(w)
               and np.allclose(np.asarray(got[n], dtype=np.float64), w, rtol=_RTOL, atol=_ATOL)
               for n, w in want.items())


def _count(rows, op: str) -> int:
    return sum(1 for row in rows if isinstance(row, (list, tuple)) and row and row[0] == op)


def judge_accumulate_and_clip(data: dict, world_size: int = 4, k: int = K, max_norm: float = MAX_NORM,
                              name: str = "accumulate_and_clip") -> str:
    """Judge half: the gradients and the norm against one process on the same micro-batches (computed here), the
    reduce-scatters against one per unit, with the likely mistake named."""
    ranks = data.get("ranks") if isinstance(data, dict) else None
    if not isinstance(ranks, list) or len(ranks) != world_size or not all(isinstance(o, dict) for o in ranks):
        raise AssertionError(f"no result from each of {world_size} ranks")
    o = ranks[0]
    grads, rows = o.get("grads"), o.get("ops") if isinstance(o.get("ops"), list) else []
    per_micro = reference_grads(k, world_size)
    ref = {n: sum(g[n] for g in per_micro) for n in per_micro[0]}
    if not isinstance(grads, dict) or set(grads) != set(ref):
        raise AssertionError("the run read no gradient for each parameter of the model")
    units = 1 + LAB_CONFIG.n_layers
    rs, ar = _count(rows, "reduce_scatter"), _count(rows, "all_reduce")
    norm = _norm(ref)
    missing = sorted(n for n, g in grads.items() if g is None)
    if missing:
        why = ("gradient sync was never re-enabled: with set_requires_gradient_sync(False) on every micro-batch "
               "FSDP2 keeps the gradients unsharded and unreduced, and the sharded parameters' .grad stays None; "
               "set it True before the last micro-batch's backward" if rs == 0 else
               "some parameters received no gradient: run every micro-batch through the whole model")
        raise AssertionError(f"{len(missing)} of {len(ref)} parameters have no gradient after the call "
                             f"({missing[0]}, ...); {rs} reduce-scatters were issued\n   likely mistake: {why}")
    if not _close(grads, _clip(ref, max_norm)):
        early = {n: np.zeros_like(g) for n, g in ref.items()}
        for g in per_micro:                            # clipped after every micro-batch, as it accumulates
            early = _clip({n: early[n] + g[n] for n in g}, max_norm)
        if _close(grads, ref) or _close(grads, {n: g * k for n, g in ref.items()}):
            why = f"the gradient was not clipped: its norm is above max_norm={max_norm}; clip it once, at the end"
        elif _close(grads, _per_shard(ref, world_size, max_norm)) \
                or _close(grads, _per_shard({n: g * k for n, g in ref.items()}, world_size, max_norm)):
            why = ("per-shard clipping: the norm of the local shard only -- each rank scaled its shard by its own "
                   "coefficient, so the whole gradient is no longer the clipped mean (clip_grad_norm_ over the "
                   "DTensor gradients computes the norm across the ranks: one all-reduce)")
        elif _close(grads, early):
            why = ("each micro-batch's running sum was clipped before the accumulation finished: clip once, after "
                   "the last backward")
        else:
            why = "accumulate the mean over the k micro-batches (loss / k), then clip the whole gradient once"
        raise AssertionError(f"the gradients differ from one process's clipped mean gradient (norm of yours "
                             f"{_norm(grads):.4g}, expected {min(norm, max_norm):.4g})\n   likely mistake: {why}")
    returned = o.get("returned") if isinstance(o.get("returned"), dict) else {}
    val = returned.get("values")
    arr = np.asarray(val, dtype=np.float64) if isinstance(val, (int, float, np.ndarray)) \
        and not isinstance(val, bool) else None
    if arr is None or arr.size != 1:
        shown = val.get("unplain") if isinstance(val, dict) and "unplain" in val else returned.get("type")
        raise AssertionError(f"{name} returned {shown}; return the total norm before clipping (a number or a "
                             "0-d tensor: what torch.nn.utils.clip_grad_norm_ returns)")
    got = float(arr.reshape(()))
    if not math.isclose(got, norm, rel_tol=1e-4):
        rows0 = {n: g[:-(-g.shape[0] // world_size)] for n, g in ref.items()}    # rank 0's dim-0 shard
        if math.isclose(got, k * norm, rel_tol=1e-4):
            why = ("the loss of each micro-batch was not divided by k: the gradients add up to k times the mean "
                   "(clipping hid it in the gradients, not in their norm)")
        elif math.isclose(got, _norm(rows0), rel_tol=1e-4):
            why = "per-shard clipping: the norm of the local shard only (rank 0's shard)"
        else:
            why = "the total norm returned must be the whole gradient's norm before clipping"
        raise AssertionError(f"rank 0 returned the norm {got:.6g}, expected {norm:.6g} (one process, before "
                             f"clipping)\n   likely mistake: {why}")
    others = [x.get("returned", {}).get("values") if isinstance(x.get("returned"), dict) else None for x in ranks]
    if any(not isinstance(v, (float, int, np.ndarray)) or not math.isclose(float(np.asarray(v).reshape(())), got,
                                                                           rel_tol=1e-6) for v in others):
        raise AssertionError("the ranks returned different norms\n   likely mistake: per-shard clipping: the norm "
                             "of the local shard only, on some ranks")
    if rs != units:
        why = (f"a sync every micro-batch: the numbers are right, but {rs} reduce-scatters ({rs // units} per unit) "
               f"instead of {units}: call set_requires_gradient_sync(False) before the first {k - 1} backward "
               "passes (FSDP2 has no no_sync(); a stand-in that does nothing syncs every time)"
               if rs == k * units else f"one reduce-scatter per unit ({units}) in the whole call")
        raise AssertionError(f"rank 0 issued {rs} reduce-scatters over {k} micro-batches, expected {units}\n"
                             f"   likely mistake: {why}")
    if ar < 1:
        raise AssertionError("no all-reduce of the norm: the norm cannot be global\n   likely mistake: per-shard "
                             "clipping: the norm of the local shard only")
    return (f"{k} micro-batches, {rs} reduce-scatters (one per unit, on the last), total norm {got:.4f} "
            f"computed across the ranks ({ar} all-reduce), clipped to {max_norm}: the one-process gradients")


@exercise("04", "accumulate_and_clip", cell="def accumulate_and_clip(", hints=HINTS["accumulate_and_clip"],
          tests=TESTS["accumulate_and_clip"],
          mistakes={"per-shard clipping": "per-shard clipping: the norm of the local shard only",
                    "missing sync": "gradient sync was never re-enabled",
                    "sync every micro-batch": "a sync every micro-batch",
                    "not divided by k": "not divided by k", "not clipped": "the gradient was not clipped",
                    "clipped too early": "clipped before the accumulation finished",
                    "wrong norm": "the total norm returned must be", "not a norm": "return the total norm"},
          guards=("cost",), judge=judge_accumulate_and_clip)
def check_accumulate_and_clip(fn, world_size: int = 4, name: str = "accumulate_and_clip") -> bool:
    """``fn(model, micro_batches, loss_fn, max_norm)``: the mean gradient of the micro-batches, one sync, the global
    norm clipped; returns the norm before clipping."""
    fn = _guard(fn, "04", "accumulate_and_clip")
    return decide(name, lab="04", tests=TESTS["accumulate_and_clip"],
                  run=lambda: run_accumulate_and_clip(fn, world_size),
                  judge=judge_accumulate_and_clip, params={"world_size": world_size, "name": name})
