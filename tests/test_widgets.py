"""What the widgets draw, checked as data: slice stretches, colours per rank, byte totals, controls, fallbacks."""
import base64
import dataclasses
import re

import pytest

from course_lib.maths import costs
from course_lib.comm.ledger import CollectiveRecord, Ledger
from course_lib.maths.ownership import describe_flat, what_if
from course_lib.widgets import (OwnershipWidget, ownership_rects, ownership_svg, palette, rank_color, show_ownership,
                                show_traffic)
from course_lib.widgets.traffic import group_label, traffic_compare, traffic_rows, traffic_svg, traffic_totals

PNG = b"\x89PNG\r\n\x1a\n"


def test_palette_is_one_distinct_colour_per_rank():
    cols = palette(32)
    assert len(set(cols)) == 32 and all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in cols)
    assert cols[:4] == [rank_color(r) for r in range(4)] == ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def test_ownership_rects_tile_each_bar_with_owner_colours_and_padding():
    spec = what_if({"w": (10, 3), "b": (3,)}, world_size=4, strategy="fsdp")
    rects = ownership_rects(spec, "params")
    w = [r for r in rects if r["bar"] == "w"]
    # 4 real stretches + rank 3's padding (rows 10..12 of the padded 12): [0, 1] covered exactly once
    assert [(r["owners"], r["padding"]) for r in w] == [((0,), False), ((1,), False), ((2,), False), ((3,), False),
                                                        ((3,), True)]
    assert w[0]["x0"] == 0 and w[-1]["x1"] == 1 and all(a["x1"] == pytest.approx(b["x0"]) for a, b in zip(w, w[1:]))
    assert w[3]["x1"] - w[3]["x0"] == pytest.approx(3 / 36) and w[4]["x1"] - w[4]["x0"] == pytest.approx(6 / 36)
    assert all(r["colors"] == [rank_color(o) for o in r["owners"]] for r in rects)
    assert "[9:10, 0:3] of (10, 3)" in w[3]["title"]


def test_replicated_state_is_one_stretch_held_by_every_rank():
    spec = what_if({"w": (10, 3)}, world_size=4, strategy="zero1")
    (params,) = ownership_rects(spec, "params")          # ZeRO-1: parameters replicated ...
    assert params["owners"] == (0, 1, 2, 3) and (params["x0"], params["x1"]) == (0, 1)
    assert len(ownership_rects(spec, "optimizer")) == 5   # ... the optimizer state sharded (+ padding)
    with pytest.raises(ValueError, match="state"):
        ownership_rects(spec, "activations")


def test_hsdp_stretches_carry_both_replicas_colours():
    spec = what_if({"w": (8, 2)}, world_size=4, strategy="hsdp")
    rects = ownership_rects(spec)
    assert [r["colors"] for r in rects] == [[rank_color(0), rank_color(2)], [rank_color(1), rank_color(3)]]
    svg = ownership_svg(spec)
    assert svg.count('class="slice"') == 2 and svg.count("<title>") == 2


def test_flat_units_mark_where_each_tensor_starts():
    from course_lib.widgets import member_starts
    spec = describe_flat([[("w1", (5,)), ("b1", (2,))], [("w2", (4, 4))]], 3)
    assert member_starts(spec.bars[0]) == [("w1", 0.0), ("b1", pytest.approx(5 / 9))]
    assert member_starts(spec.bars[1]) == [("w2", 0.0)]
    assert ownership_svg(spec).count('class="member-boundary"') == 1


def test_ownership_widget_controls_redraw():
    wd = show_ownership({"w": (10, 3), "b": (3,)}, world_size=4, strategy="fsdp")
    assert isinstance(wd, OwnershipWidget) and wd.spec.world_size == 4
    before = wd.bars_html.value
    wd.world.value = 8
    assert wd.spec.world_size == 8 and wd.bars_html.value != before and len(wd.rank.options) == 9
    wd.strategy.value = "hsdp"
    assert wd.spec.mesh_shape == (2, 4) and not wd.replicate.disabled and wd.layout_dd.value == "dim0"
    wd.replicate.value = 4
    assert wd.spec.mesh_shape == (4, 2)
    wd.strategy.value = "zero2"
    assert wd.layout_dd.value == "flat" and wd.spec.layout == "flat" and wd.replicate.disabled
    wd.state.value = "optimizer"
    html = wd.bars_html.value
    assert "<b>optimizer</b> sharded" in html
    wd.state.value = "params"   # ZeRO-2 parameters are replicated: the picture says so
    assert "<b>params</b> replicated" in wd.bars_html.value and wd.bars_html.value != html
    wd.rank.value = 3           # highlight rank 3: replicated params stay lit, others' optimizer shards dim
    assert 'fill-opacity="0.18"' not in wd.bars_html.value
    wd.state.value = "optimizer"
    assert 'fill-opacity="0.18"' in wd.bars_html.value
    wd.selected.value = "unit0" if "unit0" in wd.selected.options else wd.selected.options[0]
    assert "slice-table" in wd.table_html.value


