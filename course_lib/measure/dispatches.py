"""Counted dispatches: how many torch operations a piece of code runs, the number that bounds a step's host time.

Vocabulary (used the same way in :mod:`course_lib.maths.planner_host` and Lab 08):

* **dispatch** -- one call of an ATen operator that reaches a kernel (``aten.mm.default``,
  ``aten._to_copy.default`` ...), forward, backward (autograd's engine dispatches those) or optimizer alike.
  Views (``aten.view``, ``aten.t``, ``aten.split``) are dispatches too -- they cost host time but launch no
  GPU kernel -- so :class:`DispatchCounter` keeps them apart.
* **host time** -- what the CPU spends issuing a step's dispatches (Python, the dispatcher, the kernel launch).
  In eager mode a GPU runs one kernel (or a few) per non-view dispatch, so counting them on a CPU predicts the
  GPU's kernel count closely enough to find waste: FSDP2 at world size 1 casting and copying every parameter
  in forward and again in backward shows up as hundreds of ``_to_copy`` / ``copy_`` / ``split_with_sizes``
  dispatches that a plain module never makes.

:class:`DispatchCounter` is a ``TorchDispatchMode``: it sees every operator below autograd, on the thread that
runs the step (on a CPU the backward runs there too). Nothing is timed here; it is for counting.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchCounter", "count_dispatches", "VIEW_OPS"]

#: operators that launch no GPU kernel (host time only): views (metadata) and the profiler's range markers
#: (``record_function``, which FSDP2 wraps around each of its hooks)
VIEW_OPS = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "expand", "split", "split_with_sizes",
                      "slice", "select", "unsqueeze", "squeeze", "as_strided", "alias", "detach", "reshape",
                      "unbind", "chunk", "narrow", "view_as", "_reshape_alias", "unflatten", "lift_fresh",
                      "_record_function_enter_new", "_record_function_exit"})


class DispatchCounter(TorchDispatchMode):
    """Counts ATen operator calls by name (``mm``, ``_to_copy``, ...) while active.

    ``total`` every dispatch, ``kernels`` those not in :data:`VIEW_OPS` (what an eager GPU step launches, about one
    kernel each), ``by_op`` a ``Counter`` of operator names (overload dropped)."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    @property
    def kernels(self) -> int:
        return sum(n for op, n in self.by_op.items() if op not in VIEW_OPS)

    def summary(self, top: int = 8) -> str:
        common = ", ".join(f"{op} {n}" for op, n in self.by_op.most_common(top))
        return f"{self.total} dispatches ({self.kernels} not views): {common}"


def count_dispatches(fn, *args, **kwargs) -> tuple[object, DispatchCounter]:
    """``(fn(*args, **kwargs), the DispatchCounter that watched it)``."""
    with DispatchCounter() as c:
        out = fn(*args, **kwargs)
    return out, c
