"""The collective-traffic widget: a run's ledger as a per-rank timeline, bytes against the analytic cost,
totals per step and phase, and which mesh axis or group each collective used.

The data comes from :mod:`course_lib.maths.traffic` (plain Python, tested without a browser);
:class:`TrafficWidget` draws it (inline SVG in ipywidgets, hover a box for its
record) and :func:`traffic_figure` is the static matplotlib view used where no widget frontend exists
(see :mod:`course_lib.widgets`). Bytes: **payload** ``V`` is the ledger's; **wire** bytes are
``costs.wire_bytes`` of it (ring formulas, per rank). A torch ledger has one record per op per rank,
each rank's clock starting at its own reset (so rows are not aligned to the microsecond); a JAX-HLO
ledger has one record per op for all devices (``rank == -1``) and no times: its row is in program order.
"""
from __future__ import annotations

import ipywidgets as w

from course_lib.maths.traffic import as_ledger, group_label, traffic_by_group, traffic_compare, traffic_rows, traffic_totals
from course_lib.widgets.base import TABLE_CSS, StaticFallback, esc, fmt_bytes, rank_color, svg_size

__all__ = ["show_traffic", "traffic_svg", "traffic_figure", "traffic_text", "TrafficWidget", "PHASE_COLORS", "OP_SHORT",
           "group_label", "traffic_rows", "traffic_totals", "traffic_by_group", "traffic_compare"]

PHASE_COLORS = {"forward": "#e3ecfa", "backward": "#fbe5e1", "optimizer": "#e2f3e4", None: "#f2f2f2"}
OP_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "broadcast": "BC", "all_to_all": "A2A",
            "collective_permute": "CP", "reduce": "R", "gather": "G", "scatter": "S", "send": "SD", "recv": "RV"}
ALL = -1    # "every step" in the step control (None would read as "no selection")


# -- drawing -------------------------------------------------------------------------------------------
_LBL, _W, _ROWH = 120, 620, 30


def traffic_svg(rows: list[dict], highlight: int | None = None) -> str:
    """The timeline: one row per rank, a box per collective (rank colour, op initials), phase bands behind,
    the gaps between boxes are compute (or waiting). Hover a box for its record."""
    ranks = sorted({r["rank"] for r in rows})
    if not rows:
        return '<svg class="traffic-timeline" width="300" height="30"><text x="4" y="18">no collectives</text></svg>'
    lo, hi = min(r["x0"] for r in rows), max(r["x1"] for r in rows)
    span = (hi - lo) or 1.0
    timed = any(r["start"] is not None for r in rows)
    sx = lambda x: _LBL + (x - lo) / span * _W  # noqa: E731
    h = _ROWH * len(ranks) + 26
    out = [f'<svg class="traffic-timeline" xmlns="http://www.w3.org/2000/svg" {svg_size(_LBL + _W + 10, h)} '
           'font-family="sans-serif" font-size="10">']
    for j, rk in enumerate(ranks):
        y = 4 + j * _ROWH
        mine = [r for r in rows if r["rank"] == rk]
        label = f"rank {rk}" if rk >= 0 else "all devices"
        busy = sum(r["x1"] - r["x0"] for r in mine)
        gaps = max(0.0, max(r["x1"] for r in mine) - min(r["x0"] for r in mine) - busy)
        tip = (f"{len(mine)} collectives, {busy * 1e3:.3f} ms in collectives, {gaps * 1e3:.3f} ms between them "
               "(compute or waiting)") if timed else f"{len(mine)} collectives in program order"
        out.append(f'<text x="{_LBL - 6}" y="{y + 16}" text-anchor="end" fill="{rank_color(rk)}" '
                   f'font-weight="bold">{label}<title>{tip}</title></text>')
        out.append(f'<line x1="{_LBL}" y1="{y + 12}" x2="{_LBL + _W}" y2="{y + 12}" stroke="#ccc" stroke-dasharray="2 2">'
                   "<title>gaps between collectives: compute (or waiting)</title></line>")
        run = None  # phase bands: contiguous (step, phase) runs on this rank
        for r in mine + [None]:
            key = None if r is None else (r["step"], r["phase"])
            if run and (r is None or key != run[0]):
                x0, x1 = sx(run[1]), sx(run[2])
                out.append(f'<rect class="phase-band" x="{x0:.1f}" y="{y - 2}" width="{max(x1 - x0, 1):.1f}" '
                           f'height="{_ROWH - 4}" fill="{PHASE_COLORS.get(run[0][1], PHASE_COLORS[None])}">'
                           f"<title>step {run[0][0]}, {run[0][1] or 'no phase'}</title></rect>")
                run = None
            if r is not None:
                run = [key, r["x0"], r["x1"]] if run is None else [run[0], run[1], r["x1"]]
        for r in mine:
            x0, x1 = sx(r["x0"]), sx(r["x1"])
            wd = max(x1 - x0, 3.0)
            when = (f"{r['x0'] * 1e3:.3f} to {r['x1'] * 1e3:.3f} ms" + ("" if r["end"] is not None else " (end not recorded)")
                    if r["start"] is not None else "no timing (compiled program)")
            tip = (f"#{r['i']} rank {r['rank']} step {r['step']} {r['phase'] or ''}: {r['op']} {r['dtype']} "
                   f"payload {r['payload']:,} B over {r['group_size']} ({r['group']}) -> {r['wire']:,.0f} wire B; {when}")
            stroke = 'stroke="black" stroke-width="2"' if highlight == r["i"] else 'stroke="white"'
            out.append(f'<g class="collective" data-op="{r["op"]}" data-rank="{r["rank"]}"><title>{esc(tip)}</title>'
                       f'<rect x="{x0:.1f}" y="{y + 2}" width="{wd:.1f}" height="{_ROWH - 12}" fill="{rank_color(r["rank"])}" {stroke}/>')
            if wd > 16:
                out.append(f'<text x="{x0 + 2:.1f}" y="{y + 15}" fill="white">{OP_SHORT.get(r["op"], r["op"])}</text>')
            out.append("</g>")
    unit = (f"time, {lo * 1e3:.2f} to {hi * 1e3:.2f} ms (ranks' clocks aligned on the ends of their collectives)"
            if timed else "program order (a compiled SPMD program: one row for all devices, no timings)")
    out.append(f'<text x="{_LBL}" y="{h - 6}">{unit}</text></svg>')
    return "".join(out)


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
        body += f"<tr><td class=l>{'-' if st is None else st}</td>{cells}<td><b>{fmt_bytes(tot)}</b></td></tr>"
    return (f'{TABLE_CSS}<table class="traffic-totals cl-table"><tr><th class=l>step</th>{head}<th>total</th></tr>'
            + body + "</table>")


