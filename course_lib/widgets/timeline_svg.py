"""The traffic timeline drawn as SVG: one row per rank, a box per collective, phase bands behind, a time axis.

Pure drawing from :func:`course_lib.maths.traffic.traffic_rows` rows (no widgets); :mod:`course_lib.widgets.traffic`
puts it in the traffic widget. Every box is at least :data:`MIN_BOX` px wide and named ("RS" inside it,
or above it when it is too short to hold its name), so a 0.1 ms reduce-scatter beside a 40 ms all-gather
is still seen. Times are shown in ms from the first collective's start (never negative: see :func:`time_origin`), with
ticks at round values. Collectives are numbered in run order, 1 to n (:func:`run_order`): the number the
widget's slider and detail line use too.
"""
from __future__ import annotations

import math

from course_lib.widgets.base import esc, rank_color, svg_size

__all__ = ["traffic_svg", "run_order", "time_origin", "time_ticks", "axis_colors", "PHASE_COLORS", "OP_SHORT",
           "MIN_BOX"]

PHASE_COLORS = {"forward": "#e3ecfa", "backward": "#fbe5e1", "optimizer": "#e2f3e4", None: "#f2f2f2"}
OP_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC", "all_to_all": "A2A",
            "collective_permute": "CP", "reduce": "R", "gather": "G", "scatter": "S", "send": "SD", "recv": "RV"}
MIN_BOX = 6.0   # px: the narrowest box drawn, however short the collective
#: Box colours by mesh axis (``color_by="axis"``), in order of first appearance; no axis recorded: grey.
_AXIS_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def axis_colors(rows: list[dict]) -> dict:
    """``{axis: colour}`` for the axes of ``rows`` (sorted, so a colour means the same axis in every view)."""
    axes = sorted({r.get("axis") for r in rows if r.get("axis")})
    out = {a: _AXIS_PALETTE[k % len(_AXIS_PALETTE)] for k, a in enumerate(axes)}
    return {**out, None: "#888888"}

_LBL, _W, _RIGHT = 84, 560, 28        # rank labels | timeline | room for the last tick label
_ROWH, _BOX_Y, _BOX_H = 46, 25, 18    # per row: two lines of labels (for short boxes) above the box
_CHAR = 6.8                           # px per character of an 11 px op label (to know whether it fits)


def run_order(rows: list[dict]) -> list[dict]:
    """The rows in the order the run issued them (aligned start time, then rank): collective 1, 2, ... n."""
    return sorted(rows, key=lambda r: (r["x0"], r["rank"], r["i"]))


def time_origin(rows: list[dict]) -> float:
    """Seconds subtracted from every time shown: the earliest collective's start, so the axis starts where the
    first collective does (not at the ledger's reset, seconds earlier: a rank's start-up, a model's build) and no
    time reads negative (aligning the ranks' clocks may move one before the reset)."""
    return min([r["x0"] for r in rows if r["start"] is not None], default=0.0)


def _nice_step(span: float, target: int = 5) -> float:
    raw = span / target if span > 0 else 1.0
    k = 10 ** math.floor(math.log10(raw))
    return next(m * k for m in (1, 2, 5, 10) if m * k >= raw * (1 - 1e-9))


def time_ticks(lo: float, hi: float, target: int = 5) -> tuple[float, float, list[float]]:
    """``(axis start, axis end, ticks)`` in ms for boxes from ``lo`` to ``hi`` ms (both >= 0): ticks at round
    values (1, 2 or 5 x 10^k apart); the axis starts at 0 unless the boxes start late (a step shown alone)."""
    hi = max(hi, lo + 1e-6)
    if lo <= 0.5 * hi:
        a0, step = 0.0, _nice_step(hi, target)
    else:
        step = _nice_step(hi - lo, target)
        a0 = math.floor(lo / step + 1e-9) * step
    ticks = [a0 + j * step for j in range(int((hi - a0) / step + 1e-9) + 1)]
    return a0, hi, ticks


def _fmt_tick(v: float, step: float) -> str:
    return f"{v:.{max(0, math.ceil(-math.log10(step) - 1e-9))}f}"


