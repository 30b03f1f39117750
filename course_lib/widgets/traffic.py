"""The collective-traffic widget: a run's ledger as a per-rank timeline, bytes against the analytic cost,
totals per step and phase, and which mesh axis or group each collective used.

The data comes from :mod:`course_lib.maths.traffic` (plain Python, tested without a browser);
:class:`TrafficWidget` draws it (inline SVG from :mod:`course_lib.widgets.timeline_svg` in ipywidgets, hover a
box for its record) and :func:`traffic_figure` is the static matplotlib view used where no widget frontend exists
(see :mod:`course_lib.widgets`). Bytes: **payload** ``V`` is the ledger's; **wire** bytes are
``costs.wire_bytes`` of it (ring formulas, per rank). A torch ledger has one record per op per rank,
each rank's clock starting at its own reset (so rows are not aligned to the microsecond); a JAX-HLO
ledger has one record per op for all devices (``rank == -1``) and no times: its row is in program order.
"""
from __future__ import annotations

import ipywidgets as w

from course_lib.maths.traffic import as_ledger, group_label, traffic_by_group, traffic_compare, traffic_rows, traffic_totals
from course_lib.widgets.base import TABLE_CSS, StaticFallback, esc, fmt_bytes, new_figure, rank_color
from course_lib.widgets.timeline_svg import OP_SHORT, PHASE_COLORS, axis_colors, run_order, time_origin, traffic_svg

__all__ = ["show_traffic", "traffic_svg", "traffic_figure", "traffic_text", "TrafficWidget", "PHASE_COLORS", "OP_SHORT",
           "group_label", "traffic_rows", "traffic_totals", "traffic_by_group", "traffic_compare"]

ALL = -1    # "every step" in the step control (None would read as "no selection")


def _ratio_text(q) -> str:
    return "" if q is None else f"{q:.3f}"


def _compare_html(rows) -> str:
    body = "".join(
        f"<tr><td class=l>{r['phase'] or 'any'}</td><td class=l>{r['op']}</td><td>{r['count']:g}</td>"
        f"<td>{fmt_bytes(r['payload'])}</td><td>{fmt_bytes(r['measured'])}</td>"
        f"<td>{'' if r['analytic'] is None else fmt_bytes(r['analytic'])}</td><td>{_ratio_text(r['ratio'])}</td></tr>"
        for r in rows)
    return (f'{TABLE_CSS}<table class="traffic-compare cl-table"><tr><th class=l>phase</th><th class=l>op</th>'
            "<th>calls</th><th>payload V</th><th>wire (measured)</th><th>wire (analytic)</th><th>ratio</th></tr>"
            + body + "</table>")


def _totals_html(totals) -> str:
    """Steps down, phases across: wire bytes summed over every rank (calls in the hover text)."""
    phases = sorted({p for _, p in totals}, key=lambda p: (list(PHASE_COLORS).index(p) if p in PHASE_COLORS else 9, str(p)))
    steps = sorted({s for s, _ in totals}, key=lambda s: (s is None, s or 0))
    head = "".join(f'<th style="background:{PHASE_COLORS.get(p, PHASE_COLORS[None])}">{p or "no phase"}</th>' for p in phases)
    body = ""
    for st in steps:
        cells = "".join(f'<td title="{totals[(st, p)]["count"]} calls, payload {totals[(st, p)]["payload"]:,} B">'
                        f'{fmt_bytes(totals[(st, p)]["wire"])}</td>' if (st, p) in totals else "<td></td>" for p in phases)
        tot = sum(totals[(st, p)]["wire"] for p in phases if (st, p) in totals)
        name = st if st is not None else ("whole run" if steps == [None] else "no step")
        body += f"<tr><td class=l>{name}</td>{cells}<td><b>{fmt_bytes(tot)}</b></td></tr>"
    return (f'{TABLE_CSS}<table class="traffic-totals cl-table"><tr><th class=l>step</th>{head}<th>total</th></tr>'
            + body + "</table>")


