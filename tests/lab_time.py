"""Each lab's stated run time, kept honest by the suite's own runs of the labs.

A lab's first cell says how long the notebook takes when run untouched, in a sentence this module reads::

    Run untouched, the notebook takes 1–4 min on 2 CPU cores.

The suite runs every lab as shipped once (``labs/07``-``08`` under nbval, timed by the root ``conftest.py``;
``labs/00``-``06`` with a wrong answer in each exercise, which takes the same reference fallback as a stub, timed by
``tests/test_labs_wrong_answers.py``) and :func:`check` fails the run when the measured time leaves the stated
range. The suite runs on a loaded machine (two workers, other jobs), and its Lab 06 skips the two-node cells and its
Lab 08 times fewer steps (``COURSE_LIB_QUICK``), so the check allows ``SLACK``: half the low end to twice the high
end (a quarter of the low end for a quick run: Lab 08's timing loops shrink, nothing else does). A lab whose run drifts further than that has a wrong sentence: measure it (``make solutions`` prints each
notebook's seconds) and restate it.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

#: "takes 1–4 min on 2 CPU cores", "takes 20–60 s on 2 CPU cores" (en dash or hyphen)
STATED = re.compile(r"takes (\d+(?:\.\d+)?)\s*[–-]\s*(\d+(?:\.\d+)?) (s|min) on 2 CPU cores")
SLACK = (0.5, 2.0)
QUICK_LOW = 0.25
#: Labs whose first cell does not carry the sentence yet (their notebooks are edited elsewhere).
NOT_STATED_YET = ("00", "04", "09")


def stated_seconds(notebook: Path) -> tuple[float, float] | None:
    """``(low, high)`` seconds the lab's first cell states, or None when it states none."""
    first = nbformat.read(notebook, as_version=4).cells[0].source
    m = STATED.search(first.replace("\n", " "))
    if m is None:
        return None
    scale = 60 if m[3] == "min" else 1
    return float(m[1]) * scale, float(m[2]) * scale


def problem(notebook: Path, seconds: float, quick: bool = False) -> str | None:
    """Why ``seconds`` (a measured untouched run; ``quick``: under ``COURSE_LIB_QUICK=1``) contradicts the lab's
    stated time, or None when it does not."""
    rng = stated_seconds(notebook)
    if rng is None:
        if notebook.name[:2] in NOT_STATED_YET:
            return None
        return (f"{notebook.name}: its first cell states no run time; add 'Run untouched, the notebook takes "
                f"LOW–HIGH min on 2 CPU cores.' (measured here: {seconds:.0f} s)")
    lo, hi = rng
    low = (QUICK_LOW if quick else SLACK[0]) * lo
    if low <= seconds <= SLACK[1] * hi:
        return None
    return (f"{notebook.name}: ran in {seconds:.0f} s{' (quick)' if quick else ''}, but its first cell states "
            f"{lo:.0f}–{hi:.0f} s (allowed with a loaded machine's slack: {low:.0f}–{SLACK[1] * hi:.0f} s): "
            "measure it and restate it")
