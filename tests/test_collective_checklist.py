"""Adding a collective: every place it must appear (the checklist in ``course_lib/comm/__init__.py``)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from course_lib import comm
from course_lib.comm.jax_ledger import HLO_OPS
from course_lib.comm.ledger import OPS
from course_lib.maths import costs
from course_lib.widgets.timeline_svg import OP_SHORT

TORCH_LEDGER = Path(comm.__file__).with_name("torch_ledger.py").read_text()


def missing_places(op: str) -> list[str]:
    """The checklist's places that do not know ``op`` (an empty list: the op is fully wired)."""
    missing = []
    if op not in OPS:
        missing.append("course_lib.comm.ledger.OPS")
    if op not in comm.JAX_ONLY and not re.search(rf'self\._record\("{re.escape(op)}"', TORCH_LEDGER):
        missing.append("course_lib.comm.torch_ledger (a backend method calling self._record)")
    if op not in comm.TORCH_ONLY and op not in HLO_OPS.values():
        missing.append("course_lib.comm.jax_ledger.HLO_OPS")
    table = costs.wire_bytes.__doc__ or ""
    if not re.search(rf"^\s*[\w, ]*\b{re.escape(op)}\b[\w, ]*\s{{2,}}", table, re.M):
        missing.append("the table in course_lib.maths.costs.wire_bytes's docstring")
    if op not in OP_SHORT and op != "barrier":          # a barrier moves nothing and is never drawn
        missing.append("course_lib.widgets.timeline_svg.OP_SHORT")
    return missing


@pytest.mark.parametrize("op", OPS)
def test_every_collective_is_in_every_place(op):
    assert missing_places(op) == [], f"{op} is missing from: {missing_places(op)}"


def test_the_exceptions_are_known_ops_and_disjoint():
    assert comm.JAX_ONLY <= set(OPS) and comm.TORCH_ONLY <= set(OPS)
    assert not comm.JAX_ONLY & comm.TORCH_ONLY


def test_the_checklist_names_a_new_op_everywhere_it_is_missing():
    """A collective added to OPS alone is reported in each of the other places."""
    assert missing_places("all_reduce_v") == [
        "course_lib.comm.ledger.OPS",
        "course_lib.comm.torch_ledger (a backend method calling self._record)",
        "course_lib.comm.jax_ledger.HLO_OPS",
        "the table in course_lib.maths.costs.wire_bytes's docstring",
        "course_lib.widgets.timeline_svg.OP_SHORT",
    ]
