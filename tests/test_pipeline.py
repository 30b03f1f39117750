"""Pipeline parallel: the schedules' orders (the same as torch's own), their simulated timelines (bubble
(p-1)/(m+p-1), activations held), the from-scratch send/recv pipeline and torch.distributed.pipelining on gloo equal
to one process, and the JAX ppermute pipeline equal to the sequential model -- at awkward sizes."""
from __future__ import annotations

import pytest
import torch

from course_lib import launch
from course_lib.strategies.pp import schedule
from course_lib.strategies.pp import torch as ppt

SIZES = [(4, 8), (3, 5), (5, 2), (1, 3), (2, 7)]


# -- pure ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, torch_name", [("1f1b", "1F1B"), ("gpipe", "GPipe")])
@pytest.mark.parametrize("p, m", [(4, 8), (3, 5), (4, 4)])     # torch's 1F1B refuses m < p; ours caps the warm-up
def test_orders_are_torchs_own(kind, torch_name, p, m):
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    theirs = vis.get_schedule_ops(torch_name, p, m)
    for s in range(p):
        ops = [(a.computation_type.value, a.microbatch_index) for a in theirs[s]
               if a is not None and a.computation_type.value in ("F", "B")]
        ours = schedule.orders(kind, p, m)[s]
        assert [k for k, _ in ops] == [k for k, _ in ours], (kind, p, m, s)
        if s < p - 1:   # torch 2.13's visualizer numbers the last stage's 1F1B forwards from 1 (F1..Fm): kinds only
            assert ops == ours, (kind, p, m, s)


@pytest.mark.parametrize("p, m", SIZES)
@pytest.mark.parametrize("f, b", [(1, 2), (1, 1), (2, 3)])
def test_both_schedules_idle_the_bubble_fraction_and_1f1b_holds_fewer(p, m, f, b):
    for kind in schedule.SCHEDULES:
        orders = schedule.orders(kind, p, m)
        idle, span = schedule.idle_units(schedule.simulate(orders, f, b), p)
        assert span == (m + p - 1) * (f + b)
        assert all(i / span == pytest.approx(schedule.bubble_fraction(p, m), rel=1e-12) for i in idle)
    assert [schedule.peak_activations(o) for o in schedule.orders("gpipe", p, m)] == [m] * p
    assert [schedule.peak_activations(o) for o in schedule.orders("1f1b", p, m)] == [min(p - s, m) for s in range(p)]


def test_bad_sizes_and_deadlocks_are_named():
    with pytest.raises(ValueError, match=r"stage=4 must be an integer in 0..3"):
        schedule.one_f_one_b_order(4, 4, 8)
    with pytest.raises(ValueError, match=r"m=0"):
        schedule.gpipe_order(0, 4, 0)
    with pytest.raises(ValueError, match="deadlocks"):
        schedule.simulate([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]])
    with pytest.raises(ValueError, match=r"layers\(6\) % p\(4\) != 0"):
        ppt.PipeConfig(layers=6, p=4)
    with pytest.raises(ValueError, match=r"batch\(10\) % m\(4\) != 0"):
        ppt.PipeConfig(batch=10, m=4)


# -- gloo ------------------------------------------------------------------------------------------------
def _check_grads(cfg, outs):
    loss, ref = ppt.reference_grads(cfg)
    got = {}
    for o in outs:
        got.update(o["grads"])
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6)
    losses = next(o["losses"] for o in reversed(outs) if o["losses"])
    assert sum(losses) / cfg.m == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("p, m", [(4, 3), (3, 5)])
def test_scratch_pipeline_equals_one_process_and_holds_what_the_schedule_says(p, m):
    cfg = ppt.PipeConfig(d=13, layers=2 * p, p=p, m=m, batch=2 * m)
    for kind in schedule.SCHEDULES:
        outs = launch.run(ppt.scratch_step, cfg, kind, world_size=p, timeout=120)
        _check_grads(cfg, outs)
        assert [o["peak_held"] for o in outs] == [schedule.peak_activations(x) for x in schedule.orders(kind, p, m)]
        rows = cfg.batch // m         # per micro-batch a stage of 2 (Linear, Tanh) blocks saves its input and the
        for s, o in enumerate(outs):  # 2 Tanh outputs (the second Linear's input is the first Tanh's output)
            assert o["activation_bytes"] == 3 * rows * cfg.d * 4, (s, o["activation_bytes"])
            assert o["peak_activation_bytes"] == o["peak_held"] * o["activation_bytes"]
        assert [[(k, i) for k, i, _, _ in o["events"]] for o in outs] == schedule.orders(kind, p, m)


@pytest.mark.parametrize("kind", ["1f1b", "interleaved"])
def test_torch_pipelining_equals_one_process(kind):
    cfg = ppt.PipeConfig(d=11, layers=8, p=4, m=4, batch=12)
    _check_grads(cfg, launch.run(ppt.pipelining_step, cfg, kind, world_size=4, timeout=120))


# -- JAX -------------------------------------------------------------------------------------------------
def test_jax_pipeline_equals_the_sequential_model_values_and_gradients():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from course_lib.strategies.pp import jax as ppj
    p, m = 4, 5
    mesh = ppj.stage_mesh(p)
    w = ppj.init_weights(p, 7)
    xs = jax.random.normal(jax.random.key(3), (m, 3, 7))
    seq = jax.vmap(lambda x: ppj.sequential(w, x))
    np.testing.assert_allclose(jax.jit(lambda w, xs: ppj.pipeline(w, xs, mesh))(w, xs), seq(xs), rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda w: jnp.sum(ppj.pipeline(w, xs, mesh) ** 2))(w)
    g_ref = jax.grad(lambda w: jnp.sum(jax.vmap(lambda x: ppj.sequential(w, x))(xs) ** 2))(w)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-6)
    table = ppj.tick_table(p, m)
    assert len(table) == m + p - 1 and sum(v is None for row in table for v in row) == p * (p - 1)
    with pytest.raises(ValueError, match="one stage per device"):
        ppj.pipeline(ppj.init_weights(3, 7), xs, mesh)


def test_the_timeline_figure_draws_every_op_and_carries_a_png():
    from course_lib.widgets.base import figure_png
    from course_lib.widgets.dimensions import pipeline_figure
    p, m = 3, 4
    panels = [(kind, [(s.stage, s.kind, s.mb, s.start, s.end) for s in schedule.simulate(schedule.orders(kind, p, m))])
              for kind in schedule.SCHEDULES]
    fig = pipeline_figure(panels, p)
    assert [len(ax.patches) for ax in fig.axes] == [2 * p * m] * 2
    assert figure_png(fig)[:8] == b"\x89PNG\r\n\x1a\n" and fig._repr_png_()[:4] == b"\x89PNG"
