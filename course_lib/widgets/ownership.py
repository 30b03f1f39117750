"""The ownership widget: every parameter (or flat unit) as a bar split into the slices each rank owns.

Data: :func:`ownership_rects` (plain dicts, tested without a browser). Interactive view:
:class:`OwnershipWidget` (inline SVG in ipywidgets; hover a slice for its exact range). Static view:
:func:`ownership_figure` (matplotlib). Public entry point: :func:`course_lib.widgets.show_ownership`.

Longer than ~300 lines: the static picture and the interactive widget draw the same rectangles.
"""
from __future__ import annotations

import math

import ipywidgets as w

from course_lib.maths.memory import PRECISIONS
from course_lib.maths.ownership import OWNERSHIP_STRATEGIES, STATES, OwnershipSpec, owners_label, what_if
from course_lib.widgets.base import (PADDING_COLOR, TABLE_CSS, StaticFallback, esc, fmt_bytes, rank_color,
                                     new_figure, short_middle, svg_size)

__all__ = ["ownership_rects", "member_starts", "ownership_svg", "memory_svg", "slice_table", "ownership_figure", "OwnershipWidget",
           "show_ownership"]


# -- ownership: data for the drawing ------------------------------------------------------------------
def ownership_rects(spec: OwnershipSpec, state: str = "params") -> list[dict]:
    """What the ownership view draws for one model state, as plain dicts (tested without a browser).

    One dict per stretch of a bar: ``bar`` (name), ``x0``/``x1`` (fractions of the bar's padded
    length), ``owners``, ``colors`` (one per owner, :func:`rank_color`), ``padding`` (True for the
    padding part of a slice), ``title`` (the hover text with exact ranges). A replicated state is one
    stretch owned by every rank.
    """
    if state not in STATES:
        raise ValueError(f"state={state!r} must be one of {STATES}")
    sharded = spec.sharded[STATES.index(state)]
    out = []
    for b in spec.bars:
        if not sharded:
            owners = tuple(spec.ranks)
            out.append(dict(bar=b.name, x0=0.0, x1=1.0, owners=owners, colors=[rank_color(r) for r in owners],
                            padding=False, title=f"{b.name} {tuple(b.shape)}: {state} replicated, every rank holds "
                                                 f"all {b.numel:,} elements"))
            continue
        total = b.padded_numel or 1
        for s in b.slices:
            who = owners_label(s.owners, spec.ranks)
            who = f"{who} ranks" if who.startswith("all") else f"rank{'s' if ',' in who else ''} {who}"
            text = f"{b.name}: {who} hold{'s' if who.startswith('rank ') else ''} [{s.start}:{s.stop}) = {s.describe(b)}"
            if s.real:
                out.append(dict(bar=b.name, x0=s.start / total, x1=(s.start + s.real) / total, owners=s.owners,
                                colors=[rank_color(r) for r in s.owners], padding=False, title=text))
            if s.padding:
                out.append(dict(bar=b.name, x0=(s.start + s.real) / total, x1=s.stop / total, owners=s.owners,
                                colors=[rank_color(r) for r in s.owners], padding=True,
                                title=f"{b.name}: {s.padding} padding elements on {who}"))
    return out


def member_starts(bar) -> list[tuple[str, float]]:
    """(tensor name, where it starts as a fraction of the padded buffer) for a flat unit; [] for a parameter."""
    out, pos = [], 0
    for name, shape in bar.members:
        out.append((name, pos / (bar.padded_numel or 1)))
        pos += math.prod(shape)
    return out


# -- ownership: SVG for the widget ----------------------------------------------------------------------
_ROW, _LABEL, _W = 22, 190, 560


def _stripes(x, y, w, h, owners, colors, title, opacity=1.0, pad=False) -> str:
    """One stretch: a horizontal stripe per owner (HSDP's replicas, DP's every rank), hatched if padding."""
    parts = [f'<g class="slice" data-owners="{",".join(map(str, owners))}" data-padding="{int(pad)}">'
             f"<title>{esc(title)}</title>"]
    k = max(1, len(colors))
    for i, c in enumerate(colors):
        fill = "url(#pad)" if pad else c
        parts.append(f'<rect x="{x:.1f}" y="{y + i * h / k:.1f}" width="{max(w, 0.8):.1f}" height="{h / k:.1f}" '
                     f'fill="{fill}" stroke="{c if pad else "none"}" fill-opacity="{opacity}"/>')
    parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.8):.1f}" height="{h:.1f}" fill="none" '
                 'stroke="white" stroke-width="0.6"/></g>')
    return "".join(parts)


