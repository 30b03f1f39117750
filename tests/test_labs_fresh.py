"""labs/ is exactly what `make labs` derives from solutions/, and solutions/ follows the conventions."""
from __future__ import annotations

from pathlib import Path

import pytest

from course_lib import authoring

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def test_labs_are_up_to_date():
    stale = authoring.stale_labs(ROOT / "solutions", ROOT / "labs")
    assert not stale, "labs/ is stale; run `make labs` and commit the result:\n  " + "\n  ".join(stale)


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.name for p in SOLUTIONS])
def test_solution_follows_the_conventions(path):
    problems = authoring.validate_notebook(path)
    assert not problems, "\n".join(problems)
