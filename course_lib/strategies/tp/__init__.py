"""Tensor parallel (Lab 06): cut each weight matrix across the devices of a tensor group, so the group
computes one layer together. :mod:`~course_lib.strategies.tp.torch` is PyTorch's ``parallelize_module``
(Megatron's column-wise / row-wise plan) with FSDP2 over the other dim of a ``("dp_shard", "tp")``
``DeviceMesh``; :mod:`~course_lib.strategies.tp.jax` places parameters on JAX's FSDP × tensor-parallel mesh
``('fsdp', 'tensor')``.
"""
