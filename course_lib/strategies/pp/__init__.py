"""Pipeline parallel (Lab 10): cut the model into stages, one per rank, and stream micro-batches through them.

:mod:`~course_lib.strategies.pp.schedule` is the pure part (which op each stage runs when: GPipe, 1F1B, their idle
slots and the activations they hold); :mod:`~course_lib.strategies.pp.torch` runs a schedule with point-to-point
``send``/``recv`` on a process group (from scratch) and with ``torch.distributed.pipelining``;
:mod:`~course_lib.strategies.pp.jax` is the same pipeline as one SPMD program, ``shard_map`` + ``ppermute``.

Vocabulary: *stage* ``s`` (0..p-1, one per rank), *micro-batch* ``i`` (0..m-1), an *op* ``("F", i)`` or
``("B", i)``; the *bubble* is the fraction of the step a stage is idle. Sources: "GPipe: Efficient Training of Giant
Neural Networks using Pipeline Parallelism" (all forwards, then all backwards), "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (1F1B, interleaved), and "The Ultra-Scale Playbook: Training
LLMs on GPU Clusters" (Hugging Face).
"""
