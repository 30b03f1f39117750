"""The learning-rate schedule of every course trainer: a linear warm-up, then constant.

``factor(s) = min(1, (s + 1) / warmup)`` -- the first step already takes ``lr / warmup``. One definition for
``torch.optim.lr_scheduler.LambdaLR`` (``course_lib.train``, Lab 07's resumable run) and for optax
(``course_lib.train_jax``, which passes ``jnp.minimum``), so a torch run and a JAX run of the same flags step
with the same learning rates.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Warmup"]


@dataclass(frozen=True)
class Warmup:
    """LR factor ``min(1, (s + 1) / steps)``. A picklable object, not a lambda: it survives cloudpickle's trip to
    a rank, and ``LambdaLR.state_dict`` saves its fields, so a checkpoint restores it."""

    steps: int

    def __post_init__(self):
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"warm-up steps({self.steps!r}) must be an int >= 1 (1: no warm-up)")

    def __call__(self, s, minimum=min):
        """The factor at step ``s``; ``minimum=jax.numpy.minimum`` where ``s`` is a traced array (optax)."""
        return minimum(1.0, (s + 1) / self.steps)