def _axis(out: list, a0: float, a1: float, ticks: list[float], sx, top: int, y: int) -> None:
    """Grid lines behind the rows, then the axis line with its ticks and labels (ms)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else max(a1 - a0, 1e-3)
    for j, t in enumerate(ticks):
        x = sx(t)
        out.append(f'<line class="tick" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y + 4}" stroke="#e4e4e4"/>')
        unit = " ms" if j == len(ticks) - 1 else ""
        out.append(f'<text class="tick-label" x="{x:.1f}" y="{y + 16}" text-anchor="middle" font-size="12">'
                   f"{_fmt_tick(t, step)}{unit}</text>")
    out.append(f'<line x1="{_LBL}" y1="{y}" x2="{_LBL + _W}" y2="{y}" stroke="#888"/>')


def _label(out: list, r: dict, x0: float, wd: float, y: int, ends: list[float], bold: bool) -> None:
    """The op's initials inside its box, or above it (on the first of two lines where it does not overlap
    the label before it), joined to the box by a short line."""
    text = OP_SHORT.get(r["op"], r["op"])
    tw = _CHAR * len(text)
    weight = ' font-weight="bold"' if bold else ""
    if wd >= tw + 4:
        out.append(f'<text class="op-label" x="{x0 + wd / 2:.1f}" y="{y + _BOX_Y + 13}" text-anchor="middle" '
                   f'fill="white" font-size="11"{weight}>{text}</text>')
        return
    cx = x0 + wd / 2
    free = [k for k in (0, 1) if cx - tw / 2 >= ends[k] + 4]
    k = free[0] if free else min((0, 1), key=lambda k: ends[k])
    ends[k] = cx + tw / 2
    base = y + (_BOX_Y - 4 if k == 0 else _BOX_Y - 14)
    out.append(f'<line x1="{cx:.1f}" y1="{base + 1}" x2="{cx:.1f}" y2="{y + _BOX_Y}" stroke="{rank_color(r["rank"])}"/>'
               f'<text class="op-label" x="{cx:.1f}" y="{base - 1}" text-anchor="middle" font-size="11" '
               f'fill="{rank_color(r["rank"])}"{weight}>{text}</text>')


def traffic_svg(rows: list[dict], highlight: int | None = None, origin: float | None = None,
                color_by: str = "rank") -> str:
    """The timeline: one row per rank, a box per collective (rank colour, op initials), phase bands behind,
    the gaps between boxes are compute (or waiting). Hover a box for its record.

    ``highlight``: the ledger index ``i`` of the row to outline. ``origin``: seconds subtracted from every
    time (default :func:`time_origin` of ``rows``; the widget passes the whole ledger's, so a step shown
    alone keeps its times). ``color_by``: ``"rank"`` (default) or ``"axis"`` (the mesh axis each ran over)."""
    if color_by not in ("rank", "axis"):
        raise ValueError(f"color_by={color_by!r}: 'rank' or 'axis'")
    by_axis = axis_colors(rows)
    fill = (lambda r: rank_color(r["rank"])) if color_by == "rank" else (lambda r: by_axis[r.get("axis")])  # noqa: E731
    ranks = sorted({r["rank"] for r in rows})
    if not rows:
        return (f'<svg class="traffic-timeline" xmlns="http://www.w3.org/2000/svg" {svg_size(300, 30)}>'
                '<text x="4" y="18">no collectives</text></svg>')
    timed = any(r["start"] is not None for r in rows)
    o = (time_origin(rows) if origin is None else origin) if timed else 0.0
    scale = 1e3 if timed else 1.0    # ms, or positions in program order
    t = lambda x: (x - o) * scale    # noqa: E731
    lo, hi = min(t(r["x0"]) for r in rows), max(t(r["x1"]) for r in rows)
    a0, a1, ticks = time_ticks(max(lo, 0.0), hi) if timed else (lo, hi, [])
    span = (a1 - a0) or 1.0
    sx = lambda v: _LBL + (v - a0) / span * _W  # noqa: E731
    order = {r["i"]: k for k, r in enumerate(run_order(rows), 1)}
    n, top, y_axis = len(rows), 4, 4 + _ROWH * len(ranks) + 2
    h = y_axis + (40 if timed else 22)
    out = [f'<svg class="traffic-timeline" xmlns="http://www.w3.org/2000/svg" {svg_size(_LBL + _W + _RIGHT, h)} '
           'font-family="sans-serif" font-size="12">']
    if timed:
        _axis(out, a0, a1, ticks, sx, top, y_axis)
    for j, rk in enumerate(ranks):
        y = top + j * _ROWH
        mine = [r for r in rows if r["rank"] == rk]
        label = f"rank {rk}" if rk >= 0 else "all devices"
        busy = sum(r["x1"] - r["x0"] for r in mine) * scale
        gaps = max(0.0, (max(r["x1"] for r in mine) - min(r["x0"] for r in mine)) * scale - busy)
        tip = (f"{len(mine)} collectives, {busy:.3f} ms in collectives, {gaps:.3f} ms between them "
               "(compute or waiting)") if timed else f"{len(mine)} collectives in program order"
        out.append(f'<text x="{_LBL - 6}" y="{y + _BOX_Y + 13}" text-anchor="end" fill="{rank_color(rk)}" '
                   f'font-weight="bold">{label}<title>{tip}</title></text>')
        run = None  # phase bands: contiguous (step, phase) runs on this rank
        for r in mine + [None]:
            key = None if r is None else (r["step"], r["phase"])
            if run and (r is None or key != run[0]):
                x0, x1 = sx(t(run[1])), sx(t(run[2]))
                what = ", ".join(s for s in (None if run[0][0] is None else f"step {run[0][0]}", run[0][1] or "no phase") if s)
                out.append(f'<rect class="phase-band" x="{x0:.1f}" y="{y + 1}" width="{max(x1 - x0, MIN_BOX):.1f}" '
                           f'height="{_ROWH - 2}" fill="{PHASE_COLORS.get(run[0][1], PHASE_COLORS[None])}">'
                           f"<title>{esc(what)}</title></rect>")
                run = None
            if r is not None:
                run = [key, r["x0"], r["x1"]] if run is None else [run[0], run[1], r["x1"]]
        out.append(f'<line x1="{_LBL}" y1="{y + _BOX_Y + _BOX_H / 2:g}" x2="{_LBL + _W}" y2="{y + _BOX_Y + _BOX_H / 2:g}" '
                   'stroke="#ccc" stroke-dasharray="2 2"><title>gaps between collectives: compute (or waiting)</title></line>')
        ends = [-math.inf, -math.inf]
        for r in sorted(mine, key=lambda r: r["x0"]):
            x0, x1 = sx(t(r["x0"])), sx(t(r["x1"]))
            wd = max(x1 - x0, MIN_BOX)
            x0 = min(x0, _LBL + _W - wd)
            when = (f"{t(r['x0']):.3f} to {t(r['x1']):.3f} ms" + ("" if r["end"] is not None else " (end not recorded)")
                    if r["start"] is not None else "no timing (compiled program)")
            where = ", ".join(s for s in ("all devices" if r["rank"] < 0 else f"rank {r['rank']}",
                                          None if r["step"] is None else f"step {r['step']}", r["phase"]) if s)
            tip = (f"collective {order[r['i']]} of {n}: {where}: {r['op']} {r['dtype']} payload {r['payload']:,} B "
                   f"over {r['group_size']} ({r['group']}) -> {r['wire']:,.0f} wire B; {when}")
            lit = highlight == r["i"]
            stroke = 'stroke="black" stroke-width="2"' if lit else 'stroke="white" stroke-width="0.5"'
            out.append(f'<g class="collective" data-op="{r["op"]}" data-rank="{r["rank"]}" data-k="{order[r["i"]]}">'
                       f'<title>{esc(tip)}</title><rect x="{x0:.1f}" y="{y + _BOX_Y}" width="{wd:.1f}" height="{_BOX_H}" '
                       f'fill="{fill(r)}" {stroke}/>')
            _label(out, r, x0, wd, y, ends, lit)
            out.append("</g>")
    unit = ("time in ms (ranks' clocks aligned on the ends of their collectives)" if timed
            else "program order (a compiled SPMD program: one row for all devices, no timings)")
    out.append(f'<text x="{_LBL}" y="{h - 4}" font-size="11" fill="#444">{unit}</text></svg>')
    return "".join(out)
