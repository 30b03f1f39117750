"""Lab 01's exercise checks, each split in two (:mod:`course_lib.checks.judge`): a *run half* calls the learner's
function (on gloo ranks, or under ``jax.shard_map``) on the check's inputs and returns what came out as plain data
-- gradients and weights after the call, buckets as positions of the parameters given, the loss and gradients with
their dtype, the masks drawn with the keys, the collectives issued -- and a *judge half* rebuilds the inputs,
computes the single-process answer itself and names the likely mistake (see :mod:`course_lib.checks`).

The references they stand in for are in :mod:`course_lib.strategies.dp.torch`.

Longer than ~300 lines: four exercise checks (two in torch, two in JAX), each with its run half, the diagnoses of
its classic mistakes and a second run at another world size or key, so that an argument the answer ignores shows.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from course_lib import checks as _checks
from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise
from course_lib.strategies.dp.torch import make_buckets

__all__ = ["check_average_gradients", "check_make_buckets", "check_jax_dp_value_and_grad", "check_jax_device_key",
           "judge_average_gradients", "judge_make_buckets", "judge_dp_value_and_grad", "judge_device_key", "HINTS"]

HINTS = {
    "average_gradients": [
        "Each rank holds the gradient of its own slice of the batch; the whole batch's gradient is the MEAN of "
        "those N gradients, and every rank must end with the same one.",
        "A sum over ranks is one collective, done in place on each p.grad; then scale by 1/N once. "
        "Skip parameters without a gradient.",
        "for p in model.parameters(): if p.grad is not None: dist.all_reduce(p.grad); p.grad /= dist.get_world_size()",
    ],
    "make_buckets": [
        "Backward produces gradients last layer first, so buckets fill in reverse parameter order; a bucket is "
        "sent when adding the next tensor would exceed the cap.",
        "Measure a tensor in bytes (elements × bytes per element). A tensor bigger than the cap gets a bucket of "
        "its own; never leave an empty bucket.",
        "for p in reversed(list(params)): size = p.numel() * p.element_size(); if current and total + size > cap: "
        "close current; append p",
    ],
    "dp_value_and_grad": [
        "The whole batch's loss is the mean over devices of each device's loss; differentiate THAT, and the "
        "gradient comes out averaged and identical everywhere.",
        "Put the cross-device mean inside the function you differentiate, so autodiff inserts the collective "
        "for you; averaging the gradient afterwards as well would divide twice.",
        "jax.value_and_grad(lambda p: jax.lax.pmean(loss_fn(p, x, y), 'dp'))(params)",
    ],
    "device_key": [
        "Every device gets the same key; derive a different one per device from something only that device knows.",
        "The device's position along the mesh axis is known inside shard_map; mix it into the key "
        "deterministically (no new randomness).",
        "jax.random.fold_in(key, jax.lax.axis_index('dp'))",
    ],
}


# -- exercise 1: average the gradients (torch, on ranks) ------------------------------------------------
def _awkward_mlp() -> nn.Module:
    """17 -> 257 -> 5: sizes that divide by nothing, so a slicing or padding mistake shows."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 257), nn.Tanh(), nn.Linear(257, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _batch(batch: int):
    """The global batch (x, y): every rank makes the same one and keeps its own rows."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 17, generator=g), torch.randn(batch, 5, generator=g)


def _local_backward(model: nn.Module, batch: int, r: int, n: int) -> None:
    """Rank ``r`` of ``n``'s backward: the loss of its own rows of the batch."""
    x, y = _batch(batch)
    rows = slice(r * batch // n, (r + 1) * batch // n)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()


def _grads_on_rank(fn, batch: int) -> dict:
    """Run half, on one rank: one DP backward on this rank's rows, then ``fn(model)``; the gradients and the
    weights it left, as plain data."""
    from course_lib.comm import torch_ledger as lt
    model = _awkward_mlp()
    _local_backward(model, batch, dist.get_rank(), dist.get_world_size())
    lt.recorder().reset()
    fn(model)
    return _plain.plain({"grads": [p.grad for p in model.parameters()],
                         "weights": [p.detach() for p in model.parameters()]})


def run_average_gradients(fn, world_size: int, batch: int) -> dict:
    """Run half: on ``world_size`` ranks, then on a second world size: every rank's outcome and rank 0's ops."""
    from course_lib.launch import run
    out = {}
    for ws in (world_size, 3 if world_size == 2 else 2):
        res = run(_grads_on_rank, fn, batch, world_size=ws)
        out[str(ws)] = {"ranks": list(res), "ops": [r.op for r in res.ledger.filter(rank=0)]}
    return out


def _average_gradients_reference(ws: int, batch: int) -> dict:
    """Judge side: the weights before, the whole batch's gradient (one process, all rows) and each of ``ws``
    ranks' own gradient (the input ``fn`` was given)."""
    model = _awkward_mlp()
    weights = [p.detach().numpy().copy() for p in model.parameters()]
    x, y = _batch(batch)
    nn.functional.mse_loss(model(x), y).backward()
    local = []
    for r in range(ws):
        m = _awkward_mlp()
        _local_backward(m, batch, r, ws)
        local.append([p.grad.numpy() for p in m.parameters()])
    return {"weights": weights, "ref": [p.grad.numpy() for p in model.parameters()], "local": local}


def _hard_coded_n(got0, ref0, world_size: int, assumed: int) -> str | None:
    """On ``world_size`` ranks the gradients came out ``world_size / assumed`` × the mean: divided by a fixed
    ``assumed`` instead of the group's size."""
    if isinstance(got0, np.ndarray) and got0.shape == ref0.shape \
            and np.allclose(got0, ref0 * world_size / assumed, rtol=1e-4, atol=1e-7):
        return (f"on {world_size} ranks the gradients are {world_size}/{assumed} of the mean: you divided by "
                f"{assumed} whatever the world size; divide by the number of ranks in the group, asked at run time")
    return None


def judge_average_gradients(data: dict, world_size: int = 4, batch: int = 12, name: str = "average_gradients") -> str:
    """Judge half: every rank's gradients against the whole batch's (one process), on both world sizes."""
    names = [n for n, _ in _awkward_mlp().named_parameters()]
    for ws in (world_size, 3 if world_size == 2 else 2):
        run = data.get(str(ws)) if isinstance(data, dict) else None
        res = run.get("ranks") if isinstance(run, dict) else None
        if not isinstance(res, list) or len(res) != ws or not all(
                isinstance(o, dict) and isinstance(o.get("grads"), list) and len(o["grads"]) == len(names)
                and isinstance(o.get("weights"), list) and len(o["weights"]) == len(names) for o in res):
            raise AssertionError(f"no result from each of {ws} ranks")
        ref = _average_gradients_reference(ws, batch)
        wrong_n = _hard_coded_n(res[0]["grads"][0], ref["ref"][0], ws, world_size) if ws != world_size else None
        if wrong_n:
            raise AssertionError(wrong_n)
        for r in range(ws):
            if not all(isinstance(w, np.ndarray) and np.array_equal(w, w0)
                       for w, w0 in zip(res[r]["weights"], ref["weights"])):
                raise AssertionError(f"rank {r}'s weights changed: average the gradients only; the step comes later")
            for i, pname in enumerate(names):
                got = res[r]["grads"][i]
                if not isinstance(got, np.ndarray):
                    raise AssertionError(f"rank {r}: {pname}.grad is {'None' if got is None else 'not a tensor'} "
                                         f"after {name}(model): leave the averaged gradient in every p.grad")
                local = [ref["local"][q][i] for q in range(ws)]
                no_comm = lambda g, e, mine=local[r] / ws: (  # noqa: E731
                    "got is this rank's own gradient ÷N → you divided but never all-reduced"
                    if np.allclose(g, mine, rtol=1e-4, atol=1e-7) else None)
                summed = lambda g, e, ws=ws: (  # noqa: E731  (loose: a sum in another order differs in the last bits)
                    f"got is {ws}× expected → you summed instead of averaging (forgot ÷{ws})"
                    if np.allclose(g, ws * e, rtol=1e-3, atol=1e-6) else None)
                _checks.assert_close(f"{pname}.grad (on {ws} ranks)", got, ref["ref"][i], rtol=1e-5, atol=1e-6,
                                     rank=r, hint=[summed, _checks.averaged_twice(ws),
                                                   _checks.skipped_collective(local), no_comm])
    ops = Counter(data[str(world_size)].get("ops") or [])
    return f"every rank holds the whole-batch gradient; rank 0 issued {dict(ops)} for {len(names)} tensors"


@exercise("01", 'average_gradients', cell='def average_gradients(', hints=HINTS['average_gradients'],
          guards=("argument",),
          mistakes={'world size hard-coded': 'whatever the world size',
                    'summed, not averaged': 'summed instead of averaging', 'averaged twice': 'averaged twice',
                    'never all-reduced': 'divided but never all-reduced', 'nothing done': 'collective was skipped',
                    'stepped': 'weights changed'},
          judge=judge_average_gradients,
          references=("course_lib.strategies.dp.torch.average_gradients_",
                      "course_lib.strategies.dp.torch.all_reduce_mean_"))
def check_average_gradients(fn, world_size: int = 4, batch: int = 12, name: str = "average_gradients") -> bool:
    """Exercise check: after ``fn(model)`` on every rank, each ``p.grad`` is the gradient of the whole
    batch (computed by one process), on every rank, for a 17x257x5 MLP; on ``world_size`` ranks, then on
    a second world size (2, or 3 when ``world_size`` is 2), so that a world size written in does not pass."""
    other = 3 if world_size == 2 else 2
    fn = _guard(fn, "01", "average_gradients")
    return decide(name, lab="01", tests=f"after one backward on {world_size} ranks, then on {other}, every gradient "
                  "equals the whole-batch gradient (the mean over ranks, not the sum) on every rank",
                  run=lambda: run_average_gradients(fn, world_size, batch), judge=judge_average_gradients,
                  params={"world_size": world_size, "batch": batch, "name": name})


# -- exercise 2: DDP's buckets -----------------------------------------------------------------------------------
def _greedy(sizes: list, cap: int, *, forward: bool = False, close_at_cap: bool = False,
            check_after: bool = False) -> list[list[int]]:
    """Indices of the buckets a greedy walk makes (``sizes`` in bytes, in parameter order): the exercise's
    rule by default; each keyword is one classic departure from it, to name a mistake by what it produces."""
    order = range(len(sizes)) if forward else range(len(sizes) - 1, -1, -1)
    out, cur, size = [], [], 0
    for i in order:
        if check_after:
            cur.append(i)
            size += sizes[i]
            if size > cap:
                out.append(cur)
                cur, size = [], 0
            continue
        if cur and (size + sizes[i] >= cap if close_at_cap else size + sizes[i] > cap):
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += sizes[i]
    return out + ([cur] if cur else [])


_BUCKET_CASES = [   # (numels, dtypes or None for float32, cap_bytes)
    ((10, 10, 30, 5), None, 64), ((17 * 257, 257, 5 * 257, 5), None, 4096), ((3, 4, 5), None, 10**6),
    ((8, 8, 8, 8), None, 32),
    ((8, 8, 16), None, 64),        # two 32-byte tensors fill a 64-byte bucket exactly: one bucket, not two
    ((4, 100), None, 64),          # the first tensor walked (400 bytes) is bigger than the cap: alone, no empty bucket
    ((12, 4, 8, 2), ("bfloat16", "float32", "bfloat16", "float64"), 48),   # bytes per element differ
]


def _itemsizes(dtypes) -> list[int]:
    return [torch.empty(0, dtype=getattr(torch, d)).element_size() for d in dtypes]


#: Classic departures from the rule, each as what it would produce on a case (numels, itemsizes, cap), and
#: the likely mistake it names. A departure is named only when it reproduces the answer on EVERY case.
_BUCKET_DEPARTURES = [
    (lambda k, e, cap: _greedy([a * b for a, b in zip(k, e)], cap, forward=True),
     "backward produces gradients last layer first: walk the parameters in reverse"),
    (lambda k, e, cap: _greedy([4 * a for a in k], cap),
     "every element counted as 4 bytes: the bytes per element depend on the dtype (element_size())"),
    (lambda k, e, cap: _greedy(list(k), cap),
     "a bucket exceeds cap_bytes: sizes counted in elements, not bytes (bytes = elements × bytes per element)"),
    (lambda k, e, cap: _greedy([a * b for a, b in zip(k, e)], cap, check_after=True),
     "a bucket exceeds cap_bytes: the tensor was added before checking the cap, so the bucket overflows"),
    (lambda k, e, cap: _greedy([a * b for a, b in zip(k, e)], cap, close_at_cap=True),
     "a bucket may hold exactly cap_bytes ('at most'): close it only when the next tensor would go *over* the "
     "cap (>, not >=)"),
    (lambda k, e, cap: [list(range(len(k) - 1, -1, -1))],
     "everything in one bucket in every case, whatever cap_bytes: cap_bytes is never used"),
]


def _bucket_mistake(runs, bad: int) -> str:
    """The likely mistake, from the answers to every case (``runs``: (numels, dtypes, cap, got, expected)
    index buckets); ``bad`` is the first case that differs."""
    numels, dtypes, cap, got_i, exp_i = runs[bad]
    nbytes = [k * e for k, e in zip(numels, _itemsizes(dtypes))]
    flat = [i for b in got_i for i in b]
    if any(len(b) == 0 for b in got_i):
        return ("an empty bucket: a tensor bigger than the cap closed a bucket that held nothing; close the "
                "current bucket only when it holds something")
    if sorted(flat) != list(range(len(numels))):
        return "every parameter must be in exactly one bucket (return the parameters themselves)"
    for produce, why in _BUCKET_DEPARTURES:
        if all(got == produce(k, _itemsizes(d), c) for k, d, c, got, _ in runs):
            return why
    if any(len(b) > 1 and sum(nbytes[i] for i in b) > cap for b in got_i):
        return "a bucket exceeds cap_bytes (bytes = elements × bytes per element)"
    return "compare your buckets with the expected ones above, tensor by tensor"


def _bucket_params(numels, dtypes) -> list[torch.Tensor]:
    return [torch.zeros(k, dtype=getattr(torch, d), requires_grad=True) for k, d in zip(numels, dtypes)]


def _items(value) -> list:
    """What a container holds, as it holds it: a list or tuple subclass's own ``__iter__`` is not asked."""
    if isinstance(value, list):
        return list(list.__iter__(value))
    if isinstance(value, tuple):
        return list(tuple.__iter__(value))
    return list(value)                                 # any other iterable; TypeError when it is none


def run_make_buckets(fn) -> dict:
    """Run half: for every case, the learner's buckets as positions of the parameters given (-1: a tensor that is
    not one of them; None: not a list of buckets) and the list it was handed, as positions, after the call."""
    out = []
    for numels, dtypes, cap in _BUCKET_CASES:
        ps = _bucket_params(numels, dtypes or ("float32",) * len(numels))
        given = list(ps)
        got = fn(given, cap)
        idx = {id(p): i for i, p in enumerate(ps)}
        try:
            buckets = [[idx.get(id(p), -1) for p in _items(b)] for b in _items(got)]
        except TypeError:
            buckets = None
        out.append({"given": [idx.get(id(p), -1) for p in given], "buckets": buckets, "type": _plain.type_name(got)})
    return {"cases": out}


def judge_make_buckets(data: dict, name: str = "make_buckets") -> str:
    """Judge half: every case's buckets against :func:`~course_lib.strategies.dp.torch.make_buckets` on the same
    parameters; the mistake named from the answers to all of them."""
    cases = data.get("cases") if isinstance(data, dict) else None
    if not isinstance(cases, list) or len(cases) != len(_BUCKET_CASES) or not all(isinstance(o, dict) for o in cases):
        raise AssertionError(f"{name} was not run on every case; return a list of buckets for each")
    runs = []                                  # every case's answer first: a mistake is named from all of them
    for (numels, dtypes, cap), o in zip(_BUCKET_CASES, cases):
        dtypes = dtypes or ("float32",) * len(numels)
        given = o.get("given")
        if given != list(range(len(numels))):
            raise AssertionError(f"{name}(numels={list(numels)}, cap_bytes={cap}) changed the list it was given "
                                 f"(now {len(given) if isinstance(given, list) else '?'} tensors, in another order "
                                 "or others) → reordered the caller's list in place (params.reverse(), .sort(), "
                                 ".pop()): the caller's parameter list is not theirs any more; walk reversed(params) "
                                 "or a copy instead")
        got_i = o.get("buckets")
        if not (isinstance(got_i, list) and all(isinstance(b, list) and all(type(i) is int for i in b) for b in got_i)):
            raise AssertionError(f"{name} returned {o.get('type')}; return a list of buckets, each a list "
                                 "of parameters")
        ps = _bucket_params(numels, dtypes)
        idx = {id(p): i for i, p in enumerate(ps)}
        runs.append((numels, dtypes, cap, got_i, [[idx[id(p)] for p in b] for b in make_buckets(ps, cap)]))
    bad = next((i for i, run in enumerate(runs) if run[3] != run[4]), None)
    if bad is not None:
        numels, dtypes, cap, got_i, exp_i = runs[bad]
        kinds = "" if len(set(dtypes)) == 1 and dtypes[0] == "float32" else f", dtypes={list(dtypes)}"
        raise AssertionError(f"{name}(numels={list(numels)}{kinds}, cap_bytes={cap}) gave buckets of tensors "
                             f"{got_i}, expected {exp_i}\n   likely mistake: " + _bucket_mistake(runs, bad))
    return f"{len(_BUCKET_CASES)} cases match (reverse order, greedy, a big tensor alone)"


@exercise("01", 'make_buckets', cell='def my_make_buckets(', hints=HINTS['make_buckets'],
          guards=("boundary", "argument", "cost"),
          mistakes={'empty bucket': 'an empty bucket', 'lost parameter': 'exactly one bucket',
                    'forward order': 'walk the parameters in reverse', 'dtype ignored': 'depend on the dtype',
                    'cap ignored': 'cap_bytes is never used', 'over the cap': 'a bucket exceeds cap_bytes',
                    'exact fit split': "a bucket may hold exactly cap_bytes",
                    'not a list of buckets': 'return a list of buckets',
                    'input reordered': "reordered the caller's list in place"},
          judge=judge_make_buckets, references=("course_lib.strategies.dp.torch.make_buckets",))
def check_make_buckets(fn, name: str = "make_buckets") -> bool:
    """Exercise check: ``fn(params, cap_bytes)`` groups like :func:`make_buckets` (reverse order, greedy),
    on float32 and mixed-dtype parameters, an exact fit and a tensor bigger than the cap."""
    fn = _guard(fn, "01", "make_buckets")
    return decide(name, lab="01", tests="buckets in reverse parameter order, each at most cap_bytes (a bigger tensor "
                  "alone), covering every parameter once", run=lambda: run_make_buckets(fn), judge=judge_make_buckets,
                  params={"name": name})


# -- exercises 3 and 4, in JAX: what crosses is an array with its element type ----------------------------------
def _received(sent, what: str) -> np.ndarray:
    """Judge half: the array a :func:`_sent` value holds, typed as the learner's was (bfloat16 stays bfloat16, so
    that :func:`~course_lib.checks.assert_close` names a lost cast)."""
    if not (isinstance(sent, dict) and isinstance(sent.get("values"), np.ndarray)):
        raise AssertionError(f"{what} is a {sent.get('type') if isinstance(sent, dict) else type(sent).__name__}, "
                             "not an array")
    if sent.get("dtype") == "bfloat16":
        import ml_dtypes
        return sent["values"].astype(ml_dtypes.bfloat16)
    return sent["values"]


def _mesh_params(mesh) -> dict:
    """The mesh as the judge gets it: plain shape and axis names."""
    return {"mesh_shape": tuple(int(s) for s in mesh.devices.shape), "axis_names": tuple(mesh.axis_names)}


def _on_the_mesh(data, mesh_shape, axis_names) -> int:
    """The device count the judge expects; AssertionError when the run half ran on another mesh."""
    n = math.prod(mesh_shape)
    got = data.get("devices") if isinstance(data, dict) else None
    if got != n:
        raise AssertionError(f"the check ran on {got} devices; the lab's mesh has {n} (axis {axis_names[0]!r}): "
                             "pass the lab's mesh")
    return n


def _vg_inputs(n: int):
    """A 17x5 linear model's params and a batch of 2 rows per device."""
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((17, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    x, y = rng.standard_normal((2 * n, 17)).astype(np.float32), rng.standard_normal((2 * n, 5)).astype(np.float32)
    return params, x, y


def _lin_loss(p, x, y):
    import jax.numpy as jnp
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


def run_dp_value_and_grad(fn, mesh) -> dict:
    """Run half: ``fn(loss_fn, params, x, y)`` under ``jax.shard_map`` (batch sharded, params replicated, default
    ``check_vma``); every device's loss and gradients side by side, the shape of what came back, and the compiled
    program's collectives."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from course_lib.comm.jax_ledger import from_compiled
    (axis,), n = mesh.axis_names, mesh.devices.size
    params, x, y = _vg_inputs(n)

    def loss_fn(p, x, y):     # the learner's loss_fn (a name of its own, for a TypeError's text)
        return _lin_loss(p, x, y)

    def per_device(p, x, y):  # every device's answer side by side: [n, ...]
        return jax.tree.map(lambda a: jnp.asarray(a)[None], fn(loss_fn, p, x, y))

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P(axis)))
    out = f(params, x, y)
    hlo = from_compiled(f.lower(params, x, y).compile(), mesh)
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    return {"devices": n,
            "out": {"type": type(out).__name__,
                    "items": [type(o).__name__ for o in out] if isinstance(out, (tuple, list)) else None},
            "loss": _plain.typed(out[0], ("jax",)) if pair else None,
            "grads": {str(k): _plain.typed(v, ("jax",)) for k, v in out[1].items()} if pair and isinstance(out[1], dict) else None,
            "hlo": [{"op": r.op, "nbytes": int(r.nbytes)} for r in hlo]}


def judge_dp_value_and_grad(data: dict, mesh_shape: tuple = (4,), axis_names: tuple = ("dp",),
                            name: str = "dp_value_and_grad") -> str:
    """Judge half: every device's loss and gradients against ``jax.value_and_grad`` of the whole batch (one
    process), then the compiled collectives. ``mesh_shape``/``axis_names``: the lab's mesh (4 devices, "dp")."""
    import jax
    n = _on_the_mesh(data, mesh_shape, axis_names)
    params, x, y = _vg_inputs(n)
    out, grads = data.get("out") or {}, data.get("grads")
    items = out.get("items") if isinstance(out, dict) else None
    if not (isinstance(out, dict) and out.get("type") in ("tuple", "list") and isinstance(items, list)
            and len(items) == 2 and isinstance(grads, dict) and set(grads) == set(params)):
        shown = str(out.get("type") if isinstance(out, dict) else "?") + (
            f" of ({', '.join(map(str, items))})" if isinstance(items, list) else "")
        raise AssertionError(f"{name} returned a {shown} → return (loss, grads): the loss first, then the "
                             f"gradients as a dict with the keys of params ({sorted(params)}), as "
                             "jax.value_and_grad returns them")
    loss = _received(data.get("loss"), f"{name}'s loss")
    grads = {k: _received(grads[k], f"{name}'s grad[{k!r}]") for k in params}
    ref_loss, ref_grads = jax.value_and_grad(_lin_loss)(params, x, y)
    vma = ("   likely mistake: inside shard_map (check_vma=True) jax.grad already psums the gradient of a "
           "replicated parameter; pmean it again and you get N x the mean. Take the gradient of "
           "pmean(loss) instead")
    for d in range(n):
        rows = slice(d * len(x) // n, (d + 1) * len(x) // n)
        if np.allclose(loss[d], _lin_loss(params, x[rows], y[rows]), rtol=1e-5, atol=1e-6):
            raise AssertionError(f"loss on device {d} is the loss of its own {len(x) // n} rows, not the whole "
                                 "batch's\n   likely mistake: no collective: average the per-device losses over "
                                 "the mesh axis (and so the gradients)")
        if np.allclose(loss[d], n * ref_loss, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"loss on device {d} is {n}x the whole batch's loss\n   likely mistake: psum "
                                 "SUMS the per-device losses (and so the gradients); the whole batch's loss is "
                                 "their mean: pmean, not psum")
        _checks.assert_close(f"loss on device {d}", loss[d], ref_loss, rtol=1e-5, atol=1e-6,
                             hint="return the loss of the whole batch: average the per-device losses")
        for k in ("w", "b"):
            got, exp = grads[k][d], np.asarray(ref_grads[k])
            if np.allclose(got, n * exp, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"grad[{k!r}] on device {d} is {n}x the whole-batch gradient\n{vma}")
            _checks.assert_close(f"grad[{k!r}] on device {d}", got, exp, rtol=1e-5, atol=1e-6,
                                 hint=[_checks.averaged_twice(n)])
    records = data.get("hlo")
    if not isinstance(records, list) or not all(isinstance(r, dict) and isinstance(r.get("op"), str)
                                                and type(r.get("nbytes")) is int for r in records):
        raise AssertionError("the compiled program's collectives did not come back: run the check as the lab's "
                             "cell calls it")
    ops = [r["op"] for r in records]
    need = 4 * (params["w"].size + params["b"].size + 1)       # the gradients and the loss, once
    if any(op != "all_reduce" for op in ops):
        raise AssertionError(f"the values are right, but the compiled program issues {ops}: it gathers the batch "
                             "(every device's rows), so every device computes the whole batch: no data "
                             "parallelism left, and the data crosses the wire. Keep each device on its own "
                             "rows; only the loss and the gradients need averaging")
    if sum(r["nbytes"] for r in records) > need:
        raise AssertionError(f"the values are right, but the compiled program all-reduces "
                             f"{sum(r['nbytes'] for r in records)} bytes ({ops}) where the gradients and the loss "
                             f"are {need}: a collective more than the one the backward pass inserts")
    return f"whole-batch loss and gradient on all {n} devices"


@exercise("01", 'dp_value_and_grad', cell='def dp_value_and_grad(', hints=HINTS['dp_value_and_grad'],
          guards=("cost",),
          mistakes={'pmean of the gradient': 'jax.grad already psums', 'psum of the loss': 'pmean, not psum',
                    'no collective': 'average the per-device losses', 'averaged twice': 'averaged twice',
                    'batch gathered': 'gathers the batch',
                    'extra all-reduce': 'a collective more than the one the backward pass inserts',
                    'not (loss, grads)': 'return (loss, grads)', 'dtype changed': 'where the reference is'},
          judge=judge_dp_value_and_grad, references=("course_lib.strategies.dp.torch.jax_dp_value_and_grad",))
def check_jax_dp_value_and_grad(fn, mesh, name: str = "dp_value_and_grad") -> bool:
    """Exercise check: ``fn(loss_fn, params, x, y)`` inside ``jax.shard_map`` over ``mesh``'s axis (batch
    sharded, params replicated, default ``check_vma``) returns the whole batch's loss and gradient on
    every device, for a 17x5 linear model."""
    fn = _guard(fn, "01", "dp_value_and_grad")
    return decide(name, lab="01", tests="on 4 devices the loss and every gradient equal the whole batch's, identical "
                  "on every device", run=lambda: run_dp_value_and_grad(fn, mesh), judge=judge_dp_value_and_grad,
                  params={**_mesh_params(mesh), "name": name})


def run_device_key(fn, mesh) -> dict:
    """Run half: a dropout-style mask drawn on every device with ``fn(key)``, for key(42) and then key(7); or
    the first line of jax.random's refusal when what came back is no key."""
    import jax
    from jax.sharding import PartitionSpec as P
    (axis,), n = mesh.axis_names, mesh.devices.size

    def masks(k):
        return jax.random.bernoulli(fn(k), 0.5, (1, 64))

    draw = jax.jit(jax.shard_map(masks, mesh=mesh, in_specs=P(), out_specs=P(axis)))
    try:
        got = np.asarray(draw(jax.random.key(42)))
    except TypeError as e:               # jax.random refuses what came back before any mask is drawn
        if "key" not in str(e):
            raise
        return {"devices": n, "not_a_key": str(e).splitlines()[0]}
    return {"devices": n, "masks": got, "masks_key7": np.asarray(draw(jax.random.key(7)))}


def judge_device_key(data: dict, mesh_shape: tuple = (4,), axis_names: tuple = ("dp",),
                     name: str = "device_key") -> str:
    """Judge half: the masks differ per device, follow the key given, and are those of ``fold_in(key, d)``
    (drawn here). ``mesh_shape``/``axis_names``: the lab's mesh (4 devices, "dp")."""
    import jax
    n, axis = _on_the_mesh(data, mesh_shape, axis_names), axis_names[0]
    if data.get("not_a_key") is not None:
        raise AssertionError(f"{name} returned something jax.random cannot use as a key ({data['not_a_key']})"
                             " → return a PRNG key: the given key with the device's index folded in")
    got, got7 = data.get("masks"), data.get("masks_key7")
    if not (isinstance(got, np.ndarray) and isinstance(got7, np.ndarray) and got.shape == got7.shape == (n, 64)):
        raise AssertionError(f"the masks drawn with {name}'s keys are not {n} rows of 64: return one PRNG key")
    key = jax.random.key(42)
    ref = np.stack([np.asarray(jax.random.bernoulli(jax.random.fold_in(key, d), 0.5, (64,))) for d in range(n)])
    if all((got[d] == got[0]).all() for d in range(n)):
        raise AssertionError(f"all {n} devices drew the same mask: the key must depend on which device this "
                             f"is (its index along the mesh axis {axis!r}), or every device drops the same units")
    if (got7 == got).all():
        raise AssertionError(f"given key(42) and then key(7), the masks came out identical: your answer "
                             "ignores the key it is given (it makes a new one); derive each device's key from "
                             "the key passed in, so that a new seed gives new masks")
    if not (got == ref).all():
        raise AssertionError("masks differ per device (good), but are not the masks the course expects: mix "
                             f"the device's index along {axis!r} into the given key with jax.random's "
                             "function for that, nothing else (no split, no offset)")
    return f"{n} devices, {n} different masks, each from fold_in(key, axis_index)"


@exercise("01", 'device_key', cell='def device_key(', hints=HINTS['device_key'], guards=("argument",),
          mistakes={'same key everywhere': 'drew the same mask', 'key ignored': 'ignores the key it is given',
                    'another derivation': 'not the masks the course expects',
                    'not a key': 'return a PRNG key'},
          judge=judge_device_key, references=("course_lib.strategies.dp.torch.jax_device_key",))
def check_jax_device_key(fn, mesh, name: str = "device_key") -> bool:
    """Exercise check: ``fn(key)`` inside ``shard_map`` gives device ``d`` the key ``fold_in(key, d)``."""
    fn = _guard(fn, "01", "device_key")
    return decide(name, lab="01", tests="every device gets a different key, the same call twice gives the same keys, "
                  "and it depends on the key given", run=lambda: run_device_key(fn, mesh), judge=judge_device_key,
                  params={**_mesh_params(mesh), "name": name})
