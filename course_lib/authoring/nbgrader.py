"""Each lab as an nbgrader *source* notebook (``python -m course_lib make-labs --nbgrader DIR``).

nbgrader's ``generate_assignment`` makes the student version from a source notebook that holds the solutions
between the same ``### BEGIN SOLUTION`` / ``### END SOLUTION`` markers the course uses, and its
``autograde`` runs the *autograded test cells* (an exception = 0 points for that cell). So the source is
the solution (``### BEGIN HIDDEN`` regions removed, outputs cleared), with ``metadata.nbgrader`` on the
cells that matter (``{solution, grade, grade_id, points, locked, schema_version: 3}``):

* **solution cells** -- code cells holding a solution region: ``solution=True``, editable. (A markdown
  solution region, which no lab has today, would be a manually graded answer worth 1 point.)
* **autograded test cells** -- each exercise's check cell (``exN_ok = labNN.check_...(...)``), 1 point,
  locked, with one line added: ``assert exN_ok, ...``. The choice, and why: a course check never raises in
  a lab -- ❌ and ⏳ both print and return False, so that the lab can go on with the reference answer.
  nbgrader scores a test cell by whether it raises. Asserting the check's *return value* turns both a wrong
  answer and an unfinished stub into a failed cell, while the ❌ / ⏳ line with its diagnosis stays in the
  output above the AssertionError. Strict mode (``COURSE_LIB_STRICT_CHECKS=1`` in a hidden cell) would fail
  a wrong answer but give a stub full marks (⏳ is not an error), and it would stop the reference fallback.
* **read-only cells** -- the set-up cell and every other cell that checks or measures (predictions, parity
  checks): locked, so autograde runs them as shipped. The prediction cells (``my_... = None``) and
  everything else stay editable.

The grade ids name the lab and the check (``lab02_check_storage_bytes``), so a gradebook reads plainly.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from course_lib.authoring.labs import LAB_GLOB, AuthoringError, notebook_text, read_notebook, rel_path

__all__ = ["SCHEMA_VERSION", "nbgrader_source", "write_nbgrader_sources", "mirror_no_output_widgets"]

SCHEMA_VERSION = 3
_CHECK = re.compile(r"^(?P<var>\w+)\s*=\s*(?P<call>lab\d\d(?:_\w+)?\.(?P<check>check_\w+))\(", re.M)
_READ_ONLY = re.compile(r"\bchecks\.(?:prediction|parity_check|check)\(|course_lib\.banner\(")


def _drop_hidden(source: str) -> str:
    out, hidden = [], False
    for line in source.split("\n"):
        mark = line.strip()
        if re.fullmatch(r"###\s*BEGIN\s+HIDDEN", mark):
            hidden = True
        elif re.fullmatch(r"###\s*END\s+HIDDEN", mark):
            hidden = False
        elif not hidden:
            out.append(line)
    return "\n".join(out)


def _meta(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": SCHEMA_VERSION,
            "solution": solution}
    if grade:
        meta["points"] = points
    return meta


def nbgrader_source(nb: nbformat.NotebookNode, lab: str, where: str = "<notebook>") -> nbformat.NotebookNode:
    """The nbgrader source notebook for one solution (a new object)."""
    src = nbformat.from_dict(copy.deepcopy(nb))
    src.metadata.pop("widgets", None)
    problems = []
    for i, cell in enumerate(src.cells):
        cell.metadata.pop("nbgrader", None)
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        cell.source = _drop_hidden(cell.source)
        has_solution = "### BEGIN SOLUTION" in cell.source
        checks = _CHECK.findall(cell.source) if cell.cell_type == "code" else []
        if has_solution and cell.cell_type == "markdown":
            cell.metadata.nbgrader = _meta(f"lab{lab}_answer_{i}", solution=True, grade=True, points=1)
        elif has_solution:
            cell.metadata.nbgrader = _meta(f"lab{lab}_solution_{i}", solution=True)
        elif len(checks) == 1:
            var, call, check = checks[0]
            cell.source = (cell.source.rstrip() + f'\nassert {var}, "{check[len("check_"):]}: not solved yet '
                           f'(see the line above; checks.hint() helps)"')
            cell.metadata.nbgrader = _meta(f"lab{lab}_{check}", grade=True, locked=True, points=1)
        elif len(checks) > 1:
            problems.append(f"{where} cells[{i}]: {len(checks)} exercise checks in one cell; nbgrader scores a cell "
                            "as a whole: give each check its own cell")
        elif cell.cell_type == "code" and _READ_ONLY.search(cell.source):
            cell.metadata.nbgrader = _meta(f"lab{lab}_locked_{i}", locked=True)
    if problems:
        raise AuthoringError(problems)
    return src


def write_nbgrader_sources(src: Path, dst: Path) -> list[Path]:
    """``dst/NN_name.ipynb`` for every ``src/NN_name.ipynb`` (all authoring errors raised together)."""
    plan, problems = {}, []
    for sol in sorted(Path(src).glob(LAB_GLOB)):
        try:
            plan[Path(dst) / sol.name] = notebook_text(nbgrader_source(read_notebook(sol), sol.name[:2], rel_path(sol)))
        except AuthoringError as err:
            problems += err.problems
    if problems:
        raise AuthoringError(problems)
    for path, text in plan.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return list(plan)


def mirror_no_output_widgets() -> None:
    """For your ``nbgrader_config.py``: every notebook nbgrader runs in this process keeps what an ipywidgets
    ``Output`` widget captures as the cell's own outputs. Without it, ``autograde`` of a lab with an ``interact``
    cell (Lab 02) now and then waits out the whole cell timeout on an idle kernel
    (:func:`course_lib.authoring.run.without_output_widget_mirror` says why). Two lines in the config::

        from course_lib.authoring.nbgrader import mirror_no_output_widgets
        mirror_no_output_widgets()
    """
    from nbclient import NotebookClient

    from course_lib.authoring.run import without_output_widget_mirror
    init = NotebookClient.__init__
    if getattr(init, "mirrors_no_output_widgets", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        without_output_widget_mirror(self)

    __init__.mirrors_no_output_widgets = True
    NotebookClient.__init__ = __init__
