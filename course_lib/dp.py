"""Data parallel from scratch: same weights on every rank, a slice of the batch each, averaged gradients.

Every rank holds the whole model and computes the gradient of *its* slice of the global batch; an
all-reduce sums the N gradients and a division by N turns the sum into the gradient of the whole
batch (the loss is a mean over equal slices, so the mean of the slice gradients is the batch
gradient). Every rank then takes the same optimizer step from the same weights with the same
gradient, so the replicas never drift apart -- provided they started equal (:func:`broadcast_parameters_`).

Layout as in picotron: the raw communication first (plain functions over tensors and a process group),
then two wrappers that decide *when* to call it:

* :class:`NaiveDataParallel` -- one blocking all-reduce per parameter, issued from a hook as soon as
  that gradient is ready. A good starting point, not used in practice: a 7B model has hundreds of
  tensors, and hundreds of small collectives pay hundreds of latencies.
* :class:`BucketedDataParallel` -- what DDP does (Li et al., "PyTorch Distributed: Experiences on
  Accelerating Data Parallel Training", VLDB 2020): gradients are packed into a few flat *buckets* of
  about ``bucket_cap_mb``, in the reverse order of registration (roughly the order backward produces
  them), and each bucket's all-reduce starts asynchronously the moment its last gradient arrives, so
  communication overlaps the rest of backward. Fewer, larger collectives; exactly the same bytes.

Everything takes the process group explicitly (``group=None`` is the default world group).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "broadcast_parameters_", "all_reduce_mean_", "average_gradients_", "make_buckets", "max_replica_gap",
    "NaiveDataParallel", "BucketedDataParallel",
    "jax_dp_value_and_grad", "jax_device_key",
    "check_average_gradients", "check_make_buckets", "check_jax_dp_value_and_grad", "check_jax_device_key",
]


# ----------------------------------------------------------------------------------------------------
# raw communication
# ----------------------------------------------------------------------------------------------------
def broadcast_parameters_(module: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``, one broadcast per tensor.

    DDP does the same in its constructor: replicas must start equal, and "same seed on every rank" is
    a promise nothing checks, while a broadcast is a guarantee.
    """
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=group)


def all_reduce_mean_(tensors, group=None) -> None:
    """In place, for each tensor: sum over ranks (all-reduce), then divide by the world size.

    Summing then dividing (rather than ``ReduceOp.AVG``) works on every backend: gloo has no AVG.
    """
    world = dist.get_world_size(group)
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(world)


def average_gradients_(module: nn.Module, group=None) -> None:
    """Replace every ``p.grad`` of ``module`` by its mean over ranks: one all-reduce per parameter."""
    all_reduce_mean_([p.grad for p in module.parameters() if p.grad is not None], group=group)


def make_buckets(params, cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters into buckets of at most ``cap_bytes`` (a tensor bigger than that gets its own).

    Parameters are taken in *reverse* order of registration: backward produces gradients roughly from
    the last layer to the first, so the first bucket fills first and its all-reduce starts earliest.

    >>> ps = [torch.zeros(n) for n in (10, 10, 30, 5)]          # 40, 40, 120, 20 bytes
    >>> [[p.numel() for p in b] for b in make_buckets(ps, 64)]
    [[5], [30], [10, 10]]
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} must be > 0 (bytes of gradient per bucket)")
    buckets, current, size = [], [], 0
    for p in reversed([p for p in params if p.requires_grad]):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def max_replica_gap(module: nn.Module, src: int = 0, group=None) -> float:
    """The largest ``|p_rank - p_src|`` over every parameter and rank: 0.0 when the replicas agree.

    Costs one broadcast per tensor; call it inside ``ledger_torch.paused()`` to keep it off the ledger.
    """
    gap = torch.zeros(())
    with torch.no_grad():
        for p in module.parameters():
            ref = p.detach().clone()
            dist.broadcast(ref, src=src, group=group)
            gap = torch.maximum(gap, (p.detach() - ref).abs().max().cpu())
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=group)
    return float(gap)


