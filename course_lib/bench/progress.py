"""Progress for the labs' long cells: every cell that runs longer than ~10 s on 2 cores shows it is alive.

A tqdm bar (``tqdm.auto``: a widget in JupyterLab, text on stderr in a terminal), as the capstone's training loop
shows one. Two kinds:

* :func:`bar` -- over known stages (configurations measured, calibration stages, profiled settings);
* :func:`clock` -- for one blocking job whose stages a cell cannot see (a two-node torchrun job): the seconds
  elapsed against the usual duration, updated while the job runs.

Notebook cells that use them are timing cells (``nbval-ignore-output``): a bar's text is never compared.
"""
from __future__ import annotations

import sys
import time

__all__ = ["bar", "clock"]


def bar(iterable=None, desc: str = "", *, total: int | None = None, unit: str = "it", **kwargs):
    """A tqdm bar on stderr (a widget in a notebook): around an ``iterable``, or with a ``total`` as a context
    manager (``update(1)`` per stage)."""
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True, **kwargs)


def clock(done, desc: str, expect_s: float, poll_s: float = 0.5, timeout_s: float | None = None) -> float:
    """Wait until ``done()`` is true, showing the seconds elapsed against ``expect_s`` (the usual duration; past it
    the bar stays full and the count goes on). Returns the seconds waited; ``TimeoutError`` past ``timeout_s``."""
    t0 = time.monotonic()
    usual = max(1, round(expect_s))
    with bar(desc=desc, total=usual, unit="s",
             bar_format="{desc}: {n:.0f} s elapsed (usually ~" + str(usual) + " s) |{bar}|") as b:
        while True:
            finished, elapsed = done(), time.monotonic() - t0
            b.total = max(usual, elapsed)
            b.n = elapsed
            b.refresh()
            if finished:
                return elapsed
            if timeout_s is not None and elapsed > timeout_s:
                raise TimeoutError(f"{desc}: not finished within {timeout_s:g} s")
            time.sleep(poll_s)
