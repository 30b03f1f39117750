"""Layer 6, strategies: the training strategies the labs build, as reference implementations.

Naive and real side by side: :mod:`~course_lib.strategies.collectives` (all-reduce from its halves),
:mod:`~course_lib.strategies.dp` (DP by hand, then bucketed), :mod:`~course_lib.strategies.zero`
(ZeRO-1/2/3), :mod:`~course_lib.strategies.fsdp` (FSDP from scratch), :mod:`~course_lib.strategies.fsdp2`
(torch's ``fully_shard`` on the course GPT), :mod:`~course_lib.strategies.fsdp_jax` (JAX/Flax NNX),
plus instruments used on ranks: :mod:`~course_lib.strategies.memory_meter` (measured bytes) and
:mod:`~course_lib.strategies.describe` (ownership of real sharded models).
"""
