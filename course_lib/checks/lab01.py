"""Lab 01's exercise checks: each runs the learner's function (on gloo ranks, or under ``jax.shard_map``)
and compares it with the single-process answer, naming the likely mistake (see :mod:`course_lib.checks`).

The references they stand in for are in :mod:`course_lib.strategies.dp.torch`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib import checks as _checks
from course_lib.strategies.dp.torch import make_buckets
from course_lib.checks.registry import exercise

__all__ = ["check_average_gradients", "check_make_buckets", "check_jax_dp_value_and_grad", "check_jax_device_key",
           "HINTS"]

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


def _awkward_mlp() -> nn.Module:
    """17 -> 257 -> 5: sizes that divide by nothing, so a slicing or padding mistake shows."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 257), nn.Tanh(), nn.Linear(257, 5))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _grads_on_rank(fn, batch: int) -> dict:
    """One DP backward on this rank's slice, then ``fn(model)``; the whole-batch gradient as reference."""
    import copy

    from course_lib.comm import torch_ledger as lt
    r, n = dist.get_rank(), dist.get_world_size()
    model = _awkward_mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 17, generator=g), torch.randn(batch, 5, generator=g)   # the global batch
    ref = copy.deepcopy(model)
    nn.functional.mse_loss(ref(x), y).backward()                                      # one process, all rows
    rows = slice(r * batch // n, (r + 1) * batch // n)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()                        # this rank's rows
    local = [p.grad.clone() for p in model.parameters()]
    lt.recorder().reset()
    fn(model)
    return {"got": [p.grad for p in model.parameters()], "ref": [p.grad for p in ref.parameters()],
            "local": local, "weights_same": all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))}


@exercise("01", 'average_gradients', cell='def average_gradients(', hints=HINTS['average_gradients'],
          mistakes={'summed, not averaged': 'summed instead of averaging'})
def check_average_gradients(fn, world_size: int = 4, batch: int = 12, name: str = "average_gradients") -> bool:
    """Exercise check: after ``fn(model)`` on every rank, each ``p.grad`` is the gradient of the whole
    batch (computed by one process), on every rank, for a 17x257x5 MLP."""
    import numpy as np

    from course_lib import checks
    from course_lib.launch import run
    names = [n for n, _ in _awkward_mlp().named_parameters()]
    with checks.check(name, tests='after one backward on 4 ranks, every gradient equals the whole-batch gradient (the mean over ranks, not the sum) on every rank') as c:
        res = run(_grads_on_rank, fn, batch, world_size=world_size)
        for r in range(world_size):
            if not res[r]["weights_same"]:
                raise AssertionError(f"rank {r}'s weights changed: average the gradients only; the step comes later")
            for i, pname in enumerate(names):
                local = [res[q]["local"][i] for q in range(world_size)]
                no_comm = lambda g, e, mine=local[r].numpy() / world_size: (  # noqa: E731
                    "got is this rank's own gradient ÷N → you divided but never all-reduced"
                    if np.allclose(g, mine, rtol=1e-4, atol=1e-7) else None)
                summed = lambda g, e: (  # noqa: E731  (loose: a sum in another order differs in the last bits)
                    f"got is {world_size}× expected → you summed instead of averaging (forgot ÷{world_size})"
                    if np.allclose(g, world_size * e, rtol=1e-3, atol=1e-6) else None)
                checks.assert_close(f"{pname}.grad", res[r]["got"][i], res[r]["ref"][i], rtol=1e-5, atol=1e-6, rank=r,
                                    hint=[summed, checks.averaged_twice(world_size), checks.skipped_collective(local),
                                          no_comm])
        ops = res.ledger.filter(rank=0).counts()
        c.ok(f"every rank holds the whole-batch gradient; rank 0 issued {dict(ops)} for {len(names)} tensors")
    return bool(c.passed)


@exercise("01", 'make_buckets', cell='def my_make_buckets(', hints=HINTS['make_buckets'],
          mistakes={'forward order': 'reverse', 'exact fit split': "a bucket may hold exactly cap_bytes"})
def check_make_buckets(fn, name: str = "make_buckets") -> bool:
    """Exercise check: ``fn(params, cap_bytes)`` groups like :func:`make_buckets` (reverse order, greedy)."""
    from course_lib import checks
    cases = [((10, 10, 30, 5), 64), ((17 * 257, 257, 5 * 257, 5), 4096), ((3, 4, 5), 10**6), ((8, 8, 8, 8), 32),
             ((8, 8, 16), 64)]   # the last: two 32-byte tensors fill a 64-byte bucket exactly, and may
    with checks.check(name, tests='buckets in reverse parameter order, each at most cap_bytes (a bigger tensor alone), covering every parameter once') as c:
        for numels, cap in cases:
            ps = [torch.zeros(k, requires_grad=True) for k in numels]
            got = fn(ps, cap)
            idx = {id(p): i for i, p in enumerate(ps)}
            got_i = [[idx.get(id(p), -1) for p in b] for b in got]
            exp_i = [[idx[id(p)] for p in b] for b in make_buckets(ps, cap)]
            if got_i == exp_i:
                continue
            msg = f"{name}(numels={list(numels)}, cap_bytes={cap}) gave buckets of tensors {got_i}, expected {exp_i}"
            flat = [i for b in got_i for i in b]
            if sorted(flat) != list(range(len(ps))):
                msg += "\n   likely mistake: every parameter must be in exactly one bucket (return the parameters themselves)"
            elif flat == sorted(flat):
                msg += "\n   likely mistake: backward produces gradients last layer first: walk the parameters in reverse"
            elif any(len(b) > 1 and sum(4 * numels[i] for i in b) > cap for b in got_i):
                msg += "\n   likely mistake: a bucket exceeds cap_bytes (bytes = numel * element_size(), 4 for float32)"
            elif any(sum(4 * numels[i] for i in b) == cap for b in exp_i if len(b) > 1):
                msg += ("\n   likely mistake: a bucket may hold exactly cap_bytes ('at most'): close it only when the "
                        "next tensor would go *over* the cap (>, not >=)")
            raise AssertionError(msg)
        c.ok(f"{len(cases)} cases match (reverse order, greedy, a big tensor alone)")
    return bool(c.passed)