def _groups_html(groups) -> str:
    body = "".join(f"<tr><td class=l>{esc(g)}</td><td class=l>{', '.join(sorted(t['ops']))}</td><td>{t['count']}</td>"
                   f"<td>{fmt_bytes(t['payload'])}</td><td>{fmt_bytes(t['wire'])}</td></tr>" for g, t in sorted(groups.items()))
    return (f'{TABLE_CSS}<table class="traffic-groups cl-table"><tr><th class=l>mesh axis / group</th><th class=l>ops</th>'
            "<th>calls</th><th>payload V</th><th>wire</th></tr>" + body + "</table>")


def _legend(led, color_by: str = "rank") -> str:
    """The phases and ops this ledger has, and no others (no "optimizer" swatch for a run without one)."""
    phases = {r.phase for r in led}
    known = [p for p in PHASE_COLORS if p in phases and p is not None] + sorted(str(p) for p in phases - set(PHASE_COLORS))
    if None in phases and known:
        known.append(None)
    items = "".join(f'<span class="legend-phase" style="display:inline-block;margin-right:10px"><span style="display:'
                    f'inline-block;width:11px;height:11px;background:{PHASE_COLORS.get(p, PHASE_COLORS[None])};border:1px '
                    f'solid #ccc;margin-right:3px"></span>{esc(p or "no phase")}</span>' for p in known)
    ops = ", ".join(f"{OP_SHORT.get(o, o)} {o.replace('_', '-')}" for o in sorted({r.op for r in led}))
    return (f'<div class="traffic-legend" style="font-size:12px">' + (f"phase (background): {items}" if known else "")
            + (f"box colour = rank; {ops}</div>" if color_by == "rank" else
               "box colour = mesh axis: " + "".join(
                   f'<span class="legend-axis" style="display:inline-block;margin-right:10px"><span style="display:'
                   f'inline-block;width:11px;height:11px;background:{c};margin-right:3px"></span>{esc(a)}</span>'
                   for a, c in axis_colors([{"axis": r.axis} for r in led]).items() if a is not None) + f"; {ops}</div>"))