def _descendants(widget):
    yield widget
    for c in getattr(widget, "children", ()):
        yield from _descendants(c)


def test_real_spec_shows_no_what_if_controls():
    spec = describe_flat([[("w1", (5,)), ("b1", (2,))]], 3)
    assert spec.inputs is not None        # flat units are a description: the controls apply
    editable = show_ownership(spec)
    assert editable.world in list(_descendants(editable))
    real = dataclasses.replace(spec, inputs=None, source="torch")
    wd = show_ownership(real)
    shown = list(_descendants(wd))
    assert wd.world not in shown and wd.strategy not in shown and wd.state in shown
    with pytest.raises(ValueError, match="only apply to a what-if spec"):
        show_ownership(real, world_size=8)


def test_mimebundle_has_widget_view_text_and_png():
    wd = show_ownership(what_if({"w": (10, 3)}, world_size=4, strategy="fsdp"))
    data = wd._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert data["text/plain"].startswith("fsdp over 4 ranks") and "rank 3" in data["text/plain"]
    assert base64.b64decode(data["image/png"]).startswith(PNG)


# -- traffic ---------------------------------------------------------------------------------------------
def _ledger(n=2, steps=2, v=120):
    """An FSDP-like run: per step all-gather (forward), all-gather + reduce-scatter (backward)."""
    recs, t = [], 0.0
    for s in range(steps):
        for phase, op in (("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")):
            for r in range(n):
                recs.append(CollectiveRecord(op, v, "float32", n, r, tuple(range(n)), None, t, t + 0.001, phase, s))
            t += 0.002
    return Ledger(recs)


def test_traffic_rows_totals_and_colours():
    led = _ledger()
    rows = traffic_rows(led)
    assert len(rows) == 12 and {r["rank"] for r in rows} == {0, 1}
    assert all(r["wire"] == 60 for r in rows)           # ring: (N-1)/N * V = 120 / 2
    totals = traffic_totals(led)
    assert totals[(0, "forward")] == {"count": 2, "payload": 240, "wire": 120.0}
    assert totals[(1, "backward")] == {"count": 4, "payload": 480, "wire": 240.0}
    assert len(traffic_rows(led, step=1, rank=0)) == 3
    assert traffic_rows(led)[0]["group"] == "world"


def test_traffic_compare_against_step_cost():
    # one unit of 30 fp32 elements on 2 ranks: V = 120 bytes; FSDP: AG fwd + AG bwd + RS bwd per step
    analytic = costs.step_cost("fsdp", [[(30,)]], 2)
    rows = traffic_compare(_ledger(), analytic)
    by = {(r["phase"], r["op"]): r for r in rows}
    assert set(by) == {("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")}
    assert all(r["ratio"] == pytest.approx(1.0) and r["count"] == 1 for r in rows)
    # a DP analytic cost (all-reduce) against the same run: per op, the mismatch shows
    dp = {(r["phase"], r["op"]): r for r in traffic_compare(_ledger(), costs.step_cost("dp", [[(30,)]], 2))}
    assert dp[("backward", "all_reduce")]["measured"] == 0 and dp[("backward", "all_reduce")]["ratio"] == 0
    assert dp[("forward", "all_gather")]["analytic"] is None
    plain = traffic_compare(_ledger(), {"all_gather": 120.0, "reduce_scatter": 30.0}, step=0)
    assert {r["op"]: r["ratio"] for r in plain} == {"all_gather": 1.0, "reduce_scatter": 2.0}


def test_unlabelled_forward_gathers_take_the_analytic_phase_they_lack():
    """FSDP2's forward all-gathers carry no phase (only backward is detected): they must meet the analytic
    forward row, not show as 'forward 0 bytes, ratio 0.000' beside an unexplained 'any' row."""
    led = Ledger([r if r.phase != "forward" else dataclasses.replace(r, phase=None) for r in _ledger().records])
    rows = traffic_compare(led, costs.step_cost("fsdp", [[(30,)]], 2))
    by = {(r["phase"], r["op"]): r for r in rows}
    assert set(by) == {("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")}
    assert all(r["ratio"] == pytest.approx(1.0) for r in rows)