def ownership_svg(spec: OwnershipSpec, state: str = "params", rank: int | None = None, max_bars: int = 60) -> str:
    """The bars as inline SVG: one row per parameter/unit, one coloured stretch per owner, padding hatched."""
    rects = ownership_rects(spec, state)
    bars = spec.bars[:max_bars]
    h = _ROW * len(bars) + 8
    out = [f'<svg class="ownership-bars" xmlns="http://www.w3.org/2000/svg" {svg_size(_LABEL + _W + 10, h)} '
           'font-family="sans-serif" font-size="11"><defs><pattern id="pad" width="5" height="5" '
           'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="5" height="5" fill="white"/>'
           f'<line x1="0" y1="0" x2="0" y2="5" stroke="{PADDING_COLOR}" stroke-width="3"/></pattern></defs>']
    for i, b in enumerate(bars):
        y = 4 + i * _ROW
        label = f"{b.name} {tuple(b.shape)}" if not b.members else f"{b.name} ({len(b.members)} tensors)"
        out.append(f'<text x="{_LABEL - 6}" y="{y + 13}" text-anchor="end">{esc(short_middle(label, 40))}</text>')
        for r in (r for r in rects if r["bar"] == b.name):
            dim = 1.0 if rank is None or rank in r["owners"] else 0.18
            out.append(_stripes(_LABEL + r["x0"] * _W, y, (r["x1"] - r["x0"]) * _W, _ROW - 6, r["owners"], r["colors"],
                                r["title"], dim, r["padding"]))
        for name, x in member_starts(b)[1:]:   # a flat unit: where each tensor begins (shards may cut them)
            xp = _LABEL + x * _W
            out.append(f'<line class="member-boundary" x1="{xp:.1f}" y1="{y - 1}" x2="{xp:.1f}" y2="{y + _ROW - 5}" '
                       f'stroke="black" stroke-width="1.5"><title>{esc(name)} starts here</title></line>')
    out.append("</svg>")
    more = f"<div>… {len(spec.bars) - max_bars} more not drawn</div>" if len(spec.bars) > max_bars else ""
    return "".join(out) + more


def _legend(ranks) -> str:
    items = "".join(f'<span style="display:inline-block;margin-right:8px"><span style="display:inline-block;'
                    f'width:11px;height:11px;background:{rank_color(r)};margin-right:3px"></span>rank {r}</span>'
                    for r in ranks[:32])
    return (f'<div class="rank-legend" style="font-size:11px">{items}<span style="display:inline-block;width:11px;'
            f'height:11px;border:1px solid {PADDING_COLOR};background:repeating-linear-gradient(45deg,'
            f'white 0 2px,{PADDING_COLOR} 2px 4px);margin-right:3px"></span>padding</div>')


def memory_svg(spec: OwnershipSpec) -> str:
    """Per-rank stacked bars: parameters, gradients, optimizer state (bytes), the DP total dashed."""
    mem = spec.memory()
    dp = sum(spec.numel * nb for nb in PRECISIONS[spec.precision])
    top = max([m.total for m in mem] + [dp, 1])
    out = [f'<svg class="memory-bars" xmlns="http://www.w3.org/2000/svg" {svg_size(_LABEL + _W + 10, 18 * len(mem) + 40)} '
           'font-family="sans-serif" font-size="11">']
    for i, m in enumerate(mem):
        y, x = 4 + 18 * i, float(_LABEL)
        out.append(f'<text x="{_LABEL - 6}" y="{y + 11}" text-anchor="end">rank {m.rank}: {fmt_bytes(m.total)}</text>')
        for name, val, op in (("params", m.params, 1.0), ("grads", m.grads, 0.6), ("optimizer", m.optimizer, 0.3)):
            w = val / top * _W
            out.append(f'<rect class="mem-{name}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="13" '
                       f'fill="{rank_color(m.rank)}" fill-opacity="{op}" stroke="white"><title>rank {m.rank} {name}: '
                       f'{val:,.0f} bytes</title></rect>')
            x += w
    xd = _LABEL + dp / top * _W
    y = 18 * len(mem) + 18
    out.append(f'<line x1="{xd:.1f}" y1="0" x2="{xd:.1f}" y2="{y - 14}" stroke="black" stroke-dasharray="4 3"/>'
               f'<text x="{xd:.1f}" y="{y}" text-anchor="end">every rank under DP (nothing sharded): {fmt_bytes(dp)}</text>'
               f'<text x="{_LABEL}" y="{y}" fill="#666">dark: params, mid: grads, light: optimizer (Adam m, v'
               f'{", fp32 master" if spec.precision == "mixed" else ""})</text></svg>')
    return "".join(out)


