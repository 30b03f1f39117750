"""Predict, then measure: the learner writes a number down before running, the lab says how far off it was.

In a lab, a prediction is a variable the learner fills in a cell *before* the measuring cell runs::

    my_prediction = None          # bytes one rank sends in this all-reduce: write your number here

and after the measurement::

    checks.prediction("all-reduce bytes per rank", my_prediction, measured, unit="B")

It never fails: a prediction is for learning, not grading. It prints one line, with what was measured
and how far off the guess was (a ratio for sizes, so 2x too high reads the same as 2x too low).

A prediction is the learner's or absent: every lab ships its prediction variables as ``None``, and a value the lab
computed from a reference answer (an exercise not done yet) is passed as ``None`` too, with ``missing=`` saying why
(``tests/test_labs_wrong_answers.py`` and the root ``conftest.py`` fail a lab, run as received, that scores one).
Print only deterministic measurements (bytes, counts, shapes) in cells nbval compares.
"""
from __future__ import annotations

import math

__all__ = ["prediction"]


def _fmt(x: float, unit: str) -> str:
    text = f"{x:,.0f}" if float(x).is_integer() else f"{x:,.4g}"
    return f"{text} {unit}".rstrip()


def prediction(name: str, predicted, measured: float, *, unit: str = "", close: float = 0.10,
               missing: str = "no prediction written (set it in the cell above before running)") -> bool | None:
    """Print prediction vs measurement; True when within ``close`` (relative), None when no prediction
    (``missing`` says why there is none).

    >>> prediction("bytes", 750, 768, unit="B")
    🎯 bytes: you predicted 750 B, measured 768 B: 2.3% low — close (within 10%).
    True
    >>> prediction("bytes", None, 768, unit="B")
    🎯 bytes: no prediction written (set it in the cell above before running); measured 768 B.
    """
    if predicted is None or predicted is Ellipsis:
        print(f"🎯 {name}: {missing}; measured {_fmt(measured, unit)}.")
        return None
    try:
        p = float(predicted)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: the prediction must be a number, got {predicted!r}") from None
    m = float(measured)
    if m == p:
        print(f"🎯 {name}: you predicted {_fmt(p, unit)}, measured {_fmt(m, unit)}: exact.")
        return True
    if m == 0 or p <= 0 < m or math.isnan(p):
        print(f"🎯 {name}: you predicted {_fmt(p, unit)}, measured {_fmt(m, unit)}.")
        return False
    err = (p - m) / abs(m)
    good = abs(err) <= close
    if abs(err) < 1:
        how = f"{abs(err):.1%} {'high' if err > 0 else 'low'}"
    else:
        how = f"{p / m:.2g}x the measurement" if p > m else f"{m / p:.2g}x below it"
    verdict = f"close (within {close:.0%})." if good else "far off: re-read the formula above, then see why."
    print(f"🎯 {name}: you predicted {_fmt(p, unit)}, measured {_fmt(m, unit)}: {how} — {verdict}")
    return good
