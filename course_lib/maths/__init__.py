"""The maths layer: pure functions, no process group, no torch, no JAX.

Modules: :mod:`~course_lib.maths.strategy` (which strategy shards what: the one table),
:mod:`~course_lib.maths.sharding` (padding, shard bounds), :mod:`~course_lib.maths.costs` (bytes a
collective and a step move; the α-β model), :mod:`~course_lib.maths.memory` (model-state bytes per
rank), :mod:`~course_lib.maths.ownership` (who owns which slice), :mod:`~course_lib.maths.traffic`
(a ledger as rows and totals).
"""