@exercise("01", 'dp_value_and_grad', cell='def dp_value_and_grad(', hints=HINTS['dp_value_and_grad'],
          mistakes={'pmean of the gradient': 'jax.grad already psums'})
def check_jax_dp_value_and_grad(fn, mesh, name: str = "dp_value_and_grad") -> bool:
    """Exercise check: ``fn(loss_fn, params, x, y)`` inside ``jax.shard_map`` over ``mesh``'s axis (batch
    sharded, params replicated, default ``check_vma``) returns the whole batch's loss and gradient on
    every device, for a 17x5 linear model."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from course_lib import checks
    (axis,), n = mesh.axis_names, mesh.devices.size
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((17, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}
    x, y = rng.standard_normal((2 * n, 17)).astype(np.float32), rng.standard_normal((2 * n, 5)).astype(np.float32)

    def loss_fn(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    def per_device(p, x, y):  # every device's answer side by side: [n, ...]
        return jax.tree.map(lambda a: jnp.asarray(a)[None], fn(loss_fn, p, x, y))

    vma = ("   likely mistake: inside shard_map (check_vma=True) jax.grad already psums the gradient of a "
           "replicated parameter; pmean it again and you get N x the mean. Take the gradient of "
           "pmean(loss) instead")
    with checks.check(name, tests="on 4 devices the loss and every gradient equal the whole batch's, identical on every device") as c:
        f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P(axis)))
        loss, grads = f(params, x, y)
        ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x, y)
        for d in range(n):
            if np.allclose(np.asarray(loss)[d], n * ref_loss, rtol=1e-5, atol=1e-6):
                raise AssertionError(f"loss on device {d} is {n}x the whole batch's loss\n   likely mistake: psum "
                                     "SUMS the per-device losses (and so the gradients); the whole batch's loss is "
                                     "their mean: pmean, not psum")
            checks.assert_close(f"loss on device {d}", np.asarray(loss)[d], ref_loss, rtol=1e-5, atol=1e-6,
                                hint="return the loss of the whole batch: average the per-device losses")
            for k in ("w", "b"):
                got, exp = np.asarray(grads[k])[d], np.asarray(ref_grads[k])
                if np.allclose(got, n * exp, rtol=1e-4, atol=1e-6):
                    raise AssertionError(f"grad[{k!r}] on device {d} is {n}x the whole-batch gradient\n{vma}")
                checks.assert_close(f"grad[{k!r}] on device {d}", got, exp, rtol=1e-5, atol=1e-6,
                                    hint=[checks.averaged_twice(n)])
        c.ok(f"whole-batch loss and gradient on all {n} devices")
    return bool(c.passed)


@exercise("01", 'device_key', cell='def device_key(', hints=HINTS['device_key'],
          mistakes={'same key everywhere': 'drew the same mask'})
def check_jax_device_key(fn, mesh, name: str = "device_key") -> bool:
    """Exercise check: ``fn(key)`` inside ``shard_map`` gives device ``d`` the key ``fold_in(key, d)``."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from course_lib import checks
    (axis,), n = mesh.axis_names, mesh.devices.size
    key = jax.random.key(42)

    def masks(k):  # a dropout-style mask drawn on every device with its key
        return jax.random.bernoulli(fn(k), 0.5, (1, 64))

    with checks.check(name, tests='every device gets a different key, the same call twice gives the same keys, and it depends on the key given') as c:
        got = np.asarray(jax.jit(jax.shard_map(masks, mesh=mesh, in_specs=P(), out_specs=P(axis)))(key))
        ref = np.stack([np.asarray(jax.random.bernoulli(jax.random.fold_in(key, d), 0.5, (64,))) for d in range(n)])
        if all((got[d] == got[0]).all() for d in range(n)):
            raise AssertionError(f"all {n} devices drew the same mask: the key must depend on "
                                 f"jax.lax.axis_index({axis!r}), or every device drops the same units")
        if not (got == ref).all():
            raise AssertionError("masks differ per device (good), but are not those of "
                                 f"jax.random.fold_in(key, jax.lax.axis_index({axis!r})); use exactly that")
        c.ok(f"{n} devices, {n} different masks, each from fold_in(key, axis_index)")
    return bool(c.passed)


