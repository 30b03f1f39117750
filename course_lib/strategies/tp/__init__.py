"""Tensor parallel (Lab 06): cut each weight matrix across the devices of a tensor group, so the group
computes one layer together. :mod:`~course_lib.strategies.tp.jax` places parameters on the
FSDP × tensor-parallel mesh ``('fsdp', 'tensor')``. PyTorch's tensor parallel (``parallelize_module`` on a
2-D ``DeviceMesh``) is to come as ``tp/torch.py``.
"""
