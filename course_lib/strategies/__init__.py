"""The strategies layer: the training strategies the labs build, as reference implementations, one folder
per parallelism, torch and JAX side by side.

=============  ==============================================  ===================  ======
folder         what it teaches                                 modules              lab
=============  ==============================================  ===================  ======
``dp/``        data parallel by hand, then bucketed            ``torch``            01
``zero/``      ZeRO-1/2/3: the road from DP to FSDP            ``torch``            02
``fsdp/``      FSDP from scratch, FSDP2, FSDP in JAX           ``scratch``,         03-05
                                                               ``torch``, ``jax``
``hsdp/``      hybrid sharding: a 2-D (replicate × shard)      ``torch``, ``jax``   06
               mesh
``tp/``        tensor parallel, and FSDP × TP on a 2-D mesh    ``torch``, ``jax``   06
=============  ==============================================  ===================  ======

A folder's ``__init__`` imports nothing (importing ``course_lib.strategies.fsdp.jax`` must not import torch,
nor ``.torch`` JAX): import the module you need, e.g. ``from course_lib.strategies.fsdp import jax as fsdp_jax``.
What a strategy measures on a rank (memory, ownership) is :mod:`course_lib.measure`; the raw collectives
are :mod:`course_lib.comm`; saving and loading what a strategy shards (Lab 07) is :mod:`course_lib.checkpoint`;
the capstone's flags are :mod:`course_lib.apps.train_config`.
"""
