"""Shared pieces of the two widgets: the rank palette, byte formatting, table styles, and the static fallback.

See :mod:`course_lib.widgets` for the public API and how the fallback works.
"""
from __future__ import annotations

import base64
import colorsys
import html
import io

__all__ = ["short_middle", "svg_size", "rank_color", "palette", "fmt_bytes", "figure_png", "new_figure", "StaticFallback", "PADDING_COLOR", "TABLE_CSS"]


_TAB10 = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
          "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#393b79")
PADDING_COLOR = "#bbbbbb"


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in every widget and figure (tab10 without its grey, then golden-ratio hues)."""
    if rank < 0:
        return "#555555"   # an SPMD program (JAX ledger rank -1): all devices at once
    if rank < len(_TAB10):
        return _TAB10[rank]
    r, g, b = colorsys.hsv_to_rgb((rank * 0.618033988749895) % 1.0, 0.65, 0.85)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def palette(n: int) -> list[str]:
    """Colours of ranks ``0..n-1``."""
    return [rank_color(r) for r in range(n)]


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:,.0f} B"


#: styles for the widgets' tables (class-scoped; an HTML widget's <style> applies to the page)
TABLE_CSS = ("<style>.cl-table{border-collapse:collapse;font-size:11px;margin:4px 0}"
             ".cl-table th,.cl-table td{padding:2px 9px;border-bottom:1px solid #e3e3e3;text-align:right}"
             ".cl-table th{border-bottom:1px solid #999}.cl-table td.l,.cl-table th.l{text-align:left}</style>")


def short_middle(text: str, limit: int = 32) -> str:
    """Cut a long label in the middle ("blocks.0.attn…(198, 66)"): its name's start and its shape stay whole."""
    text = str(text)
    if len(text) <= limit:
        return text
    keep = limit - 1
    return text[: keep - keep // 2] + "…" + text[len(text) - keep // 2:]


def svg_size(width: float, height: float) -> str:
    """Attributes that scale an SVG drawn ``width`` x ``height`` down to the output area (never up)."""
    return (f'viewBox="0 0 {width:g} {height:g}" width="100%" preserveAspectRatio="xMinYMin meet" '
            f'style="max-width:{width:g}px;height:auto"')


def esc(s) -> str:
    return html.escape(str(s), quote=True)


def figure_png(fig) -> bytes:
    """PNG bytes of a matplotlib ``Figure`` made without pyplot (no global state, no inline backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return buf.getvalue()


_SHOWN: list = []


def new_figure(**kwargs):
    """A matplotlib ``Figure`` (made without pyplot: no global state) that Jupyter shows as a picture.

    A bare ``Figure`` is drawn only where pyplot's inline backend registered its PNG formatter: in a kernel that
    never imported pyplot, the cell shows ``<Figure size 1000x380 with 2 Axes>`` and no picture. This one carries
    its own ``_repr_png_``, so every figure the course returns is displayed wherever it is the cell's value."""
    if not _SHOWN:
        from matplotlib.figure import Figure

        class ShownFigure(Figure):
            def _repr_png_(self) -> bytes:
                return figure_png(self)
        _SHOWN.append(ShownFigure)
    return _SHOWN[0](**kwargs)


class StaticFallback:
    """Mixin for an ipywidgets container: adds a text and PNG view to the widget's mimebundle."""

    def _static_text(self) -> str:
        raise NotImplementedError

    def _static_figure(self):
        raise NotImplementedError

    def _repr_mimebundle_(self, **kwargs):
        data = dict(super()._repr_mimebundle_(**kwargs) or {})
        data["text/plain"] = self._static_text()
        try:
            data["image/png"] = base64.b64encode(figure_png(self._static_figure())).decode("ascii")
        except Exception as e:  # never let the picture break the cell: the text still stands
            data["text/plain"] += f"\n(static figure unavailable: {type(e).__name__}: {e})"
        return data