# ----------------------------------------------------------------------------------------------------
# wrappers
# ----------------------------------------------------------------------------------------------------
class NaiveDataParallel(nn.Module):
    """Data parallel in its simplest correct form. A good starting point, not used in practice.

    * at construction, broadcast rank 0's weights (so every replica starts equal);
    * during backward, as soon as a parameter's gradient is accumulated, all-reduce it and divide by N
      (a ``post_accumulate_grad`` hook, so it also works with gradient accumulation: see ``sync``).

    One blocking collective per parameter tensor: correct, but latency-bound on a real model and
    without overlap -- :class:`BucketedDataParallel` fixes both.
    """

    def __init__(self, module: nn.Module, group=None, broadcast: bool = True):
        super().__init__()
        self.module, self.group = module, group
        self.sync = True  #: set False to accumulate local gradients over micro-batches without talking
        if broadcast:
            broadcast_parameters_(module, group=group)
        self._world = dist.get_world_size(group)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        if self.sync:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
            p.grad.div_(self._world)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _Bucket:
    """A flat gradient buffer for a few parameters, and the async all-reduce in flight on it."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        p0 = params[0]
        self.buffer = torch.zeros(total, dtype=p0.dtype, device=p0.device)  # [Σ numel], one collective
        self.ready = 0      #: gradients copied in during this backward
        self.work = None    #: the async all-reduce, once launched


class BucketedDataParallel(nn.Module):
    """Data parallel with gradient buckets and overlap, as DDP does it (see the module docstring).

    During backward each gradient is copied into its bucket's flat buffer; when a bucket has all its
    gradients, its all-reduce is launched with ``async_op=True`` and backward goes on computing earlier
    layers meanwhile. A callback queued on the autograd engine runs at the very end of backward: it
    waits for every bucket, divides by N and copies the averages back into ``p.grad``. After
    ``loss.backward()`` returns, gradients are averaged, exactly as with :class:`NaiveDataParallel`.

    ``bucket_cap_mb`` trades latency (few buckets) against overlap (a bucket can only start when its
    last gradient is ready; one giant bucket would wait for the whole backward). DDP's default is 25.
    Unlike DDP we keep the bucket order fixed (reverse registration) instead of re-recording it after
    the first step, so we never need DDP's step-2 broadcast of the new order.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0, group=None, broadcast: bool = True):
        super().__init__()
        self.module, self.group = module, group
        if broadcast:
            broadcast_parameters_(module, group=group)
        self._world = dist.get_world_size(group)
        self.buckets = [_Bucket(b) for b in make_buckets(module.parameters(), int(bucket_cap_mb * 2**20))]
        self._where = {}  # parameter -> (bucket, offset)
        for bucket in self.buckets:
            for p, off in zip(bucket.params, bucket.offsets):
                self._where[p] = (bucket, off)
                p.register_post_accumulate_grad_hook(self._hook)
        self._callback_queued = False

    def _hook(self, p: torch.Tensor) -> None:
        bucket, off = self._where[p]
        bucket.buffer[off:off + p.numel()].copy_(p.grad.reshape(-1))
        bucket.ready += 1
        if bucket.ready == len(bucket.params):  # last gradient of this bucket: start its all-reduce now
            bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
            self._callback_queued = True

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket (launching any whose gradients never all arrived), average, copy back."""
        for bucket in self.buckets:
            if bucket.work is None:  # some parameter got no gradient this step: reduce what we have
                bucket.work = dist.all_reduce(bucket.buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.buffer.div_(self._world)
            for p, off in zip(bucket.params, bucket.offsets):
                flat = bucket.buffer[off:off + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = flat.clone()
                else:
                    p.grad.copy_(flat)
            bucket.ready, bucket.work = 0, None
            bucket.buffer.zero_()
        self._callback_queued = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# ----------------------------------------------------------------------------------------------------
# lab 01 exercise checks
# ----------------------------------------------------------------------------------------------------
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

    from . import ledger_torch as lt
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


def check_average_gradients(fn, world_size: int = 4, batch: int = 8, name: str = "average_gradients") -> bool:
    """Exercise check: after ``fn(model)`` on every rank, each ``p.grad`` is the gradient of the whole
    batch (computed by one process), on every rank, for a 17x257x5 MLP."""
    from . import checks
    from .launch import run
    names = [n for n, _ in _awkward_mlp().named_parameters()]
    with checks.check(name) as c:
        res = run(_grads_on_rank, fn, batch, world_size=world_size)
        for r in range(world_size):
            if not res[r]["weights_same"]:
                raise AssertionError(f"rank {r}'s weights changed: average the gradients only; the step comes later")
            for i, pname in enumerate(names):
                checks.assert_close(f"{pname}.grad", res[r]["got"][i], res[r]["ref"][i], rtol=1e-5, atol=1e-6, rank=r,
                                    hint=[checks.summed_not_averaged(world_size), checks.averaged_twice(world_size),
                                          checks.skipped_collective([res[q]["local"][i] for q in range(world_size)])])
        ops = res.ledger.filter(rank=0).counts()
        c.ok(f"every rank holds the whole-batch gradient; rank 0 issued {dict(ops)} for {len(names)} tensors")
    return bool(c.passed)


def check_make_buckets(fn, name: str = "make_buckets") -> bool:
    """Exercise check: ``fn(params, cap_bytes)`` groups like :func:`make_buckets` (reverse order, greedy)."""
    from . import checks
    cases = [((10, 10, 30, 5), 64), ((17 * 257, 257, 5 * 257, 5), 4096), ((3, 4, 5), 10**6), ((8, 8, 8, 8), 32)]
    with checks.check(name) as c:
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
            raise AssertionError(msg)
        c.ok(f"{len(cases)} cases match (reverse order, greedy, a big tensor alone)")
    return bool(c.passed)


def check_jax_dp_value_and_grad(fn, mesh, name: str = "dp_value_and_grad") -> bool:
    """Exercise check: ``fn(loss_fn, params, x, y)`` inside ``jax.shard_map`` over ``mesh``'s axis (batch
    sharded, params replicated, default ``check_vma``) returns the whole batch's loss and gradient on
    every device, for a 17x5 linear model."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from . import checks
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
    with checks.check(name) as c:
        f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P(axis)))
        loss, grads = f(params, x, y)
        ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x, y)
        for d in range(n):
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


