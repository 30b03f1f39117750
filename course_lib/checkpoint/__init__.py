"""The checkpoint layer: save a run's sharded state, load it back at another world size, survive faults (Lab 07).

Checkpointing is not a parallelism: it sits above the strategies (it saves what they shard) and below the
checks and the trainers that use it. One concept a module:

=================  =====================================================================================
module             what it holds
=================  =====================================================================================
``dcp``            torch DCP: the app state an exact resume needs, save / load / reshard, consolidation to
                   one file (the vocabulary of the layer is defined there)
``orbax``          JAX: Orbax's sharded save, restore onto another mesh
``commit``         the commit protocol and its file format: ``step_<s>.partial``, ``COMMIT.json`` (sizes,
                   CRC-32, the run and its lineage), one ``rename``; verify before load
``manager``        :class:`~course_lib.checkpoint.manager.Checkpointer`: numbered steps, the last K kept, a
                   failed save agreed by every rank, a full disk made room on
``owner``          one writer per folder: the kernel's ``flock`` on the folder and a record of who holds it
``resumable``      a training run whose whole state can be saved (model, AdamW, the warm-up, the data position)
``safetensors``    DCP or Orbax -> one ``model.safetensors`` under the course's torch names, loaded by torch and
                   by Flax; damaged or mismatched files refused by name
=================  =====================================================================================

The canonical tensor names and the adapters from other models' names are the model's:
:mod:`course_lib.models.names`. The package's ``__init__`` imports nothing: importing ``checkpoint.orbax`` must
not import torch, nor ``checkpoint.dcp`` JAX.
"""
