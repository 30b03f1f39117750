"""The checks layer, exercise checks: one line of specific, friendly feedback per exercise.

:mod:`~course_lib.checks.core` runs a check (✅ / ⏳ / ❌) and gives hints, :mod:`~course_lib.checks.compare`
compares values (tolerances, detectors of likely mistakes), :mod:`~course_lib.checks.predict` sets a
learner's prediction beside the measurement; ``labNN`` holds lab NN's checks, named like its
tests (``tests/test_labNN_checks.py``), each declared once in :mod:`~course_lib.checks.registry` (which the
wrong-answer tests, the kill-rate table and grading read); :mod:`~course_lib.checks.fsdp_harness` trains a
learner's FSDP class on ranks for Lab 03 (DDP's numbers are computed by the judge). Every check is a run half and a
judge half (:mod:`~course_lib.checks.judge`): the run half hands plain data (:mod:`~course_lib.checks.plain`) to the
judge, which decides -- in the kernel in a lab, outside the box in grading. ``from course_lib import checks`` gives the framework's names.
"""
from course_lib.checks.compare import (TOLERANCES, assert_close, averaged_twice, not_updated, parity_check,
                                       skipped_collective, summed_not_averaged, wrong_shard_offset)
from course_lib.checks.core import (CheckFailed, Detector, check, current, hint, last_error, not_implemented_todo,
                                    register_hints, strict)
from course_lib.checks.predict import prediction
from course_lib.checks.registry import Exercise, exercise, exercises

__all__ = [
    "TOLERANCES", "CheckFailed", "Detector", "check", "current", "assert_close", "parity_check",
    "not_implemented_todo", "hint", "register_hints", "last_error", "strict", "summed_not_averaged", "averaged_twice", "skipped_collective",
    "wrong_shard_offset", "not_updated", "prediction", "Exercise", "exercise", "exercises",
]
