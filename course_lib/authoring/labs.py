"""Authoring: derive labs/ from solutions/ (validating and running them: :mod:`.validate`, :mod:`.run`).

Vocabulary (used by the CLI, the tests, the README and docs/):

* **solution** -- a source notebook ``solutions/NN_name.ipynb``: complete, executed, outputs kept
  (nbval compares them).
* **lab** -- ``labs/NN_name.ipynb``, derived from the solution, never edited by hand: every solution
  region replaced by a stub, hidden regions removed, outputs and execution counts cleared.
* **region** -- the lines between two marker lines (markers are matched after stripping whitespace):

  ``### BEGIN SOLUTION`` ... ``### END SOLUTION``  (nbgrader's markers, so nbgrader works too)
      replaced, at the BEGIN line's indentation, by the **stub**::

          # YOUR CODE HERE
          raise NotImplementedError("Exercise not done yet: <hint>")

      ``<hint>`` comes from ``### HINT: ...`` line(s) right after BEGIN, else :data:`DEFAULT_HINT`.
      In a markdown cell the region becomes ``YOUR ANSWER HERE``.
  ``### BEGIN HIDDEN`` ... ``### END HIDDEN``
      removed from the lab entirely (instructor-only asserts).

* A solution region at indentation 0 is an authoring error: the stub's top-level ``raise`` would
  stop the lab, and a lab must run top to bottom. Put it in a function body, or in a
  ``with checks.check(...):`` block, which turns ``NotImplementedError`` into "not implemented yet".
* Cells are named ``cells[i]``: the index in the notebook's cell list, from 0, markdown included.
"""
from __future__ import annotations

import copy
import hashlib
import re
from pathlib import Path

import nbformat

__all__ = ["LAB_GLOB", "DEFAULT_HINT", "STUB_COMMENT", "MARKDOWN_STUB", "AuthoringError", "transform_source", "make_lab", "lab_text", "notebook_text", "read_notebook",
           "rel_path", "plan_labs", "write_labs", "stale_labs"]


LAB_GLOB = "[0-9][0-9]_*.ipynb"
DEFAULT_HINT = "fill in the code marked YOUR CODE HERE"
STUB_COMMENT = "# YOUR CODE HERE"
MARKDOWN_STUB = "YOUR ANSWER HERE"
_KINDS = ("SOLUTION", "HIDDEN")
_DROP_CELL_METADATA = ("execution",)      # nbclient's timestamps: differ on every run
_DROP_NB_METADATA = ("widgets",)          # saved widget state belongs to the outputs we clear


