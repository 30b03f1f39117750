"""Widgets: who owns which slice (:func:`show_ownership`) and what each collective moved (:func:`show_traffic`).

Both return an ipywidgets 8 widget that JupyterLab draws interactively: inline SVG inside ``HTML``
widgets (hover any slice or collective for its exact numbers), with controls that redraw at once.

**Where there is no widget frontend** (nbval, ``nbconvert``, a terminal, GitHub's viewer) the same
object still shows something: its ``_repr_mimebundle_`` carries, beside the widget view, a
``text/plain`` summary and an ``image/png`` matplotlib picture of the initial state. JupyterLab prefers
the widget view (its renderer ranks first); every other consumer picks the PNG or the text. So a cell
ending in ``show_ownership(spec)`` is never blank, and nothing depends on detecting the frontend. The
PNG shows the state at display time, not later control changes. Tag these cells
``nbval-ignore-output`` (the widget's model id changes every run).

Colours: one palette (:func:`rank_color`) for both widgets, so rank 2 is the same green everywhere.
"""
from __future__ import annotations

from .widgets_base import PADDING_COLOR, palette, rank_color
from .widgets_ownership import (OwnershipWidget, memory_svg, ownership_figure, ownership_rects, ownership_svg,
                                show_ownership, slice_table)
from .widgets_traffic import (TrafficWidget, group_label, show_traffic, traffic_by_group, traffic_compare,
                              traffic_figure, traffic_rows, traffic_svg, traffic_text, traffic_totals)

__all__ = ["show_ownership", "show_traffic", "rank_color", "palette", "PADDING_COLOR",
           "OwnershipWidget", "ownership_rects", "ownership_svg", "memory_svg", "slice_table", "ownership_figure",
           "TrafficWidget", "traffic_rows", "traffic_totals", "traffic_by_group", "traffic_compare", "traffic_svg",
           "traffic_figure", "traffic_text", "group_label"]
