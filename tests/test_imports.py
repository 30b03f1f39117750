"""``runtime.imports.import_quickly``: the collector paused while modules import, then frozen, and left as found."""
import gc
import sys

import pytest

from course_lib.runtime.imports import import_quickly


def test_imports_then_freezes_and_turns_the_collector_back_on():
    sys.modules.pop("colorsys", None)
    frozen_before = gc.get_freeze_count()
    seen = []
    gc.callbacks.append(lambda phase, info: seen.append(phase))
    try:
        import_quickly(["colorsys"])
    finally:
        gc.callbacks.pop()
    assert "colorsys" in sys.modules
    assert seen == [], "the collector ran while the modules imported"
    assert gc.get_freeze_count() > frozen_before
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off_and_an_import_error_is_not_swallowed():
    gc.disable()
    try:
        with pytest.raises(ModuleNotFoundError, match="course_lib_no_such_module"):
            import_quickly(["colorsys", "course_lib_no_such_module"])
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ModuleNotFoundError):
        import_quickly(["course_lib_no_such_module"])
    assert gc.isenabled()


def test_in_a_kernel_the_cell_that_imports_course_lib_runs_with_the_collector_paused():
    """An IPython shell (what a Jupyter kernel runs): paused during the importing cell, frozen and back on after it;
    outside IPython, nothing happens."""
    import subprocess
    code = """
import gc
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell("import gc, course_lib, colorsys\\nduring = gc.isenabled()")
print(shell.user_ns["during"], gc.isenabled(), gc.get_freeze_count() > 0)
shell.run_cell("import json")
print(gc.isenabled(), len(shell.events.callbacks["post_run_cell"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    during, after, frozen, after_next, _ = out.stdout.split()
    assert (during, after, frozen, after_next) == ("False", "True", "True", "True"), out.stdout
    from course_lib.runtime.imports import quicker_first_cell
    assert quicker_first_cell() is False and gc.isenabled()      # pytest: no IPython shell, nothing changes