def traffic_text(ledger, analytic=None, title=None) -> str:
    """The plain-text view: per-op comparison (lowest rank, per step) and totals per step and phase."""
    led = as_ledger(ledger)
    where = "all devices (one compiled SPMD program)" if led.ranks() == [-1] else f"ranks {led.ranks()}"
    lines = [title or "collective traffic", f"{len(led.filter())} collectives on {where}"]
    lines.append(f"{'phase':<10}{'op':<16}{'calls':>6}{'payload V':>14}{'wire':>14}{'analytic':>14}{'ratio':>8}")
    for r in traffic_compare(led, analytic):
        a = "" if r["analytic"] is None else f"{r['analytic']:,.0f}"
        q = _ratio_text(r["ratio"])
        lines.append(f"{r['phase'] or 'any':<10}{r['op']:<16}{r['count']:>6g}{r['payload']:>14,.0f}"
                     f"{r['measured']:>14,.0f}{a:>14}{q:>8}")
    lines.append("totals per step and phase (all ranks): step, phase, calls, payload, wire")
    for (s, p), t in sorted(traffic_totals(led).items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        lines.append(f"  {'-' if s is None else s!s:<5} {p or '-':<10} {t['count']:>4} {t['payload']:>12,} {t['wire']:>14,.0f}")
    return "\n".join(lines)


def traffic_figure(ledger, analytic=None, title=None, color_by: str = "rank"):
    """Static matplotlib view: the timeline (boxes coloured by rank, or by mesh axis with a legend), and
    measured vs analytic wire bytes per op."""
    from matplotlib.patches import Patch
    rows = traffic_rows(ledger)
    by_axis = axis_colors(rows)
    ranks = sorted({r["rank"] for r in rows})
    fig = new_figure(figsize=(10, 2.2 + 0.4 * len(ranks)))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.3]})
    timed = any(r["start"] is not None for r in rows)
    o, k = (time_origin(rows), 1e3) if timed else (0.0, 1.0)     # ms from the origin: never negative
    span = max([(r["x1"] - o) * k for r in rows] + [1e-9])
    per_rank: dict = {}
    for r in rows:
        per_rank.setdefault(r["rank"], []).append(r)
    for j, rk in enumerate(ranks):                          # one collection per rank: a run has thousands of boxes
        mine = per_rank[rk]                                 # at least 0.4% of the axis: short ops stay visible
        ax.broken_barh([((r["x0"] - o) * k, max((r["x1"] - r["x0"]) * k, 0.004 * span)) for r in mine], (j - 0.35, 0.7),
                       facecolors=[rank_color(rk) if color_by == "rank" else by_axis[r.get("axis")] for r in mine])
    ax.set_yticks(range(len(ranks)), [f"rank {r}" if r >= 0 else "all devices" for r in ranks])
    if color_by == "axis":              # a band above the first rank's row holds the legend: it covers no box
        ax.set_ylim(len(ranks) - 0.5, -0.5 - max(1.0, 0.45 * len(ranks)))
        ax.legend(handles=[Patch(color=c, label=a) for a, c in by_axis.items() if a is not None], fontsize=7,
                  title="mesh axis", title_fontsize=7, loc="upper left", ncol=3)
    else:
        ax.invert_yaxis()
    ax.set_xlim(left=0)
    ax.set_xlabel("ms since the first collective" if timed else "program order")
    ax.set_title(title or "collectives per rank")
    cmp_ = traffic_compare(ledger, analytic)
    short = {"forward": "fwd", "backward": "bwd", "optimizer": "opt"}
    labels = [f"{short.get(r['phase'] or '', r['phase'] or '')} {OP_SHORT.get(r['op'], r['op'])}".strip() for r in cmp_]
    xs = range(len(cmp_))
    ax2.bar([x - 0.2 for x in xs], [r["measured"] for r in cmp_], 0.4, label="measured", color="#555")
    if analytic is not None:
        ax2.bar([x + 0.2 for x in xs], [r["analytic"] or 0 for r in cmp_], 0.4, label="analytic", color="#bbb")
    ax2.set_xticks(list(xs), labels, rotation=45, fontsize=8)
    stepped = any(r["step"] is not None for r in rows)     # traffic_compare divides by the steps it can count
    ax2.set_ylabel("wire bytes per rank per step" if stepped else "wire bytes per rank, whole run")
    ax2.set_ylim(0, 1.3 * max([r["measured"] for r in cmp_] + [r["analytic"] or 0 for r in cmp_] + [1]))
    ax2.legend(fontsize=7, loc="upper right", ncol=2)        # in the headroom above the bars, covering none
    fig.tight_layout()
    return fig


