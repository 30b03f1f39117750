"""Reading a check cell's printed lines into a verdict, and 🎯 lines into prediction scores (no kernel)."""
from __future__ import annotations

import io
from contextlib import redirect_stdout

from course_lib.apps.grading import verdicts as grading
from course_lib.checks import registry
from course_lib.checks.predict import prediction

EX = registry.find("02", "storage_bytes")


def _result(text: str, **kw):
    return grading.exercise_result(EX, text, **kw)


def test_solved_wrong_not_attempted():
    assert _result("✅ storage_bytes: 3 cases right\n").verdict == "solved"
    assert _result("⏳ storage_bytes: not implemented yet — ...\n   The check will test: x\n").verdict == "not attempted"
    wrong = _result("❌ storage_bytes: got 104 bytes, expected 52 bytes\n"
                    f"   likely mistake: numel × element_size {EX.mistakes['views counted twice']} and more\n"
                    "   The rest of the lab uses the reference answer until this check passes.\n")
    assert (wrong.verdict, wrong.mistake) == ("wrong", "views counted twice")
    assert wrong.detail.startswith("got 104 bytes") and "likely mistake:" in wrong.detail


def test_the_last_line_wins_when_a_check_is_re_run():
    assert _result("❌ storage_bytes: got 1\n✅ storage_bytes: ok\n").verdict == "solved"


def test_crashes_one_line_each():
    raised = _result("❌ storage_bytes: your code raised ZeroDivisionError at line 2: return 1 // 0: integer "
                     "division or modulo by zero\n   (full traceback: checks.last_error())\n")
    assert raised.verdict == "crashed" and raised.detail.startswith("your code raised ZeroDivisionError")
    timed = _result("", error="CellTimeout: ran past the cell limit (25 s) and was interrupted")
    assert (timed.verdict, timed.detail) == ("crashed", "CellTimeout: ran past the cell limit (25 s) and was interrupted")
    died = _result("", stopped="the kernel died (out of memory, a crash, or os._exit)")
    assert died.verdict == "crashed" and died.detail.startswith("not reached: the kernel died")
    assert _result("✅ other: fine\n").verdict == "crashed"        # this check printed nothing at all


def test_predictions_as_predict_prints_them():
    out = io.StringIO()
    with redirect_stdout(out):
        prediction("a", None, 768, unit="B")
        prediction("b", 768, 768, unit="B")
        prediction("c", 750, 768, unit="B")
        prediction("d", 100, 768, unit="B")
        prediction("e", 5, 0)
    got = [(p.name, p.score) for p in grading.predictions(out.getvalue())]
    assert got == [("a", "none"), ("b", "exact"), ("c", "close"), ("d", "far off"), ("e", "made")]
