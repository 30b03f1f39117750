"""Layer 1, runtime: which devices there are, which backend to use, JAX's simulated devices.

Modules: :mod:`~course_lib.runtime.devices`. Imports nothing else of course_lib.
"""
