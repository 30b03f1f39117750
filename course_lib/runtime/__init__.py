"""The runtime layer: which devices there are, which backend to use, JAX's simulated devices.

Modules: :mod:`~course_lib.runtime.devices`, :mod:`~course_lib.runtime.netns` (two "nodes" on one machine),
:mod:`~course_lib.runtime.imports` (heavy imports, the garbage collector paused and frozen),
:mod:`~course_lib.runtime.errors` (the errors inside an error: causes, groups, DCP's per-rank failures).
Imports nothing else of course_lib.
"""
