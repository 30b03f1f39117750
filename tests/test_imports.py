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
