"""Measured memory: the bytes a rank really holds, counted from tensor storages (and the GPU allocator).

:mod:`course_lib.maths.memory` *computes* model-state bytes from the ZeRO paper's formulas; this module
*measures* them, so a lab can put one next to the other.

**Storage accounting.** Every tensor is a view of an untyped *storage*; several tensors may share one
(a parameter that is a view of a flat buffer, a gradient that is a view of a bucket). Counting each
distinct storage once, at its full size, gives the bytes actually allocated -- including padding, and
0 for a storage that was freed with ``untyped_storage().resize_(0)`` as FSDP and our ZeRO-3 do. It
works the same on CPU and GPU and does not depend on what else the process allocated.

**Allocator.** On a GPU, ``torch.cuda.memory_allocated()`` is the ground truth for everything live
(including activations and temporary buffers, and rounded up to the allocator's 512-byte blocks);
:func:`allocated_bytes` returns it, or ``None`` on CPU, where no such counter exists.

**Over a step.** :class:`MemoryMeter` follows live tensor storage op by op and keeps its peak: the
FSDP sawtooth (gather, free, re-gather) on CPU, where no allocator statistics exist.

**Activations.** :func:`saved_activation_bytes` runs a forward pass under
``torch.autograd.graph.saved_tensors_hooks`` and counts the distinct storages autograd keeps for
backward, leaving out the parameters themselves: the activation memory of one step.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["storage_key", "storage_bytes", "StateMeasure", "measure_state", "model_state",
           "saved_activation_bytes", "allocated_bytes", "MemoryMeter"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's sharded parameter) holds only its local shard in this rank's memory."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies ``t``'s storage: tensors with the same key share memory (the same StorageImpl)."""
    t = _local(t)
    return (t.device.type, t.device.index, t.untyped_storage()._cdata)


def storage_bytes(tensors, exclude=()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` entries are skipped), each counted
    once at its allocated size; storages whose key is in ``exclude`` are left out."""
    seen = set(exclude)
    total = 0
    for t in tensors:
        if t is None:
            continue
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total += _local(t).untyped_storage().nbytes()
    return total


@dataclass(frozen=True)
class StateMeasure:
    """Model-state bytes measured on one rank (compare with :class:`course_lib.maths.memory.StateBytes`)."""

    params: int      #: parameter storages (flat buffers and shards count once, at their padded size)
    grads: int       #: gradient storages not already counted as parameters
    optimizer: int   #: optimizer-state storages (Adam's m, v and step counters) not counted above

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    if isinstance(optimizer, torch.optim.Optimizer):
        return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return list(optimizer or ())


def measure_state(params, grads=None, optimizer=None) -> StateMeasure:
    """Storage accounting of model state: ``params`` and ``grads`` are iterables of tensors,
    ``optimizer`` a ``torch.optim.Optimizer`` (its ``state`` is read) or an iterable of tensors.

    ``grads=None`` takes ``p.grad`` of every parameter. A storage counts once, in the first category
    that holds it (parameters, then gradients, then optimizer state).
    """
    params = list(params)
    grads = [p.grad for p in params] if grads is None else list(grads)
    opt = _optimizer_tensors(optimizer)
    p_keys = {storage_key(t) for t in params if t is not None}
    g_keys = {storage_key(t) for t in grads if t is not None}
    return StateMeasure(params=storage_bytes(params), grads=storage_bytes(grads, exclude=p_keys),
                        optimizer=storage_bytes(opt, exclude=p_keys | g_keys))


def model_state(model: torch.nn.Module, optimizer=None) -> StateMeasure:
    """:func:`measure_state` of a plain model (its parameters and their ``.grad``) and its optimizer."""
    return measure_state(list(model.parameters()), None, optimizer)


def saved_activation_bytes(fn, *args, params=(), **kwargs) -> tuple[object, int]:
    """Run ``fn(*args, **kwargs)`` and return ``(its result, bytes autograd saved for backward)``.

    Storages of ``params`` (pass ``model.parameters()``) are not activations and are left out; a
    storage saved by several operations counts once. Keep the result alive if you want the memory to
    stay allocated: freeing the graph frees the activations.
    """
    exclude = {storage_key(p) for p in params}
    saved: dict[tuple, int] = {}

    def pack(t):
        key = storage_key(t)
        if key not in exclude:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return out, sum(saved.values())


def allocated_bytes(device=None) -> int | None:
    """``torch.cuda.memory_allocated(device)`` on a CUDA device; ``None`` on CPU (no allocator counter)."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" or device is None and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated(device))
    return None


class MemoryMeter(TorchDispatchMode):
    """Bytes of live tensor storage on this rank, op by op, and their peak.

    CPU tensors have no allocator statistics (no ``max_memory_allocated``), so we count: every storage
    an op creates is registered (weakly) and, after every op, the live storages' current sizes are
    summed -- current, because FSDP2 frees and re-allocates its gathered buffers by resizing their
    storage in place. ``track(*tensors)`` registers storages made before the meter started
    (parameters, optimizer state). Views share a storage and count once; buffers a backend keeps
    internally (gloo's) are not seen. Costs O(live storages) per op: for measuring, not for timing.
    """

    def __init__(self):
        super().__init__()
        self._storages: dict[int, weakref.ref] = {}
        self.peak = 0

    @property
    def live(self) -> int:
        refs = list(self._storages.values())   # a copy: storages die (and leave) while we sum
        return sum(s.nbytes() for s in (r() for r in refs) if s is not None)

    def track(self, *tensors) -> "MemoryMeter":
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.live)
        return self

    def reset_peak(self):
        self.peak = self.live

    def _add(self, t: torch.Tensor):
        if hasattr(t, "_local_tensor"):   # a DTensor (FSDP2): its memory is its local shard
            t = t._local_tensor
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if id(st) not in self._storages:
            self._storages[id(st)] = weakref.ref(st, lambda _, k=id(st): self._storages.pop(k, None))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.live)
        return out
