"""The launch layer: run a function defined in a notebook cell on N ranks, get every rank's result.

Modules, the notebook side first: :mod:`~course_lib.launch.pool` (the pool's life cycle and ``run``),
:mod:`~course_lib.launch.preflight` (what ``run`` checks before any rank starts; ``run`` under torchrun),
:mod:`~course_lib.launch.forkserver` (the torch and the jax fork server: what each imports, when each starts, which
one a call needs), :mod:`~course_lib.launch.preload` (a fork server's imports, once, for every rank),
:mod:`~course_lib.launch.store_dirs` (the directory the ranks meet through), :mod:`~course_lib.launch.verdict`
(what the ranks' answers mean when not every rank returned), :mod:`~course_lib.launch.stacks` (every rank's
stack when a call hangs), :mod:`~course_lib.launch.results` (what a call returns or raises),
:mod:`~course_lib.launch.cell_output` (the ranks' output, labelled: a call's lines, a ``%%ranks`` cell's view),
:mod:`~course_lib.launch.magic` (``%%ranks``), :mod:`~course_lib.launch.kernel_exit` (a kernel that ran ranks shuts
down at once, nothing left behind), and :mod:`~course_lib.launch.rank` (what runs inside each rank process).
"""
from course_lib.launch.forkserver import PRELOAD
from course_lib.launch.pool import DEFAULT_TIMEOUT_S, run, shutdown
from course_lib.launch.results import LaunchTimeout, RankError, RunResult
from course_lib.launch.rank import RankInfo, rank_info

__all__ = ["run", "rank_info", "shutdown", "RankError", "LaunchTimeout", "RunResult", "RankInfo", "PRELOAD",
           "DEFAULT_TIMEOUT_S"]
