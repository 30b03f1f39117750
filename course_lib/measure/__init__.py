"""The measure layer: what a run really holds, read off live tensors on a rank.

* :mod:`~course_lib.measure.memory` -- bytes of live tensor storage, counted once per storage, and the peak
  during a step (a ``TorchDispatchMode``);
* :mod:`~course_lib.measure.ownership` -- who holds which slice of a real sharded model (FSDP2's DTensors,
  JAX arrays), in the form the ownership widget draws.

Each is held against the formula of the same name in :mod:`course_lib.maths` (:mod:`~course_lib.maths.memory`,
:mod:`~course_lib.maths.ownership`): the maths predicts, this layer measures. It sits below
:mod:`course_lib.strategies` so strategies, checks and benchmarks can all measure the same way.
"""
