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

    >>> ps = [torch.zeros(n, requires_grad=True) for n in (10, 10, 30, 5)]   # 40, 40, 120, 20 bytes
    >>> [[p.numel() for p in b] for b in make_buckets(ps, 80)]
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

    Costs one broadcast per tensor; call it inside ``torch_ledger.paused()`` to keep it off the ledger.
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
