"""Run notebooks headless and summarise them on one screen (``python -m course_lib run-solutions``).

:class:`NotebookRun` is one notebook's outcome (status, seconds, the backend and devices its banner
printed); :func:`format_table` is the instructor's one-screen summary.
"""
from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import re

from course_lib.authoring.labs import notebook_text, read_notebook, rel_path
from course_lib.runtime.devices import BANNER_PREFIX

__all__ = ["NotebookRun", "parse_banner", "run_notebook", "run_all", "format_table"]


@dataclass
class NotebookRun:
    notebook: str
    ok: bool
    status: str          #: "ok", or "FAILED cells[i]: <first error line>"
    seconds: float
    backend: str = "-"
    devices: str = "-"


def parse_banner(line: str) -> tuple[str, str]:
    """(backend, devices) from a ``course_lib.banner()`` line, e.g. ('gloo x4', 'jax 8xcpu simulated')."""
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


def without_output_widget_mirror(client):
    """``client`` (an nbclient ``NotebookClient``), set to keep what an ipywidgets ``Output`` widget captures as the
    cell's own outputs, instead of mirroring that widget. Returns ``client``.

    nbclient mirrors each ``Output`` widget (what ``ipywidgets.interact`` draws into) and sends its state back to
    the kernel on the shell socket, while another of its tasks waits on that socket for the cell's reply; now and
    then the reply's wake-up is lost and the run waits out its cell timeout although the kernel is idle
    (jupyter/nbclient#312, jupyter/nbconvert#2029). Here: Lab 02's ``interact`` cell, headless on a busy 2-core
    machine, stalled in 3 of 16 runs with the mirror and in none of 60 without it. Nobody watches a headless run's
    widgets; the picture the widget would hold is kept as an ordinary output."""
    client.widget_registry = {}
    return client


def run_notebook(path: Path, timeout: float = 600, write: bool = False) -> NotebookRun:
    """Execute one notebook headless, cwd = its folder; never raises for a failing notebook.

    ``write``: when every cell ran, save the executed notebook over ``path`` (how a solution's stored
    outputs, which nbval compares, are refreshed after a library change). A failing run writes nothing.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    path = Path(path)
    current = {"index": -1}
    start = time.perf_counter()
    nb = None
    sockets = tempfile.TemporaryDirectory(prefix="course-nb-")
    try:
        nb = read_notebook(path)
        for cell in nb.cells:          # stale stored outputs must not feed the table
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        client = without_output_widget_mirror(NotebookClient(
            nb, kernel_manager_class=_kernel_manager_class(sockets.name), kernel_name="python3",
            timeout=timeout, allow_errors=False,
            resources={"metadata": {"path": str(path.parent.resolve())}},
            on_cell_start=lambda cell, cell_index: current.update(index=cell_index)))
        client.execute()
        status = "ok"
        if write:
            path.write_text(notebook_text(nb), encoding="utf-8")
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
    return NotebookRun(rel_path(path), status == "ok", status, seconds, backend, devices)


def run_all(paths: list[Path], timeout: float = 600, write: bool = False) -> list[NotebookRun]:
    """Run notebooks one after another (they start rank processes: no parallelism here)."""
    from tqdm.auto import tqdm
    results = []
    bar = tqdm(paths, desc="notebooks", unit="nb", file=sys.stderr, dynamic_ncols=True)
    for path in bar:
        bar.set_postfix_str(Path(path).name)
        results.append(run_notebook(path, timeout, write))
    bar.close()
    sys.stderr.flush()
    return results


def format_table(results: list[NotebookRun], width: int = 72) -> str:
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