def check_jax_device_key(fn, mesh, name: str = "device_key") -> bool:
    """Exercise check: ``fn(key)`` inside ``shard_map`` gives device ``d`` the key ``fold_in(key, d)``."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from . import checks
    (axis,), n = mesh.axis_names, mesh.devices.size
    key = jax.random.key(42)

    def masks(k):  # a dropout-style mask drawn on every device with its key
        return jax.random.bernoulli(fn(k), 0.5, (1, 64))

    with checks.check(name) as c:
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


# ----------------------------------------------------------------------------------------------------
# the JAX twins (reference answers of the JAX exercises; JAX is imported only when they run)
# ----------------------------------------------------------------------------------------------------
def jax_dp_value_and_grad(loss_fn, params, x, y, axis: str = "dp"):
    """Inside ``shard_map`` over ``axis``: the loss and gradient of the whole batch, on every device.

    Differentiates ``pmean(loss)``: with ``check_vma=True`` JAX already sums the gradient of replicated
    ``params`` over devices, so ``pmean`` of the *gradient* would give N x the mean (and a second
    all-reduce). Through the ``pmean`` of the loss the one all-reduce carries the mean, in backward.
    """
    import jax
    return jax.value_and_grad(lambda p: jax.lax.pmean(loss_fn(p, x, y), axis))(params)


def jax_device_key(key, axis: str = "dp"):
    """Inside ``shard_map``: a key of this device's own, ``fold_in(key, axis_index(axis))``."""
    import jax
    return jax.random.fold_in(key, jax.lax.axis_index(axis))