class TrafficWidget(StaticFallback, w.VBox):
    """Controls: step (all or one), rank whose bytes are compared, and a slider through the collectives in run
    order ("collective k of n": the same k in the detail line and the box's hover text). A control that does
    not apply to the ledger is not shown: no step control without two step numbers, no rank control for one
    row."""

    def __init__(self, ledger, analytic=None, title=None, color_by: str = "rank"):
        self.ledger, self.analytic, self.title, self.color_by = as_ledger(ledger), analytic, title, color_by
        self.steps = sorted({r.step for r in self.ledger.filter() if r.step is not None})
        ranks = self.ledger.ranks() or [-1]
        all_rows = traffic_rows(self.ledger)
        self.origin = time_origin(all_rows)   # one time origin for every step shown: times never negative
        self.step = w.Dropdown(options=[("all", ALL)] + [(f"step {s}", s) for s in self.steps], value=ALL,
                               description="step")
        self.rank = w.Dropdown(options=[(f"rank {r}" if r >= 0 else "all devices", r) for r in ranks], value=ranks[0],
                               description="bytes of")
        self.op = w.IntSlider(value=1, min=1, max=max(1, len(all_rows)), description="collective",
                              disabled=len(all_rows) < 2)
        self.op_of = w.Label(f"of {len(all_rows)} (run order)")
        self.timeline, self.detail, self.compare, self.totals = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        self.groups, self._busy = w.HTML(), False
        self.legend = w.HTML(_legend(self.ledger.filter(), color_by))
        head = w.HTML(f"<b>{esc(title or 'Collective traffic')}</b> &mdash; one row per rank, one box per collective "
                      "(hover it for its record); the gaps between boxes are compute (or waiting).")
        controls = [c for c, applies in ((self.step, len(self.steps) > 1), (self.rank, len(ranks) > 1)) if applies]
        super().__init__([head, self.legend] + ([w.HBox(controls)] if controls else [])
                         + [w.HBox([self.op, self.op_of]), self.timeline, self.detail, self.compare,
                            w.HBox([self.totals, self.groups])])
        self.add_class("traffic-widget")
        for c in (self.step, self.rank, self.op):
            c.observe(self._redraw, names="value")
        self._redraw()

    def _redraw(self, change=None):
        if self._busy:
            return
        step = None if self.step.value == ALL else self.step.value
        rows = traffic_rows(self.ledger, step=step)
        if change is not None and change["owner"] is self.step:
            self._busy = True
            try:
                self.op.value, self.op.max = 1, max(1, len(rows))
                self.op.disabled, self.op_of.value = len(rows) < 2, f"of {len(rows)} (run order)"
            finally:
                self._busy = False
        seq = run_order(rows)  # run order: aligned time, or program order
        k = self.op.value
        cur = seq[k - 1] if 0 < k <= len(seq) else None
        self.timeline.value = traffic_svg(rows, cur["i"] if cur else None, origin=self.origin, color_by=self.color_by)
        if cur:
            where = ", ".join(x for x in ("all devices" if cur["rank"] < 0 else f'rank {cur["rank"]}',
                                          None if cur["step"] is None else f'step {cur["step"]}',
                                          cur["phase"] or "no phase") if x)
            self.detail.value = (f'<div class="traffic-detail"><b>collective {k} of {len(seq)}</b>: {where}: '
                                 f'<b>{cur["op"]}</b> of {cur["payload"]:,} B payload ({cur["dtype"]}) over '
                                 f'{cur["group_size"]} ranks on <b>{esc(cur["group"])}</b> = {cur["wire"]:,.0f} wire bytes'
                                 "</div>")
        else:
            self.detail.value = '<div class="traffic-detail">no collectives</div>'
        cmp_ = traffic_compare(self.ledger, self.analytic, rank=self.rank.value, step=step)
        n_steps = len(self.steps)
        which = (f"in step {step}" if step is not None else
                 f"per step (mean of {n_steps})" if n_steps > 1 else "in the whole run")
        who = f"rank {self.rank.value}" if self.rank.value >= 0 else "every device"
        self.compare.value = (f"<div><b>Bytes sent by {who}, {which}: measured (ledger, ring formulas) against "
                              f"analytic (the model)</b></div>" + _compare_html(cmp_))
        per = "per step and phase" if self.steps else "per phase"
        self.totals.value = (f"<div><b>Wire bytes {per}, all ranks</b></div>" + _totals_html(traffic_totals(self.ledger)))
        which_g = f"step {step}" if step is not None else ("all steps" if self.steps else "the whole run")
        self.groups.value = (f"<div style='margin-left:24px'><b>By mesh axis / group, {which_g}, all ranks</b></div>"
                             f"<div style='margin-left:24px'>{_groups_html(traffic_by_group(self.ledger, step=step))}</div>")

    def _static_text(self):
        return traffic_text(self.ledger, self.analytic, self.title)

    def _static_figure(self):
        return traffic_figure(self.ledger, self.analytic, self.title, self.color_by)


def show_traffic(ledger, *, analytic=None, title=None, color_by: str = "rank") -> TrafficWidget:
    """The traffic widget for a ledger (a ``Ledger``, a ``RunResult``, or ``to_dicts()`` rows).

    ``analytic``: a ``costs.StepCost`` (e.g. ``costs.step_cost("fsdp", units, n)``) or ``{op: wire bytes}``
    per rank per step; the widget puts the measured bytes beside it with their ratio. ``color_by="axis"``
    colours each box by the mesh axis it ran over (2-D meshes: which collectives are TP's, which FSDP's).
    """
    return TrafficWidget(ledger, analytic, title, color_by)