def test_group_label_names_axis_world_or_ranks():
    rec = CollectiveRecord("all_gather", 8, "float32", 2, 0, (0, 2), "shard", 0.0, 0.1)
    assert group_label(rec, 4) == "shard"
    assert group_label(CollectiveRecord("all_reduce", 8, "float32", 2, 0, (0, 2)), 4) == "ranks 0,2"
    assert group_label(CollectiveRecord("all_reduce", 8, "float32", 4, 0, (0, 1, 2, 3)), 4) == "world"


def test_jax_ledger_is_drawn_in_program_order():
    led = Ledger([CollectiveRecord("all_gather", 64, "float32", 8, source="jax-hlo", axis="data"),
                  CollectiveRecord("all_reduce", 64, "float32", 8, source="jax-hlo", axis="data")])
    rows = traffic_rows(led)
    assert [(r["x0"], r["rank"]) for r in rows] == [(0.0, -1), (1.0, -1)]
    assert "program order" in traffic_svg(rows) and "all devices" in traffic_svg(rows)
    assert traffic_compare(led)[0]["measured"] == pytest.approx(64 * 7 / 8)


def test_missing_end_time_is_drawn_up_to_the_next_op():
    recs = [CollectiveRecord("reduce_scatter", 8, "float32", 2, 0, (0, 1), None, 0.0, None),
            CollectiveRecord("all_reduce", 8, "float32", 2, 0, (0, 1), None, 0.0005, 0.0006)]
    rows = traffic_rows(Ledger(recs))
    assert rows[0]["x1"] == pytest.approx(0.0005)


def test_traffic_widget_steps_through_the_run():
    wd = show_traffic(_ledger(), analytic=costs.step_cost("fsdp", [[(30,)]], 2), title="fsdp")
    assert wd.timeline.value.count('class="collective"') == 12
    wd.step.value = 1
    assert wd.timeline.value.count('class="collective"') == 6 and wd.op.max == 6 and wd.op.value == 1
    wd.op.value = 5             # collective 5 of 6 in run order: rank 0's backward reduce-scatter
    assert "stroke-width=\"2\"" in wd.timeline.value and "reduce_scatter" in wd.detail.value
    assert "1.000" in wd.compare.value
    data = wd._repr_mimebundle_()
    assert data["text/plain"].startswith("fsdp") and base64.b64decode(data["image/png"]).startswith(PNG)


def test_show_traffic_accepts_dict_rows():
    wd = show_traffic(_ledger().to_dicts())
    assert wd.timeline.value.count('class="collective"') == 12


def test_clock_offsets_line_up_ranks_on_collective_ends():
    from course_lib.maths.traffic import clock_offsets
    recs = []
    for r, skew in ((0, 0.0), (1, 0.005)):      # rank 1's clock started 5 ms earlier: its times read 5 ms later
        for k, op in enumerate(("all_gather", "reduce_scatter", "all_reduce")):
            t = 0.01 * k + skew
            recs.append(CollectiveRecord(op, 8, "float32", 2, r, (0, 1), None, t, t + 0.002))
    led = Ledger(recs)
    assert clock_offsets(led) == {0: 0.0, 1: pytest.approx(0.005)}
    rows = traffic_rows(led)
    assert [r["x0"] for r in rows if r["rank"] == 1] == pytest.approx([r["x0"] for r in rows if r["rank"] == 0])
    assert [r["start"] for r in rows if r["rank"] == 1][0] == pytest.approx(0.005)   # the record itself is untouched
    assert traffic_rows(led, align=False)[3]["x0"] == pytest.approx(0.005)


def test_slices_list_and_table_follow_a_what_if_change():
    wd = show_ownership({"w": (10, 3), "b": (3,)}, world_size=4, strategy="fsdp")
    before_opts, before_table = list(wd.selected.options), wd.table_html.value
    wd.strategy.value = "zero2"                       # flat units: the bars are now units, not tensors
    names = [b.name for b in wd.spec.bars]
    assert list(wd.selected.options) == names != before_opts
    assert wd.selected.value in names and wd.table_html.value != before_table
    wd.world.value = 3                                # the table speaks of the new world size
    assert wd.spec.world_size == 3 and "rank 3" not in wd.table_html.value


