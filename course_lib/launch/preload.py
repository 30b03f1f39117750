"""A fork server's start-up, and only that: importing this module imports what every rank needs, once.

:mod:`.forkserver` names this module in ``set_forkserver_preload``, so only a fork server imports it; it imports
the modules its parent listed in ``COURSE_LIB_PRELOAD_MODULES`` (:meth:`.forkserver.Server.ensure_running` sets it
for the spawn: the torch or the jax server's list) with the garbage collector paused and frozen afterwards
(:mod:`course_lib.runtime.imports`: a quarter of the cold start, measured). Each rank is then a fork of a process
that has them all, frozen (:mod:`.rank` says why they stay so).
"""
import os

from course_lib.launch.forkserver import preload_modules
from course_lib.runtime.imports import import_quickly

_listed = os.environ.get("COURSE_LIB_PRELOAD_MODULES")
import_quickly(_listed.split(",") if _listed else preload_modules())
