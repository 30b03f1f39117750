"""Suite-wide switch for the learner copies in labs/.

labs/ runs every lab as learners receive it, outputs not compared; solutions/ runs the same cells with
their outputs compared. The two-node runs of Lab 06 (two network namespaces, throttled link, ~30 s) are
the same code in both, so they run once, in solutions/ (and in tests/test_netns.py): the labs/ kernels
start with ``COURSE_LIB_TWO_NODE=0`` and take the lab's own "skipped" branch, which a learner without
permission for namespaces also gets.
"""
import os
from pathlib import Path

import pytest

LABS = Path(__file__).resolve().parent / "labs"
_ORIGINAL = os.environ.get("COURSE_LIB_TWO_NODE")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # tryfirst: before the notebook's kernel starts (nbval starts it in the first cell's setup), so the
    # kernel inherits the setting.
    if LABS in Path(str(item.path)).resolve().parents:
        os.environ["COURSE_LIB_TWO_NODE"] = "0"
    elif _ORIGINAL is None:
        os.environ.pop("COURSE_LIB_TWO_NODE", None)
    else:
        os.environ["COURSE_LIB_TWO_NODE"] = _ORIGINAL
