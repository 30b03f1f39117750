"""FSDP (Labs 03, 04, 05), three ways:

* :mod:`~course_lib.strategies.fsdp.scratch` -- FSDP from scratch in torch (Lab 03): flat parameters, units,
  all-gather before use, reduce-scatter of gradients, prefetch. The naive one, to read.
* :mod:`~course_lib.strategies.fsdp.torch` -- FSDP2's ``fully_shard`` on the course GPT (Lab 04), and the
  three implementations the labs compare (ours, FSDP2, DDP).
* :mod:`~course_lib.strategies.fsdp.jax` -- FSDP in JAX/Flax NNX (Lab 05): placement rules, ``jit`` steps,
  and FSDP by hand under ``shard_map``.
"""
