"""Authoring: derive labs/ from solutions/, validate notebooks, run them all headless.

Vocabulary (used by the CLI, the tests and the README):

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
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from course_lib.runtime import BANNER_PREFIX

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


def _read(path: Path) -> nbformat.NotebookNode:
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
    lab = make_lab(_read(solution), where=_rel(solution))
    text = nbformat.writes(lab, version=4)
    return text if text.endswith("\n") else text + "\n"


def _rel(path: Path) -> str:
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
    stale = [f"{_rel(p)}: missing" for p, t in plan.items() if not p.exists()]
    stale += [f"{_rel(p)}: out of date" for p, t in plan.items()
              if p.exists() and p.read_bytes() != t.encode("utf-8")]
    stale += [f"{_rel(p)}: no solution {_rel(Path(src) / p.name)}"
              for p in sorted(Path(dst).glob(LAB_GLOB)) if p not in plan]
    return stale


# ---------------------------------------------------------------------------------------- validate
_TIME = re.compile(r"Time:\s*~?\s*(\d+(?:\.\d+)?)(?:\s*[-–]\s*\d+(?:\.\d+)?)?\s*(min|minutes?|h|hours?)\b",
                   re.IGNORECASE)


def validate_notebook(path: Path) -> list[str]:
    """Problems with one solution notebook ([] when it follows the course's conventions)."""
    where = _rel(Path(path))
    try:
        nb = _read(Path(path))
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
        problems.append(f"{where}: the first code cell (setup) must print runtime.banner(), "
                        f"the '{BANNER_PREFIX} ...' line run-solutions reports")
    return problems


# ------------------------------------------------------------------------------------ run-solutions
@dataclass
class RunResult:
    notebook: str
    ok: bool
    status: str          #: "ok", or "FAILED cells[i]: <first error line>"
    seconds: float
    backend: str = "-"
    devices: str = "-"


def parse_banner(line: str) -> tuple[str, str]:
    """(backend, devices) from a ``runtime.banner()`` line, e.g. ('gloo x4', 'jax 8xcpu simulated')."""
    words = line.split(BANNER_PREFIX, 1)[1].split()
    fields: dict[str, str] = {}
    last = None
    for w in words:
        if "=" in w:
            last, value = w.split("=", 1)
            fields[last] = value
        elif last:                      # a bare word qualifies the field before it ("simulated")
            fields[last] += " " + w
    backend = fields.get("backend", "-") + (f" x{fields['ranks']}" if "ranks" in fields else "")
    devices = [f"{fields['gpus']} GPU"] if "gpus" in fields else ["CPU"]
    if "jax_devices" in fields:
        devices.append(f"jax {fields['jax_devices']}")
    return backend, ", ".join(devices)


def _banner_from(nb) -> tuple[str, str]:
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") if out.get("output_type") == "stream" else \
                out.get("data", {}).get("text/plain", "")
            for line in (text if isinstance(text, str) else "".join(text)).splitlines():
                if line.startswith(BANNER_PREFIX):
                    return parse_banner(line)
    return "-", "-"


def _kernel_manager_class(socket_dir: str):
    """A KernelManager whose 'python3' is this interpreter, whatever kernelspecs are installed,
    talking over Unix sockets in ``socket_dir`` (local only; no unencrypted-TCP warning)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    class CurrentEnvSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    class CurrentEnvKernelManager(KernelManager):
        def __init__(self, **kw):
            kw.setdefault("kernel_spec_manager", CurrentEnvSpecs())
            kw.setdefault("transport", "ipc")
            kw.setdefault("ip", str(Path(socket_dir) / "kernel"))
            super().__init__(**kw)
    return CurrentEnvKernelManager


def run_notebook(path: Path, timeout: float = 600) -> RunResult:
    """Execute one notebook headless, cwd = its folder; never raises for a failing notebook."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    path = Path(path)
    current = {"index": -1}
    start = time.perf_counter()
    nb = None
    sockets = tempfile.TemporaryDirectory(prefix="course-nb-")
    try:
        nb = _read(path)
        for cell in nb.cells:          # stale stored outputs must not feed the table
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        client = NotebookClient(
            nb, kernel_manager_class=_kernel_manager_class(sockets.name), kernel_name="python3",
            timeout=timeout, allow_errors=False,
            resources={"metadata": {"path": str(path.parent.resolve())}},
            on_cell_start=lambda cell, cell_index: current.update(index=cell_index))
        client.execute()
        status = "ok"
    except CellExecutionError as exc:
        line = (exc.evalue or "").strip().splitlines()
        status = f"FAILED cells[{current['index']}]: {exc.ename}: {line[0] if line else ''}".rstrip(": ")
    except CellTimeoutError:
        status = f"FAILED cells[{current['index']}]: timed out after {timeout:g} s"
    except DeadKernelError:
        status = f"FAILED cells[{current['index']}]: the kernel died"
    except Exception as exc:  # unreadable notebook, kernel that will not start, ...
        status = f"FAILED: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    sockets.cleanup()
    seconds = time.perf_counter() - start
    status = re.sub(r"\x1b\[[0-9;]*m", "", status)
    backend, devices = _banner_from(nb) if nb is not None else ("-", "-")
    return RunResult(_rel(path), status == "ok", status, seconds, backend, devices)


def run_all(paths: list[Path], timeout: float = 600) -> list[RunResult]:
    """Run notebooks one after another (they start rank processes: no parallelism here)."""
    from tqdm.auto import tqdm
    results = []
    bar = tqdm(paths, desc="notebooks", unit="nb", file=sys.stderr, dynamic_ncols=True)
    for path in bar:
        bar.set_postfix_str(Path(path).name)
        results.append(run_notebook(path, timeout))
    bar.close()
    sys.stderr.flush()
    return results


def format_table(results: list[RunResult], width: int = 72) -> str:
    """The one-screen summary: notebook, status, seconds, backend, devices."""
    rows = [("notebook", "status", "seconds", "backend", "devices")]
    for r in results:
        status = r.status if len(r.status) <= width else r.status[: width - 1] + "…"
        rows.append((r.notebook, status, f"{r.seconds:.1f}", r.backend, r.devices))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    fmt = "  ".join(f"{{:{'>' if i == 2 else '<'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*rows[0]).rstrip(), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*row).rstrip() for row in rows[1:]]
    failed = sum(not r.ok for r in results)
    total = sum(r.seconds for r in results)
    lines.append(f"{len(results) - failed} ok, {failed} failed, {total:.1f} s in all")
    return "\n".join(lines)
