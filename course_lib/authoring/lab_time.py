"""Each lab's stated run time: read from its first cell, measured by ``python -m course_lib bench labs``.

A lab's first cell says how long the notebook takes when run untouched, in a sentence this module reads::

    Run untouched, the notebook takes 1–4 min on 2 CPU cores.

Where the numbers come from: ``bench labs`` runs every lab as shipped (stubs and all) on this machine, prints each
one's seconds beside the range its first cell states, and says which sentence to restate. Run it on a quiet
machine before changing a stated time; the measured figure in the sentence ("measured: 33 s") is that run's.

What the test suite asks of it (:func:`problem`): only an upper bound, with a wide margin. A lab that runs
*faster* than stated is never a failure (a fast laptop is not a bug), and a loaded CI machine may take several
times a quiet one's time (measured: a lab that ran in 6 s quiet took 25 s beside other jobs), so a run fails only
past ``SLOW_MARGIN`` times the high end: a lab whose cells grew well beyond its sentence.
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["STATED", "SLOW_MARGIN", "stated_seconds", "problem", "verdict"]

#: "takes 1–4 min on 2 CPU cores", "takes 20–60 s on 2 CPU cores" (en dash or hyphen)
STATED = re.compile(r"takes (\d+(?:\.\d+)?)\s*[–-]\s*(\d+(?:\.\d+)?) (s|min) on 2 CPU cores")
#: A run fails the suite only past this many times the stated high end (a loaded 2-core machine: ~4x quiet).
SLOW_MARGIN = 3.0


def stated_seconds(notebook: Path) -> tuple[float, float] | None:
    """``(low, high)`` seconds the lab's first cell states, or None when it states none."""
    import nbformat
    first = nbformat.read(notebook, as_version=4).cells[0].source
    m = STATED.search(first.replace("\n", " "))
    if m is None:
        return None
    scale = 60 if m[3] == "min" else 1
    return float(m[1]) * scale, float(m[2]) * scale


def problem(notebook: Path, seconds: float) -> str | None:
    """Why ``seconds`` (a measured untouched run, possibly on a loaded machine) contradicts the lab's stated time,
    or None when it does not. Never a lower bound: faster than stated is fine."""
    rng = stated_seconds(notebook)
    if rng is None:
        return (f"{notebook.name}: its first cell states no run time; add 'Run untouched, the notebook takes "
                f"LOW–HIGH min on 2 CPU cores.' (python -m course_lib bench labs measures it; here: {seconds:.0f} s)")
    lo, hi = rng
    if seconds <= SLOW_MARGIN * hi:
        return None
    return (f"{notebook.name}: ran in {seconds:.0f} s, over {SLOW_MARGIN:g}× the {lo:.0f}–{hi:.0f} s its first cell "
            "states (the margin a loaded machine needs): measure it on a quiet machine with "
            "'python -m course_lib bench labs' and restate it")


def verdict(notebook: Path, seconds: float) -> str:
    """One word for ``bench labs``' table: ``in range``, ``faster`` (fine, but the sentence may be restated),
    ``SLOWER`` (above the high end on a quiet run: restate it), or ``not stated``."""
    rng = stated_seconds(notebook)
    if rng is None:
        return "not stated"
    lo, hi = rng
    return "faster" if seconds < lo else "SLOWER" if seconds > hi else "in range"
