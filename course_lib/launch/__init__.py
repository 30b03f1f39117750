"""The launch layer: run a function defined in a notebook cell on N ranks, get every rank's result.

Modules: :mod:`~course_lib.launch.pool` (the notebook side: fork server, rank pool, ``run``),
:mod:`~course_lib.launch.preload` (what the fork server imports, once, for every rank),
:mod:`~course_lib.launch.rank` (what runs inside each rank process), :mod:`~course_lib.launch.results`
(what a call returns or raises), :mod:`~course_lib.launch.magic` (``%%ranks``) and
:mod:`~course_lib.launch.cell_output` (what its cell shows of the ranks' output).
"""
from course_lib.launch.pool import DEFAULT_TIMEOUT_S, PRELOAD, run, shutdown
from course_lib.launch.results import LaunchTimeout, RankError, RunResult
from course_lib.launch.rank import RankInfo, rank_info

__all__ = ["run", "rank_info", "shutdown", "RankError", "LaunchTimeout", "RunResult", "RankInfo", "PRELOAD",
           "DEFAULT_TIMEOUT_S"]