def _groups_html(groups) -> str:
    body = "".join(f"<tr><td class=l>{esc(g)}</td><td class=l>{', '.join(sorted(t['ops']))}</td><td>{t['count']}</td>"
                   f"<td>{fmt_bytes(t['payload'])}</td><td>{fmt_bytes(t['wire'])}</td></tr>" for g, t in sorted(groups.items()))
    return (f'{TABLE_CSS}<table class="traffic-groups cl-table"><tr><th class=l>mesh axis / group</th><th class=l>ops</th>'
            "<th>calls</th><th>payload V</th><th>wire</th></tr>" + body + "</table>")


def _phase_legend() -> str:
    items = "".join(f'<span style="display:inline-block;margin-right:10px"><span style="display:inline-block;width:11px;'
                    f'height:11px;background:{c};border:1px solid #ccc;margin-right:3px"></span>{p or "no phase"}</span>'
                    for p, c in PHASE_COLORS.items())
    return f'<div style="font-size:11px">phase (background): {items}box colour = rank; AG all-gather, RS reduce-scatter, AR all-reduce</div>'


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
        lines.append(f"  {s!s:<5} {p or '-':<10} {t['count']:>4} {t['payload']:>12,} {t['wire']:>14,.0f}")
    return "\n".join(lines)


def traffic_figure(ledger, analytic=None, title=None):
    """Static matplotlib view: the timeline, and measured vs analytic wire bytes per op."""
    from matplotlib.figure import Figure
    rows = traffic_rows(ledger)
    ranks = sorted({r["rank"] for r in rows})
    fig = Figure(figsize=(10, 2.2 + 0.4 * len(ranks)))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1.3]})
    for j, rk in enumerate(ranks):
        for r in (r for r in rows if r["rank"] == rk):
            ax.broken_barh([(r["x0"], max(r["x1"] - r["x0"], 1e-9))], (j - 0.35, 0.7), color=rank_color(r["rank"]))
    ax.set_yticks(range(len(ranks)), [f"rank {r}" if r >= 0 else "all devices" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds" if any(r["start"] is not None for r in rows) else "program order")
    ax.set_title(title or "collectives per rank")
    cmp_ = traffic_compare(ledger, analytic)
    labels = [f"{(r['phase'] or '')[:3]} {OP_SHORT.get(r['op'], r['op'])}".strip() for r in cmp_]
    xs = range(len(cmp_))
    ax2.bar([x - 0.2 for x in xs], [r["measured"] for r in cmp_], 0.4, label="measured", color="#555")
    if analytic is not None:
        ax2.bar([x + 0.2 for x in xs], [r["analytic"] or 0 for r in cmp_], 0.4, label="analytic", color="#bbb")
    ax2.set_xticks(list(xs), labels, rotation=45, fontsize=8)
    ax2.set_ylabel("wire bytes per rank per step")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig


class TrafficWidget(StaticFallback, w.VBox):
    """Controls: step (all or one), rank whose bytes are compared, and a slider through the collectives."""

    def __init__(self, ledger, analytic=None, title=None):
        self.ledger, self.analytic, self.title = as_ledger(ledger), analytic, title
        steps = sorted({r.step for r in self.ledger.filter() if r.step is not None})
        ranks = self.ledger.ranks() or [-1]
        self.step = w.Dropdown(options=[("all", ALL)] + [(f"step {s}", s) for s in steps], value=ALL, description="step")
        self.rank = w.Dropdown(options=[(f"rank {r}" if r >= 0 else "all devices", r) for r in ranks], value=ranks[0],
                               description="bytes of")
        self.op = w.IntSlider(value=0, min=0, max=max(0, len(traffic_rows(self.ledger)) - 1), description="collective #")
        self.timeline, self.detail, self.compare, self.totals = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        self.groups = w.HTML()
        head = w.HTML(f"<b>{esc(title or 'Collective traffic')}</b> &mdash; one row per rank, one box per collective "
                      "(hover it for its record); the gaps between boxes are compute (or waiting)." + _phase_legend())
        super().__init__([head, w.HBox([self.step, self.rank]), self.op, self.timeline, self.detail,
                          self.compare, w.HBox([self.totals, self.groups])])
        self.add_class("traffic-widget")
        for c in (self.step, self.rank, self.op):
            c.observe(self._redraw, names="value")
        self._redraw()

    def _redraw(self, change=None):
        step = None if self.step.value == ALL else self.step.value
        rows = traffic_rows(self.ledger, step=step)
        if change is not None and change["owner"] is self.step:
            self.op.max, self.op.value = max(0, len(rows) - 1), 0
        seq = sorted(rows, key=lambda r: (r["x0"], r["rank"]))  # run order: aligned time, or program order
        cur = seq[self.op.value] if seq and self.op.value < len(seq) else None
        self.timeline.value = traffic_svg(rows, cur["i"] if cur else None)
        if cur:
            who = f'rank {cur["rank"]}' if cur["rank"] >= 0 else "all devices"
            self.detail.value = (f'<div class="traffic-detail">#{cur["i"]}: {who}, step {cur["step"]}, '
                                 f'{cur["phase"] or "no phase"}: <b>{cur["op"]}</b> of {cur["payload"]:,} B payload '
                                 f'({cur["dtype"]}) over {cur["group_size"]} ranks on <b>{esc(cur["group"])}</b> '
                                 f'= {cur["wire"]:,.0f} wire bytes</div>')
        cmp_ = traffic_compare(self.ledger, self.analytic, rank=self.rank.value, step=step)
        n_steps = len(self.step.options) - 1
        which = (f"in step {step}" if step is not None else
                 f"per step (mean of {n_steps})" if n_steps > 1 else "in the whole run")
        who = f"rank {self.rank.value}" if self.rank.value >= 0 else "every device"
        self.compare.value = (f"<div><b>Bytes sent by {who}, {which}: measured (ledger, ring formulas) against "
                              f"analytic (the model)</b></div>" + _compare_html(cmp_))
        self.totals.value = ("<div><b>Wire bytes per step and phase, all ranks</b></div>"
                             + _totals_html(traffic_totals(self.ledger)))
        which_g = "all steps" if step is None else f"step {step}"
        self.groups.value = (f"<div style='margin-left:24px'><b>By mesh axis / group, {which_g}, all ranks</b></div>"
                             f"<div style='margin-left:24px'>{_groups_html(traffic_by_group(self.ledger, step=step))}</div>")

    def _static_text(self):
        return traffic_text(self.ledger, self.analytic, self.title)

    def _static_figure(self):
        return traffic_figure(self.ledger, self.analytic, self.title)


def show_traffic(ledger, *, analytic=None, title=None) -> TrafficWidget:
    """The traffic widget for a ledger (a ``Ledger``, a ``RunResult``, or ``to_dicts()`` rows).

    ``analytic``: a ``costs.StepCost`` (e.g. ``costs.step_cost("fsdp", units, n)``) or ``{op: wire bytes}``
    per rank per step; the widget puts the measured bytes beside it with their ratio.
    """
    return TrafficWidget(ledger, analytic, title)

