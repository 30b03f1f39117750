"""Hybrid sharding, HSDP (Lab 06): the same model cut F ways inside a shard group and copied R times across
groups, a 2-D (replicate × shard) mesh. :mod:`~course_lib.strategies.hsdp.torch` is FSDP2 on a 2-D
``DeviceMesh``; :mod:`~course_lib.strategies.hsdp.jax` the same mesh in JAX, automatic and by hand. The
words (sharding factor F, replicate factor R) are defined in the torch module.
"""