def slice_table(spec: OwnershipSpec, bar_name: str) -> str:
    """An HTML table of one bar's slices: the exact ranges a rank owns."""
    b = spec.bar(bar_name)
    rows = "".join(f'<tr><td class="l">{", ".join(f"<b style=color:{rank_color(r)}>{r}</b>" for r in s.owners)}</td>'
                   f'<td>[{s.start}:{s.stop})</td><td class="l">{esc(s.describe(b))}</td><td>{s.real:,}</td>'
                   f"<td>{s.padding:,}</td></tr>" for s in b.slices)
    return (f'{TABLE_CSS}<table class="slice-table cl-table"><tr><th class="l">rank(s)</th><th>padded range</th>'
            f'<th class="l">exact slice</th><th>real</th><th>padding</th></tr>{rows}</table>')


# -- ownership: matplotlib (static view) -----------------------------------------------------------------
def ownership_figure(spec: OwnershipSpec, state: str = "params", max_bars: int | None = None):
    """A matplotlib ``Figure`` of the same picture: the bars (every one unless ``max_bars``), memory per rank."""
    from matplotlib.patches import Patch
    bars = spec.bars if max_bars is None else spec.bars[:max_bars]
    fig = new_figure(figsize=(10, 1.2 + 0.32 * len(bars) + 0.25 * len(spec.ranks)))
    gs = fig.add_gridspec(2, 1, height_ratios=[max(1, len(bars)), max(1, len(spec.ranks) * 0.8)])
    ax = fig.add_subplot(gs[0])
    names = [b.name for b in bars]
    for r in ownership_rects(spec, state):
        if r["bar"] not in names:
            continue
        y, k = names.index(r["bar"]), len(r["colors"])
        for i, c in enumerate(r["colors"]):
            ax.barh(y - 0.35 + 0.7 * (i + 0.5) / k, r["x1"] - r["x0"], 0.7 / k, left=r["x0"],
                    color="white" if r["padding"] else c, edgecolor=c if r["padding"] else "white",
                    hatch="///" if r["padding"] else None, linewidth=0.5)
    for y, b in enumerate(bars):
        for _, x in member_starts(b)[1:]:
            ax.plot([x, x], [y - 0.42, y + 0.42], color="black", linewidth=1.2)
    ax.set_yticks(range(len(bars)), [short_middle(f"{b.name} {tuple(b.shape)}", 44) for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of the padded buffer" + ("; black ticks: where each tensor of a unit starts"
                                                     if any(b.members for b in bars) else ""))
    ax.set_title(f"{state}: {spec.strategy}, {spec.world_size} ranks" + (f", mesh {spec.mesh_shape}" if spec.mesh_shape else ""))
    handles = [Patch(color=rank_color(r), label=f"rank {r}") for r in spec.ranks[:16]]
    handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="padding"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=7)
    ax2 = fig.add_subplot(gs[1])
    mem = spec.memory()
    left = [0.0] * len(mem)
    for name, alpha in (("params", 1.0), ("grads", 0.6), ("optimizer", 0.3)):
        vals = [getattr(m, name) for m in mem]
        ax2.barh(range(len(mem)), vals, left=left, color=[rank_color(m.rank) for m in mem], alpha=alpha,
                 edgecolor="white", label=name)
        left = [a + v for a, v in zip(left, vals)]
    ax2.set_yticks(range(len(mem)), [f"rank {m.rank}" for m in mem], fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlabel("bytes per rank: params | grads | optimizer (darker to lighter)")
    fig.tight_layout()
    return fig


# -- ownership: the widget ---------------------------------------------------------------------------------
class OwnershipWidget(StaticFallback, w.VBox):
    """The ownership view; ``.spec`` is the spec currently drawn. Controls (what-if specs only): world
    size, strategy, HSDP replicate factor R, layout; for every spec: state, highlighted rank, the bar
    whose exact slices are listed."""

    ALL = -1    # the highlight dropdown's "all ranks" value (None would read as "no selection")

    def __init__(self, spec: OwnershipSpec, state="params", rank=None, selected=None):
        self.spec, self._busy = spec, True
        editable = spec.inputs is not None
        self.world = w.IntSlider(value=spec.world_size, min=1, max=max(16, spec.world_size), description="world size",
                                 continuous_update=False)
        self.strategy = w.Dropdown(options=list(OWNERSHIP_STRATEGIES) + ([] if editable else [spec.strategy]),
                                   value=spec.strategy, description="strategy")
        opts = [d for d in range(1, spec.world_size + 1) if spec.world_size % d == 0]
        self.replicate = w.Dropdown(description="replicate R", options=opts,
                                    value=spec.mesh_shape[0] if spec.strategy == "hsdp" and spec.mesh_shape else 1,
                                    disabled=spec.strategy != "hsdp")
        self.layout_dd = w.Dropdown(options=["dim0", "flat"] + ([spec.layout] if spec.layout not in ("dim0", "flat") else []),
                                    value=spec.layout, description="layout")
        self.state = w.ToggleButtons(options=list(STATES), value=state, description="state")
        self.rank = w.Dropdown(options=self._rank_options(spec), value=self.ALL if rank is None else rank,
                               description="highlight")
        names = [b.name for b in spec.bars]
        self.selected = w.Dropdown(options=names, value=selected if selected in names else (names[0] if names else None),
                                   description="slices of")
        self.bars_html, self.mem_html, self.table_html, self.status = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        rows = [w.HBox([self.world, self.strategy]), w.HBox([self.replicate, self.layout_dd])] if editable else []
        super().__init__(rows + [self.state, self.rank, self.status, self.bars_html, self.mem_html,
                                 self.selected, self.table_html])
        self.add_class("ownership-widget")
        for c in (self.world, self.strategy, self.replicate, self.layout_dd):
            c.observe(self._rebuild, names="value")
        for c in (self.state, self.rank, self.selected):
            c.observe(self._redraw, names="value")
        self._busy = False
        self._redraw()

    @classmethod
    def _rank_options(cls, spec):
        return [("all", cls.ALL)] + [(f"rank {r}", r) for r in spec.ranks]

    def _rebuild(self, change=None):
        """A what-if control changed: recompute the spec and redraw."""
        if self._busy:
            return
        self._busy = True
        try:
            n, strat = self.world.value, self.strategy.value
            if change is not None and change["owner"] is self.strategy:  # each strategy's usual layout
                self.layout_dd.value = "dim0" if strat in ("fsdp", "hsdp") else "flat"
            opts = [d for d in range(1, n + 1) if n % d == 0]
            r = self.replicate.value if self.replicate.value in opts else 1
            if strat == "hsdp" and r == 1 and n >= 4 and n % 2 == 0:  # HSDP with R=1 is plain FSDP
                r = 2
            self.replicate.options, self.replicate.value = opts, r
            self.replicate.disabled = strat != "hsdp"
            layout = self.layout_dd.value if self.layout_dd.value in ("dim0", "flat") else None
            self.spec = what_if(**dict(self.spec.inputs, world_size=n, strategy=strat, layout=layout,
                                       mesh_shape=(r, n // r) if strat == "hsdp" else None))
            keep = self.rank.value if self.rank.value in self.spec.ranks else self.ALL
            self.rank.options, self.rank.value = self._rank_options(self.spec), keep
            names = [b.name for b in self.spec.bars]   # the "slices of" list follows the new units
            sel = self.selected.value if self.selected.value in names else (names[0] if names else None)
            self.selected.options, self.selected.value = names, sel
            self.status.value = ""
        except ValueError as e:
            self.status.value = f'<span style="color:#b00">{esc(e)}</span>'
        finally:
            self._busy = False
        self._redraw()

    def _redraw(self, _change=None):
        s = self.spec
        mesh = f", mesh {s.mesh_shape} {s.mesh_axes or ''}" if s.mesh_shape else ""
        head = (f'<div class="ownership-title"><b>{esc(s.strategy)}</b> over {s.world_size} ranks{esc(mesh)}, '
                f"{s.layout} layout; <b>{self.state.value}</b> "
                f"{'sharded' if s.sharded[STATES.index(self.state.value)] else 'replicated'}. "
                "Hover a slice for its exact range.</div>")
        self.bars_html.value = head + _legend(list(s.ranks)) + (
            '<div style="max-height:480px;overflow:auto">' + ownership_svg(s, self.state.value, None if self.rank.value == self.ALL else self.rank.value) + "</div>")
        self.mem_html.value = "<div><b>Model-state bytes per rank</b></div>" + memory_svg(s)
        self.table_html.value = (slice_table(s, self.selected.value) if self.selected.value in [b.name for b in s.bars]
                                 else "")

    def _static_text(self):
        return self.spec.summary()

    def _static_figure(self):
        return ownership_figure(self.spec, self.state.value)


def show_ownership(spec, **controls):
    """The ownership widget for ``spec`` (an :class:`~course_lib.maths.ownership.OwnershipSpec`).

    ``spec`` may also be shapes, passed with ``what_if``'s keywords: ``show_ownership({"w": (10, 3)},
    world_size=4, strategy="fsdp")``. ``controls``: ``world_size``, ``strategy``, ``mesh_shape``,
    ``layout`` (what-if specs: the starting values of the controls), ``state`` ("params" / "grads" /
    "optimizer"), ``rank`` (highlight one rank's slices), ``selected`` (the bar whose slices are listed).
    """
    view = {k: controls.pop(k) for k in ("state", "rank", "selected") if k in controls}
    if not isinstance(spec, OwnershipSpec):
        spec = what_if(spec, **controls)
    elif controls:
        if spec.inputs is None:
            raise ValueError(f"controls {sorted(controls)} only apply to a what-if spec; this one describes "
                             f"a real {spec.source} model")
        spec = what_if(**dict(spec.inputs, **controls))
    return OwnershipWidget(spec, **view)
