"""The fork server's start-up, and only that: importing this module imports what every rank needs, once.

:mod:`.pool` names this module in ``set_forkserver_preload``, so only the fork server imports it; it imports
``PRELOAD[COURSE_LIB_PRELOAD]`` (the parent checked the mode before starting the server, whose environment it
inherits) with the garbage collector paused and frozen afterwards (:mod:`course_lib.runtime.imports`: a
quarter of the cold start, measured). Each rank is then a fork of a process that has them all, frozen
(:mod:`.rank` says why they stay so).
"""
import os

from course_lib.launch.pool import PRELOAD
from course_lib.runtime.imports import import_quickly

import_quickly(PRELOAD[os.environ.get("COURSE_LIB_PRELOAD", "full")])
