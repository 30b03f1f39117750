"""The maths layer: pure functions, no process group, no torch, no JAX.

Modules: :mod:`~course_lib.maths.strategy` (which strategy shards what: the one table),
:mod:`~course_lib.maths.sharding` (padding, shard bounds), :mod:`~course_lib.maths.costs` (bytes a
collective and a step move; the α-β model), :mod:`~course_lib.maths.memory` (model-state bytes per
rank), :mod:`~course_lib.maths.ownership` (who owns which slice), :mod:`~course_lib.maths.traffic`
(a ledger as rows and totals), :mod:`~course_lib.maths.flops` (FLOPs per token: the one definition of MFU's
numerator), :mod:`~course_lib.maths.schedule` (the LR warm-up every trainer uses); GPU peaks, MFU's denominator, are
:func:`course_lib.maths.planner_hw.peak_flops`.
"""
