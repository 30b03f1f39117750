"""Where a NaN or an inf was born: every module's output, checked on every forward, on one rank.

A NaN in the loss says nothing about where it started: one overflow in one layer on one rank becomes NaN
in the loss, then -- through the gradient all-reduce -- NaN in every rank's gradients and weights within the
same step. :class:`NonFiniteWatch` puts a forward hook on every module and records, per call, whether the output
held a NaN or an inf. Every record carries the rank, the step (advanced by :meth:`NonFiniteWatch.next_step`) and
the call's position in the forward (``call``, 0, 1, 2, ... in the order modules ran), so records gathered from
all ranks can be put in time order. Finding the *first* bad record is the learner's job in Lab 09.

For the backward, ``torch.autograd.detect_anomaly()`` does the same job locally: it names the backward function
that first returned NaN and prints the forward line that created it. Both cost time on every op: turn them on
to hunt, not to train.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["NonFiniteWatch"]


class NonFiniteWatch:
    """Forward hooks on every named submodule of ``model`` (the root too, named ``"<root>"``).

    ``records``: one dict per module call -- ``rank``, ``step``, ``call`` (order within the step's forward),
    ``module`` (its qualified name), ``nan`` and ``inf`` (whether any output element was one). Use as a context
    manager, or call :meth:`remove` to take the hooks off."""

    def __init__(self, model: torch.nn.Module, rank: int = 0):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"NonFiniteWatch watches an nn.Module, got {type(model).__name__}")
        self.rank, self.step, self.records = int(rank), 0, []
        self._call = 0
        self._handles = [m.register_forward_hook(self._hook(name or "<root>")) for name, m in model.named_modules()]

    def _hook(self, name: str):
        def hook(module, args, output):
            outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            self.records.append({"rank": self.rank, "step": self.step, "call": self._call, "module": name,
                                 "nan": any(bool(torch.isnan(t).any()) for t in outs),
                                 "inf": any(bool(torch.isinf(t).any()) for t in outs)})
            self._call += 1
        return hook

    def next_step(self) -> None:
        """Start the next step: later records carry ``step + 1`` and their ``call`` counts from 0 again."""
        self.step += 1
        self._call = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "NonFiniteWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
