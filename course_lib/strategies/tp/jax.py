"""FSDP × tensor parallel in JAX: a 2-D mesh ``('fsdp', 'tensor')`` and the placement of each parameter on it.

* :func:`tp_mesh` -- ``jax.make_mesh((F, T), ('fsdp', 'tensor'))``; a tensor group is T consecutive devices.
* :func:`fsdp_tp_spec` -- a 2-D kernel ``P('fsdp', 'tensor')`` (the hybrid of the JAX/Flax NNX guide "FSDP:
  Fully Sharded Data Parallel"), so a device holds ``1/(F·T)`` of it; the batch is cut over ``'fsdp'`` only
  (the T devices of a tensor group compute on the same rows, each with its slice of the features).
* :func:`fsdp_tp_rule` -- that placement (or a learner's) as a rule for :mod:`course_lib.strategies.fsdp.jax`.

Lab 06 uses it (section "FSDP × tensor parallel"). Importing this module does not import JAX.
"""
from __future__ import annotations

import math

from course_lib.strategies.fsdp.jax import MIN_SIZE, fsdp_spec
from course_lib.strategies.hsdp.jax import auto_mesh

__all__ = ["TP_AXES", "tp_mesh", "fsdp_tp_spec", "fsdp_tp_rule"]

TP_AXES = ("fsdp", "tensor")        #: the FSDP × TP mesh of the JAX FSDP guide


def tp_mesh(fsdp: int, tensor: int, devices=None):
    """``jax.make_mesh((F, T), ('fsdp', 'tensor'))``: device ``f·T + t``; a tensor group is T consecutive devices."""
    return auto_mesh((fsdp, tensor), TP_AXES, devices)


def fsdp_tp_spec(shape, fsdp: int, tensor: int, *, min_size: int = MIN_SIZE):
    """The FSDP × TP placement of a parameter of ``shape``: a 2-D array of ``min_size`` elements or more is
    ``P('fsdp', 'tensor')`` -- rows cut over F, columns over T, ``1/(F·T)`` per device -- when both divide;
    anything else falls back to FSDP alone over ``'fsdp'`` (:func:`fsdp_spec`), small ones are replicated."""
    from jax.sharding import PartitionSpec as P
    shape = tuple(shape)
    if len(shape) == 2 and math.prod(shape) >= min_size and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P("fsdp", "tensor")
    return fsdp_spec(shape, fsdp, min_size=min_size)


def fsdp_tp_rule(fsdp: int, tensor: int, min_size: int = MIN_SIZE, spec=None):
    """:func:`fsdp_tp_spec` (or the learner's ``spec(shape, fsdp, tensor)``) as a :mod:`course_lib.strategies.fsdp.jax` rule."""
    spec = spec or (lambda shape, f, t: fsdp_tp_spec(shape, f, t, min_size=min_size))

    def rule(shape, n=None, **kw):
        return spec(tuple(shape), fsdp, tensor)
    return rule
