"""The grader's box around one notebook: memory limit, notebook time limit, every process ended and counted,
files written in the scratch folder. A three-cell notebook, no lab: a few seconds of kernel time. (Under
bubblewrap when it is installed, the default; the hostile cases are tests/test_grade_hostile.py.)"""
from __future__ import annotations

import asyncio
import time

import nbformat
import pytest

from course_lib.apps.grading.sandbox import Limits, run_boxed, tagged_processes

pytestmark = pytest.mark.timeout(120)


def _nb(*sources: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def _errors(cell) -> list[str]:
    return [o.ename for o in cell.outputs if o.output_type == "error"]


def test_memory_limit_files_and_escaped_processes(tmp_path):
    nb = _nb(
        "x = bytearray(6 << 30)",                                             # over the 2 GiB limit
        "import os, subprocess, sys\n"
        "daemon = subprocess.Popen(['sleep', '600'], start_new_session=True)   # leaves the kernel's session\n"
        "open('written.txt', 'w').write('here'); print(os.getcwd())",
    )
    run = asyncio.run(run_boxed(nb, tmp_path, Limits(cell_s=30, notebook_s=60, memory_bytes=2 << 30)))
    assert run.stopped is None
    assert _errors(nb.cells[0]) == ["MemoryError"]
    assert _text(nb.cells[1]).strip() == str(tmp_path) and (tmp_path / "written.txt").read_text() == "here"
    assert run.processes >= 2                      # the kernel and the sleep it left, counted while the kernel ran
    assert tagged_processes(run.tag) == []         # the sleep died with the box (or was killed by the reaper)


def test_a_cell_over_its_limit_is_interrupted_and_the_notebook_goes_on(tmp_path):
    nb = _nb("while True:\n    pass", "print('next cell ran')")
    run = asyncio.run(run_boxed(nb, tmp_path, Limits(cell_s=3, notebook_s=60)))
    assert run.timed_out_cells == [0] and _errors(nb.cells[0])[0] == "CellTimeout"
    assert _text(nb.cells[1]) == "next cell ran\n"


@pytest.mark.slow
def test_a_kernel_that_ignores_interrupts_is_stopped_at_the_notebook_limit(tmp_path):
    # an idle loop: the busy one is the test above; this one need not take a core from the other worker for 5 s
    nb = _nb("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.05)",
             "print('never')")
    start = time.monotonic()
    run = asyncio.run(run_boxed(nb, tmp_path, Limits(cell_s=2, notebook_s=5)))
    assert "time limit" in (run.stopped or "") and time.monotonic() - start < 40
    assert "never" not in _text(nb.cells[1]) and run.processes >= 1
    assert tagged_processes(run.tag) == []
