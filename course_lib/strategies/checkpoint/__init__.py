"""Distributed checkpointing (Lab 07): save sharded state, load it back at another world size, survive faults.

* :mod:`~course_lib.strategies.checkpoint.torch` -- DCP: the app state an exact resume needs, save / load /
  reshard, consolidation to one file (the vocabulary is defined there);
* :mod:`~course_lib.strategies.checkpoint.manager` -- write then commit, verify before load, keep the last K;
* :mod:`~course_lib.strategies.checkpoint.resumable` -- a training run whose whole state can be saved;
* :mod:`~course_lib.strategies.checkpoint.jax` -- Orbax: sharded save, restore onto another mesh.
* :mod:`~course_lib.strategies.checkpoint.safetensors` -- DCP or Orbax -> one ``model.safetensors`` under the
  course's torch names, loaded by torch and by Flax; damaged or mismatched files refused by name.
* :mod:`~course_lib.strategies.checkpoint.names` -- the course's canonical tensor names, and adapters from
  other models' names (``fuse_qkv`` / ``split_qkv``, Flax's names and layout).
"""
