"""The comm layer, communication: the raw collectives and the ledger that records every one of them.

Modules: :mod:`~course_lib.comm.ledger` (the record types, pure Python),
:mod:`~course_lib.comm.collectives` (Lab 00's all-reduce from its two halves),
:mod:`~course_lib.comm.shim` (the flat all-gather / reduce-scatter, one torch-version shim),
:mod:`~course_lib.comm.torch_ledger` (c10d-level capture), :mod:`~course_lib.comm.jax_ledger`
(collectives read from compiled HLO text).

Adding a collective to the ledger -- every place it must appear (``tests/test_collective_checklist.py``
fails until each is done, naming the missing one):

1. :data:`course_lib.comm.ledger.OPS` -- its canonical name (``snake_case``);
2. :mod:`course_lib.comm.torch_ledger` -- a method of the recording backend that calls ``self._record("<op>", ...)``
   (the c10d method it wraps), unless the op is in :data:`JAX_ONLY`;
3. :data:`course_lib.comm.jax_ledger.HLO_OPS` -- the HLO spelling mapped to it, unless it is in :data:`TORCH_ONLY`;
4. :func:`course_lib.maths.costs.wire_bytes` -- its row in the docstring's table (and its branch, if it is not
   the ``(N-1)/N * V`` of the fallback);
5. :data:`course_lib.widgets.timeline_svg.OP_SHORT` -- the short label the traffic timeline draws.
"""

#: Collectives only JAX programs issue (no c10d method records them).
JAX_ONLY = frozenset({"collective_permute"})
#: Collectives XLA's HLO has no instruction for, so jax_ledger never reports them.
TORCH_ONLY = frozenset({"reduce", "gather", "scatter", "send", "recv", "barrier"})
