"""Validate a solution notebook against the course's conventions (``python -m course_lib validate``)."""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

from course_lib.authoring.labs import AuthoringError, make_lab, read_notebook, rel_path
from course_lib.runtime.devices import BANNER_PREFIX

__all__ = ["validate_notebook"]


_TIME = re.compile(r"Time:\s*~?\s*(\d+(?:\.\d+)?)(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s*(min|minutes?|h|hours?)\b",
                   re.IGNORECASE)


def validate_notebook(path: Path) -> list[str]:
    """Problems with one solution notebook ([] when it follows the course's conventions)."""
    where = rel_path(Path(path))
    try:
        nb = read_notebook(Path(path))
        nbformat.validate(nb)
    except Exception as exc:  # any parse or schema error is reported, not raised
        return [f"{where}: not a valid nbformat v4 notebook: {str(exc).splitlines()[0]}"]
    problems = []
    if nb.nbformat != 4:
        problems.append(f"{where}: nbformat {nb.nbformat}, expected 4")
    if not re.fullmatch(r"\d\d_[\w-]+\.ipynb", Path(path).name):
        problems.append(f"{where}: name must be NN_name.ipynb (two digits, as in the syllabus)")
    if nb.metadata.get("kernelspec", {}).get("name") != "python3":
        problems.append(f"{where}: metadata.kernelspec.name must be 'python3'")
    cells = nb.cells
    if not cells or cells[0].cell_type != "markdown":
        problems.append(f"{where} cells[0]: must be a markdown cell with the title, "
                        "'Objectives' and 'Time:'")
    else:
        head = cells[0].source
        text = re.sub(r"[*_`]", "", head)
        if not re.match(r"\s*# \S", head):
            problems.append(f"{where} cells[0]: must start with a '# Title' heading")
        if not re.search(r"\bObjectives\b", text) or not re.search(r"^\s*(?:[-*]|\d+\.)\s+\S", head, re.M):
            problems.append(f"{where} cells[0]: needs an 'Objectives' list (at least one bullet)")
        m = _TIME.search(text)
        if not m:
            problems.append(f"{where} cells[0]: needs a time estimate such as 'Time: ~45 min'")
        else:
            minutes = float(m.group(1)) * (60 if m.group(2).lower().startswith("h") else 1)
            if not 5 <= minutes <= 240:
                problems.append(f"{where} cells[0]: 'Time:' of {minutes:g} min is implausible "
                                "for one lab (5-240 min); measure a dry run")
    try:
        make_lab(nb, where=where)
    except AuthoringError as err:
        problems += err.problems
    code = [c for c in cells if c.cell_type == "code"]
    if not code or "banner(" not in code[0].source:
        problems.append(f"{where}: the first code cell (setup) must print course_lib.banner(), "
                        f"the '{BANNER_PREFIX} ...' line run-solutions reports")
    return problems


