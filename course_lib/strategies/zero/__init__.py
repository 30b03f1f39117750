"""ZeRO stages 1, 2 and 3 (Lab 02): shard the optimizer state, then the gradients, then the parameters.
:mod:`~course_lib.strategies.zero.torch` builds them on flat padded buffers; stage 3 is FSDP's ancestor.
"""