def test_svgs_scale_to_the_output_width_and_labels_are_cut_in_the_middle():
    from course_lib.widgets.base import short_middle
    svg = ownership_svg(what_if({"transformer.blocks.0.attention.qkv_projection.weight": (198, 66)},
                                world_size=4, strategy="fsdp"))
    head = svg[:svg.index(">")]
    assert 'viewBox="0 0 ' in head and 'width="100%"' in head and "max-width:" in head
    assert "(198, 66)" in svg                         # the shape is never cut
    assert short_middle("x" * 50 + " (198, 66)", 30).endswith("(198, 66)")
    rows = traffic_rows(Ledger([CollectiveRecord("all_gather", 64, "float32", 2, rank=r, start=0.0, end=0.1)
                                for r in range(2)]))
    assert 'width="100%"' in traffic_svg(rows)


def test_ownership_figure_shows_every_parameter():
    from course_lib.widgets import ownership_figure
    spec = what_if({f"layer{i}.weight": (4, 3) for i in range(30)}, world_size=2, strategy="fsdp")
    fig = ownership_figure(spec)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == 30 and labels[-1].startswith("layer29")


# -- traffic: legible, one number per collective, only what applies ---------------------------------------
def _texts(svg: str, cls: str) -> list[str]:
    return re.findall(rf'<text class="{cls}"[^>]*>([^<]*)</text>', svg)


def _all_html(widget) -> str:
    return "".join(getattr(c, "value", "") or "" for c in _descendants(widget) if isinstance(getattr(c, "value", None), str))


def test_slider_number_is_the_collective_number_in_the_detail_line_and_the_hover():
    wd = show_traffic(_ledger())
    wd.step.value = 1           # ledger records 6..11; the slider counts 1..6 within the step
    wd.op.value = 2
    detail = wd.detail.value
    assert "collective 2 of 6" in detail and not re.search(r"#\d", detail)
    lit = re.search(r'<g class="collective"[^>]*data-k="(\d+)"><title>([^<]*)</title><rect[^>]*stroke-width="2"',
                    wd.timeline.value)
    assert lit and lit.group(1) == "2" and lit.group(2).startswith("collective 2 of 6: rank 1, step 1, forward")
    titles = re.findall(r"<title>([^<]*)</title>", wd.timeline.value)
    assert "rank 1, step 1, forward" in detail and not any(re.search(r"#\d", t) for t in titles)


def test_time_axis_has_round_ticks_in_ms_from_zero():
    recs = [CollectiveRecord("all_gather", 64, "float32", 2, r, (0, 1), None, t, t + 0.004)
            for t in (0.003, 0.020, 0.041) for r in range(2)]
    svg = traffic_svg(traffic_rows(Ledger(recs)))
    assert _texts(svg, "tick-label") == ["0", "10", "20", "30", "40 ms"]
    assert svg.count('<line class="tick"') == 5


def test_a_short_reduce_scatter_is_drawn_wide_enough_and_named():
    recs = [CollectiveRecord("all_gather", 4096, "float32", 2, 0, (0, 1), None, 0.0, 0.040, "forward", 0),
            CollectiveRecord("reduce_scatter", 4096, "float32", 2, 0, (0, 1), None, 0.0401, 0.0402, "backward", 0),
            CollectiveRecord("all_reduce", 16, "float32", 2, 0, (0, 1), None, 0.0403, 0.0404, "optimizer", 0),
            CollectiveRecord("all_gather", 4096, "float32", 2, 0, (0, 1), None, 0.050, 0.090, "forward", 1)]
    svg = traffic_svg(traffic_rows(Ledger(recs)))
    groups = dict(re.findall(r'<g class="collective" data-op="(\w+)"[^>]*data-k="2">(.*?)</g>', svg))
    rs = groups["reduce_scatter"]
    assert float(re.search(r'<rect[^>]*\swidth="([\d.]+)"', rs).group(1)) >= 6
    assert re.search(r'<text class="op-label"[^>]*>RS</text>', rs)
    assert sorted(_texts(svg, "op-label")) == ["AG", "AG", "AR", "RS"]   # every box named, short ones above
    ar_x = float(re.search(r'data-k="3">.*?<text class="op-label" x="([\d.]+)"', svg).group(1))
    rs_x = float(re.search(r'<text class="op-label" x="([\d.]+)"', rs).group(1))
    rs_y = float(re.search(r'<text class="op-label"[^>]*y="([\d.]+)"', rs).group(1))
    ar_y = float(re.search(r'data-k="3">.*?<text class="op-label"[^>]*y="([\d.]+)"', svg).group(1))
    assert abs(ar_x - rs_x) >= 14 or ar_y != rs_y                       # side by side labels do not overlap


