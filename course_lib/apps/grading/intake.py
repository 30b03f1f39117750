"""What the grader is handed: find the submissions, name their learners, refuse bad ones with a named error.

**Learner names** (the convention docs/grading.md states):

* ``CLASS/alice/02_memory.ipynb`` -- a file named like a lab (``NN_*.ipynb``): the learner is its folder;
* ``CLASS/alice_02_memory.ipynb`` (or ``alice-02_...``, ``alice.02_...``): what comes before the lab's
  ``NN_`` is the learner.

**Refused, each with one named error line** (the others are still graded): not a notebook (a file that is
not ``.ipynb``, or JSON that is not nbformat 4), broken JSON, an empty folder, a name that gives no lab
number, a lab the course does not have, a notebook of another lab (its title is not the lab's), another
version of the lab (the check cells of the lab as shipped are not all in it), and a duplicate (two
submissions of one lab for one learner: both refused, both paths named).

**Check cells** are the lab's code cells that call a check or record a prediction (``labNN.check_...(``,
``checks.prediction(``, ``checks.parity_check(``, ``checks.check(``). A learner never has to edit them, so
grading runs them *as shipped*: each is found by its cell id (or, in a notebook without ids, by its
source) and its source is restored before the run -- a learner's notebook cannot print its own ✅.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

__all__ = ["ShippedLab", "Submission", "Refused", "shipped_labs", "find_submissions", "is_check_cell"]

_LAB_FILE = re.compile(r"^(?P<lab>\d\d)_.*\.ipynb$")
_LEARNER_FILE = re.compile(r"^(?P<learner>.+?)[-_. ]+(?P<lab>\d\d)_.*\.ipynb$")
_CHECK_CALL = re.compile(r"\blab\d\d(?:_\w+)?\.check_\w+\(|\bchecks\.(?:prediction|parity_check|check)\(")


def is_check_cell(cell) -> bool:
    src = cell.get("source", "")
    return cell.get("cell_type") == "code" and bool(_CHECK_CALL.search(src)) and "NotImplementedError" not in src


def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            return cell.source.strip().splitlines()[0].lstrip("# ").strip()
    return ""


@dataclass
class ShippedLab:
    """The lab as the course ships it (``labs/NN_*.ipynb``)."""

    lab: str
    path: Path
    nb: nbformat.NotebookNode
    title: str
    check_cells: list[int]                   #: indices of its check cells


def shipped_labs(labs_dir: Path) -> dict[str, ShippedLab]:
    out = {}
    for path in sorted(Path(labs_dir).glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        out[path.name[:2]] = ShippedLab(path.name[:2], path, nb, _title(nb),
                                        [i for i, c in enumerate(nb.cells) if is_check_cell(c)])
    return out


@dataclass
class Submission:
    path: Path
    learner: str
    lab: ShippedLab
    nb: nbformat.NotebookNode                #: ready to run: outputs cleared, check cells as shipped
    notes: list[str] = field(default_factory=list)


@dataclass
class Refused:
    path: Path
    learner: str | None
    error: str                               #: "<kind>: <details>", one line


def _learner_and_lab(path: Path) -> tuple[str | None, str | None]:
    m = _LAB_FILE.match(path.name)
    if m:
        return path.parent.name or None, m.group("lab")
    m = _LEARNER_FILE.match(path.name)
    return (m.group("learner"), m.group("lab")) if m else (None, None)


def _prepare(nb, shipped: ShippedLab) -> tuple[nbformat.NotebookNode | None, str]:
    """(notebook ready to run, notes) or (None, why it is another version / lab)."""
    nb = copy.deepcopy(nb)
    by_id = {c.get("id"): c for c in nb.cells if c.get("id")}
    by_source = {c.source: c for c in nb.cells if c.cell_type == "code"}
    missing, restored = [], 0
    for i in shipped.check_cells:
        want = shipped.nb.cells[i]
        have = by_id.get(want.get("id")) or by_source.get(want.source)
        if have is None or have.cell_type != "code":
            missing.append(want.source.strip().splitlines()[0])
            continue
        if have.source != want.source:
            have.source, restored = want.source, restored + 1
    if missing:
        if _title(nb) != shipped.title:
            return None, f"a notebook of another lab: titled {_title(nb)!r}, lab {shipped.lab} is {shipped.title!r}"
        return None, (f"another version of lab {shipped.lab}: {len(missing)} of its {len(shipped.check_cells)} check "
                      f"cells are missing (first: {missing[0][:60]!r}); hand in {shipped.path.name} as shipped")
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.metadata.pop("widgets", None)
    return nb, (f"{restored} edited check cell(s) restored as shipped" if restored else "")


def _read(path: Path, shipped: dict[str, ShippedLab]) -> Submission | Refused:
    learner, lab = _learner_and_lab(path)
    if path.suffix != ".ipynb":
        return Refused(path, learner, "not a notebook: only .ipynb files are graded")
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
    except UnicodeDecodeError:
        return Refused(path, learner, "not a notebook: not UTF-8 text")
    except json.JSONDecodeError as exc:
        return Refused(path, learner, f"broken JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})")
    if not isinstance(raw, dict) or raw.get("nbformat") != 4 or not isinstance(raw.get("cells"), list):
        return Refused(path, learner, "not a notebook: JSON without nbformat 4 cells")
    try:
        nb = nbformat.reads(text, as_version=4)
        nbformat.validate(nb)
    except Exception as exc:
        return Refused(path, learner, f"not a notebook: {str(exc).strip().splitlines()[0][:120]}")
    if lab is None or learner is None:
        return Refused(path, learner, "no lab number in the name: name it LEARNER/NN_name.ipynb or LEARNER_NN_name.ipynb")
    if lab not in shipped:
        return Refused(path, learner, f"no lab {lab} in this course (labs: {', '.join(sorted(shipped))})")
    ready, note = _prepare(nb, shipped[lab])
    if ready is None:
        return Refused(path, learner, note)
    return Submission(path, learner, shipped[lab], ready, [note] if note else [])


def _files(arg: Path) -> tuple[list[Path], list[Refused]]:
    if not arg.exists():
        return [], [Refused(arg, None, "no such file or folder")]
    if arg.is_file():
        return [arg], []
    files = sorted(p for p in arg.rglob("*") if p.is_file() and not any(
        part.startswith(".") for part in p.relative_to(arg).parts))
    refused = []
    if not any(p.suffix == ".ipynb" for p in files):
        return [], [Refused(arg, None, "empty folder: no .ipynb notebook in it")]
    for sub in sorted(p for p in arg.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not any(p.suffix == ".ipynb" for p in files if sub in p.parents):
            refused.append(Refused(sub, sub.name, "empty folder: no .ipynb notebook in it"))
    return files, refused


def find_submissions(args: list[Path], labs_dir: Path) -> tuple[list[Submission], list[Refused]]:
    """Every submission under ``args`` (files or folders), and every refusal, each once."""
    shipped = shipped_labs(labs_dir)
    found: list[Submission] = []
    refused: list[Refused] = []
    seen: set[Path] = set()
    for arg in map(Path, args):
        files, bad = _files(arg)
        refused += bad
        for path in files:
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            got = _read(path, shipped)
            (found if isinstance(got, Submission) else refused).append(got)
    groups: dict[tuple[str, str], list[Submission]] = {}
    for s in found:
        groups.setdefault((s.learner, s.lab.lab), []).append(s)
    keep = []
    for (learner, lab), subs in groups.items():
        if len(subs) == 1:
            keep.append(subs[0])
            continue
        paths = ", ".join(str(s.path) for s in subs)
        refused += [Refused(s.path, learner, f"duplicate learner name: {learner!r} handed in lab {lab} "
                                             f"{len(subs)} times ({paths}); rename or remove all but one")
                    for s in subs]
    keep.sort(key=lambda s: (s.lab.lab, s.learner))
    return keep, refused