class AuthoringError(Exception):
    """One or more problems in the solutions, each naming file, cell and line."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def _marker(line: str) -> tuple[str, str] | None:
    """("BEGIN"|"END", "SOLUTION"|"HIDDEN") for a marker line, else None."""
    m = re.fullmatch(r"###\s*(BEGIN|END)\s+(SOLUTION|HIDDEN)", line.strip())
    return (m.group(1), m.group(2)) if m else None


def _stub(indent: str, hint: str, markdown: bool) -> list[str]:
    if markdown:
        return [f"{indent}{MARKDOWN_STUB}"]
    text = f"Exercise not done yet: {hint}".replace("\\", "\\\\").replace('"', '\\"')
    return [f"{indent}{STUB_COMMENT}", f'{indent}raise NotImplementedError("{text}")']


def transform_source(source: str, where: str = "<cell>", markdown: bool = False) -> str:
    """A solution cell's source -> the lab's. Raises :class:`AuthoringError` on bad markers."""
    lines = source.split("\n")
    out: list[str] = []
    problems: list[str] = []
    open_: tuple[str, int, str] | None = None    # (kind, 1-based line, indent) of the open BEGIN
    hint: list[str] = []
    for no, line in enumerate(lines, start=1):
        mk = _marker(line)
        if open_ is None:
            if mk is None:
                out.append(line)
            elif mk[0] == "END":
                problems.append(f"{where} line {no}: '### END {mk[1]}' without a matching BEGIN")
            else:
                indent = line[: len(line) - len(line.lstrip())]
                if mk[1] == "SOLUTION" and not indent and not markdown:
                    problems.append(
                        f"{where} line {no}: '### BEGIN SOLUTION' at indentation 0; the lab's "
                        "top-level raise would stop it. Put the region inside a function body "
                        "(or a `with check(...):` block)")
                open_, hint = (mk[1], no, indent), []
            continue
        kind, begin_no, indent = open_
        if mk is None:
            if not markdown and kind == "SOLUTION" and no == begin_no + 1 + len(hint) \
                    and line.strip().startswith("### HINT:"):
                hint.append(line.strip()[len("### HINT:"):].strip())
            continue
        if mk != ("END", kind):
            problems.append(f"{where} line {no}: '### {' '.join(mk)}' inside the "
                            f"'### BEGIN {kind}' region opened at line {begin_no} (no nesting)")
            continue
        if kind == "SOLUTION":
            out.extend(_stub(indent, " ".join(hint) or DEFAULT_HINT, markdown))
        open_ = None
    if open_ is not None:
        problems.append(f"{where} line {open_[1]}: '### BEGIN {open_[0]}' is never closed "
                        f"by '### END {open_[0]}'")
    if problems:
        raise AuthoringError(problems)
    return "\n".join(out)


def read_notebook(path: Path) -> nbformat.NotebookNode:
    return nbformat.reads(path.read_text(encoding="utf-8"), as_version=nbformat.NO_CONVERT)


def make_lab(nb: nbformat.NotebookNode, where: str = "<notebook>") -> nbformat.NotebookNode:
    """The lab derived from a solution notebook (a new object; ``nb`` is not modified)."""
    lab = nbformat.from_dict(copy.deepcopy(nb))
    for key in _DROP_NB_METADATA:
        lab.metadata.pop(key, None)
    lab.nbformat_minor = max(int(lab.get("nbformat_minor", 5)), 5)   # 4.5+: cells carry ids
    problems: list[str] = []
    for i, cell in enumerate(lab.cells):
        if "id" not in cell:   # from the file name and index: byte-identical from any folder
            cell["id"] = hashlib.sha1(f"{Path(where).name}:{i}".encode()).hexdigest()[:8]
        for key in _DROP_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if cell.cell_type in ("code", "markdown"):
            try:
                cell.source = transform_source(cell.source, f"{where} cells[{i}]",
                                               markdown=cell.cell_type == "markdown")
            except AuthoringError as err:
                problems += err.problems
    if problems:
        raise AuthoringError(problems)
    return lab


def lab_text(solution: Path) -> str:
    """The exact text ``labs/<name>`` must contain for this solution."""
    return notebook_text(make_lab(read_notebook(solution), where=rel_path(solution)))


def notebook_text(nb: nbformat.NotebookNode) -> str:
    """A notebook as the course stores it: nbformat v4 JSON ending in a newline."""
    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


def rel_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def plan_labs(src: Path, dst: Path) -> dict[Path, str]:
    """{lab path: text} for every ``src/NN_*.ipynb``; all authoring errors raised together."""
    plan, problems = {}, []
    for sol in sorted(Path(src).glob(LAB_GLOB)):
        try:
            plan[Path(dst) / sol.name] = lab_text(sol)
        except AuthoringError as err:
            problems += err.problems
    if problems:
        raise AuthoringError(problems)
    return plan


def write_labs(src: Path, dst: Path) -> list[Path]:
    """Write the labs that differ; return them. Idempotent: a second run writes nothing."""
    written = []
    for path, text in plan_labs(src, dst).items():
        if not path.exists() or path.read_bytes() != text.encode("utf-8"):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(text.encode("utf-8"))
            written.append(path)
    return written


def stale_labs(src: Path, dst: Path) -> list[str]:
    """Why labs/ differs from what make-labs would write ([] when up to date)."""
    plan = plan_labs(src, dst)
    stale = [f"{rel_path(p)}: missing" for p, t in plan.items() if not p.exists()]
    stale += [f"{rel_path(p)}: out of date" for p, t in plan.items()
              if p.exists() and p.read_bytes() != t.encode("utf-8")]
    stale += [f"{rel_path(p)}: no solution {rel_path(Path(src) / p.name)}"
              for p in sorted(Path(dst).glob(LAB_GLOB)) if p not in plan]
    return stale
