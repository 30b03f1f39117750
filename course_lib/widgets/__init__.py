"""The widgets layer: who owns which slice (:func:`show_ownership`) and what each collective moved (:func:`show_traffic`).

Usage (the last line of a cell; tag the cell ``nbval-ignore-output``)::

    from course_lib.maths import ownership
    from course_lib.maths import costs
    from course_lib.widgets import show_ownership, show_traffic

    show_ownership(ownership.what_if({"wte": (11, 8), "w1": (8, 32)}, world_size=4, strategy="fsdp"))
    show_ownership({"w": (10, 3)}, world_size=8, strategy="hsdp", mesh_shape=(2, 4))  # shapes + what_if kwargs
    show_ownership(res[0])                   # res = course_lib.run(fn_returning_describe.describe_torch(model))
    show_ownership(describe.describe_jax(nnx.state(model)))
    show_traffic(res.ledger, analytic=costs.step_cost("fsdp", units, 4, padding="dim0"), title="FSDP2, 2 steps")

Both return an ipywidgets 8 widget that JupyterLab draws interactively: inline SVG inside ``HTML``
widgets (hover any slice or collective for its exact numbers), with controls that redraw at once
(ownership: world size, strategy, HSDP replicate factor, layout, which state, highlighted rank, the
parameter whose exact slices are listed; traffic: step, whose bytes are compared, a slider through the
collectives one by one).

**Where there is no widget frontend** (nbval, ``nbconvert``, a terminal, GitHub's viewer) the same
object still shows something, without detecting the frontend: its ``_repr_mimebundle_`` carries,
beside the widget view, a ``text/plain`` summary (``spec.summary()``, or the traffic tables) and an
``image/png`` matplotlib picture of the state at display time. JupyterLab prefers the widget view (its
renderer ranks first); a terminal shows the text; nbval compares only the text, which is deterministic
(no timings, no ids) -- still, tag the cell ``nbval-ignore-output``. ``nbconvert --execute`` saves the
widget state, so its HTML export redraws the (static) SVG views where the page can load the widget
script. A notebook reopened without its kernel shows "model not found" as any ipywidget does: re-run.

Colours: one palette (:func:`rank_color`) for both widgets, so rank 2 is the same green everywhere.
Modules: :mod:`course_lib.maths.ownership` / :mod:`course_lib.maths.traffic` build the data (plain Python, tested
without a browser); :mod:`~course_lib.widgets.ownership`, :mod:`~course_lib.widgets.traffic` (its timeline SVG in
:mod:`~course_lib.widgets.timeline_svg`) and :mod:`~course_lib.widgets.base` draw it.
"""
from __future__ import annotations

from course_lib.widgets.base import PADDING_COLOR, palette, rank_color
from course_lib.widgets.ownership import (OwnershipWidget, member_starts, memory_svg, ownership_figure, ownership_rects,
                                ownership_svg, show_ownership, slice_table)
from course_lib.widgets.traffic import (TrafficWidget, group_label, show_traffic, traffic_by_group, traffic_compare,
                              traffic_figure, traffic_rows, traffic_svg, traffic_text, traffic_totals)

__all__ = ["show_ownership", "show_traffic", "rank_color", "palette", "PADDING_COLOR",
           "OwnershipWidget", "ownership_rects", "member_starts", "ownership_svg", "memory_svg", "slice_table", "ownership_figure",
           "TrafficWidget", "traffic_rows", "traffic_totals", "traffic_by_group", "traffic_compare", "traffic_svg",
           "traffic_figure", "traffic_text", "group_label"]