def test_controls_and_legend_entries_that_do_not_apply_are_hidden():
    # no step numbers, no optimizer phase, one rank whose aligned clock starts before 0
    recs = [CollectiveRecord("all_gather", 64, "float32", 2, 0, (0, 1), None, -0.002, 0.001, "forward"),
            CollectiveRecord("reduce_scatter", 64, "float32", 2, 0, (0, 1), None, 0.004, 0.0041, "backward")]
    wd = show_traffic(Ledger(recs))
    shown = list(_descendants(wd))
    assert wd.step not in shown and wd.rank not in shown and wd.op in shown
    legend = wd.legend.value
    assert "forward" in legend and "backward" in legend and "optimizer" not in legend and "no phase" not in legend
    assert "AR" not in legend and "RS reduce-scatter" in legend
    everything = _all_html(wd) + wd._repr_mimebundle_()["text/plain"]
    assert "step None" not in everything and "None" not in re.sub(r"<[^>]*>", " ", everything)
    text = re.sub(r"<[^>]*>", " ", wd.timeline.value)
    assert not re.search(r"(?<![\w.])-\d", text), text          # no negative time anywhere
    assert _texts(wd.timeline.value, "tick-label")[0] == "0"
    assert "0.000 to 3.000 ms" in wd.timeline.value             # the early start is the origin
    full = show_traffic(_ledger())                              # a run with steps still has its step control
    assert full.step in list(_descendants(full)) and "no phase" not in full.legend.value


def test_traffic_boxes_coloured_by_mesh_axis():
    """``color_by="axis"``: every box of one mesh axis has that axis's colour, and the legend names the axes."""
    import re
    from course_lib.comm.ledger import CollectiveRecord, Ledger
    from course_lib.maths.traffic import traffic_rows
    from course_lib.widgets.timeline_svg import axis_colors, traffic_svg
    recs = [CollectiveRecord(op=op, nbytes=1024, dtype="float32", group_size=2, rank=r, axis=axis, start=0.001 * k,
                             end=0.001 * k + 0.0005, step=0)
            for k, (op, axis) in enumerate([("all_gather", "dp_shard"), ("all_reduce", "tp"), ("all_reduce", "tp")])
            for r in (0, 1)]
    rows = traffic_rows(Ledger(recs))
    colours = axis_colors(rows)
    svg = traffic_svg(rows, color_by="axis")
    fills = re.findall(r'data-op="(\w+)"[^>]*><title>[^<]*</title><rect [^>]*fill="(#\w+)"', svg)
    assert fills and {(op, c) for op, c in fills} == {("all_gather", colours["dp_shard"]), ("all_reduce", colours["tp"])}
    assert colours["dp_shard"] != colours["tp"]
    from course_lib.widgets import show_traffic
    widget = show_traffic(Ledger(recs), color_by="axis")
    assert "box colour = mesh axis" in widget.legend.value and "dp_shard" in widget.legend.value
    with pytest.raises(ValueError, match="color_by"):
        traffic_svg(rows, color_by="phase")


def test_every_figure_is_a_picture_where_it_is_the_cells_value():
    """A Figure made without pyplot shows as '<Figure size ...>' text in a kernel that never imported pyplot; the
    course's figures carry their own PNG. The y label says 'per step' only when the ledger counts steps."""
    from course_lib.widgets import ownership_figure, traffic_figure
    led = Ledger([CollectiveRecord("all_reduce", 4096, "float32", 2, r, (0, 1), None, 0.1 * r, 0.1 * r + 0.05)
                  for r in range(2)])
    fig = traffic_figure(led)
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fig.axes[1].get_ylabel() == "wire bytes per rank, whole run"
    assert traffic_figure(_ledger()).axes[1].get_ylabel() == "wire bytes per rank per step"
    assert ownership_figure(describe_flat([(3, 4), (5,)], 4))._repr_png_()[:4] == b"\x89PNG"


def test_no_solution_output_is_a_figure_without_its_picture():
    """nbval compares no images: this reads every stored output of every solution instead."""
    import glob

    import nbformat
    bare = []
    for path in sorted(glob.glob(str(__import__("pathlib").Path(__file__).parents[1] / "solutions" / "*.ipynb"))):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
                data = out.get("data", {})
                if "<Figure size" in data.get("text/plain", "") and "image/png" not in data:
                    bare.append(f"{path.rsplit('/', 1)[1]} cell {i}")
    assert bare == [], f"a figure shown as text only (no PNG): {bare}"
