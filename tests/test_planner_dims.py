"""Pipeline, context and expert parallelism in the planner: every term against its hand formula (awkward sizes),
bad configurations refused by name, and the published runs that use them (run with ``-s`` to see the table)::

    PYTHONPATH=. python -m pytest tests/test_planner_dims.py -q -s -p no:xdist
"""
import dataclasses
import doctest

import pytest

from course_lib.maths import planner as pl, planner_dims as pd, planner_moe as pm, planner_runs as runs
from course_lib.maths import planner_work as work
from course_lib.maths.planner_hw import H100_TT500W, IB_NDR, NVLINK_H100, GiB

MIXTRAL, MIXTRAL_MOE = runs.MIXTRAL_8X7B, runs.MIXTRAL_8X7B_MOE   # the dense twin of Mixtral 8x7B, its experts
TT = lambda nodes: pl.Cluster(H100_TT500W, 8, nodes, NVLINK_H100, IB_NDR)  # noqa: E731


# -- pipeline -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m,v,expected", [(7, 13, 1, 6 / 19), (1, 5, 1, 0.0), (4, 12, 3, 3 / 39), (8, 8, 2, 7 / 23)])
def test_bubble_is_the_fill_and_drain_share(p, m, v, expected):
    sched = "interleaved" if v > 1 else "1f1b"
    assert pd.bubble_fraction(pd.Dims(pp=p, micro_batches=m, schedule=sched, virtual_stages=v)) == pytest.approx(
        expected, rel=1e-12)
    assert pd.bubble_fraction(pd.Dims(pp=p, micro_batches=m, schedule="gpipe")) == pytest.approx((p - 1) / (m + p - 1))


def test_the_busiest_rank_holds_the_rounded_up_share_of_layers():
    assert pd.busiest_rank_layers(126, pd.Dims(pp=8, micro_batches=8)) == 16
    assert pd.busiest_rank_layers(126, pd.Dims(pp=8, micro_batches=8, schedule="interleaved", virtual_stages=2)) == 16
    assert pd.busiest_rank_layers(13, pd.Dims(pp=4, micro_batches=4)) == 4
    assert pd.busiest_rank_layers(13, pd.Dims(pp=3, micro_batches=3, schedule="interleaved", virtual_stages=3)) == 6
    with pytest.raises(ValueError, match=r"n_layers\(5\) < pp\(3\) x virtual_stages\(2\)"):
        pd.busiest_rank_layers(5, pd.Dims(pp=3, micro_batches=3, schedule="interleaved", virtual_stages=2))


def test_micro_batches_in_flight_by_schedule():
    assert pd.in_flight(pd.Dims(pp=5, micro_batches=3, schedule="gpipe"), 4) == 3
    one = pd.Dims(pp=5, micro_batches=7)
    assert [pd.in_flight(one, r) for r in range(5)] == [5, 4, 3, 2, 1]        # 1F1B: p - rank
    assert pd.in_flight(pd.Dims(pp=5, micro_batches=3), 0) == 3                 # ... capped by m
    il = pd.Dims(pp=4, micro_batches=8, schedule="interleaved", virtual_stages=2)
    assert pd.in_flight(il, 0) == (2 * 3 + 4 + 1) / 2 and pd.in_flight(il, 3) == (0 + 4 + 1) / 2
    with pytest.raises(ValueError, match=r"rank=5 must be in \[0, pp\(5\)\)"):
        pd.in_flight(one, 5)


def test_p2p_bytes_per_step():
    d = pd.Dims(pp=3, micro_batches=7)
    assert pd.p2p_bytes_per_step(d, 3, 1000, 4095) == 2 * 7 * 3 * 1000 * 4095 * 2
    il = pd.Dims(pp=3, micro_batches=9, schedule="interleaved", virtual_stages=3)
    assert pd.p2p_bytes_per_step(il, 1, 999, 17, bytes_per=4, shards=3) == 2 * 9 * 999 * 17 * 4 / 3 * 3


# -- context parallel -----------------------------------------------------------------------------------------
def test_ring_bytes_per_layer():
    fwd, bwd = pd.ring_bytes_per_layer(3, 2, 3006, 257)
    assert fwd == pytest.approx(2 * 2 * 2 * 1002 * 257 * 2, rel=1e-12)          # (cp-1) K and V blocks of b·s/cp
    # backward: K, V again over cp-1 hops; their fp32 dK, dV over cp hops, the last one home
    assert bwd == pytest.approx(2 * 2 * 2 * 1002 * 257 * 2 + 3 * 2 * 2 * 1002 * 257 * 4, rel=1e-12)
    assert pd.ring_bytes_per_layer(1, 2, 3006, 257) == (0, 0)
    f2, b2 = pd.ring_bytes_per_layer(3, 2, 3006, 257, grad_bytes=2)
    assert b2 == pytest.approx(f2 * (1 + 3 / 2), rel=1e-12)                     # bf16 gradients, one more hop


def test_the_ring_hides_under_attention_unless_the_link_is_slow():
    assert pd.ring_exposed_s(4, 1e9, 1e11, 0.5) == 0.0          # 10 ms of transfer under 500 ms of attention
    assert pd.ring_exposed_s(4, 1e9, 1e9, 0.25) == pytest.approx(3 * 0.75)
    assert pd.ring_exposed_s(1, 1e9, 1e9, 0.0) == 0.0


def test_an_all_gather_hides_under_one_block_a_ring_under_every_block():
    """cp 5, K/V blocks of 1 GB at 10 GB/s (0.1 s each), dK/dV blocks of 2 GB, a block of attention 0.05 s forward."""
    kv, grad, bw, blk = 1e9, 2e9, 1e10, 0.05
    f, b = pd.cp_exposed_s(5, kv, grad, bw, blk, "allgather")
    assert f == pytest.approx(4 * 0.1 - 0.05)                   # four blocks gathered at once, under one block
    # backward: the gather under one backward block (0.125 s), dK/dV 0.2 s a hop under 0.125, the last hop bare
    assert b == pytest.approx((0.4 - 0.125) + 4 * (0.2 - 0.125) + 0.2)
    f, b = pd.cp_exposed_s(5, kv, grad, bw, blk, "ring", forward_passes=2)
    assert f == pytest.approx(2 * 4 * (0.1 - 0.05))             # full AC: the forward's ring runs twice
    assert b == pytest.approx(4 * 0.0 + 4 * (0.2 - 0.125) + 0.2)
    assert pd.cp_exposed_s(1, kv, grad, bw, blk) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"rotate='alltoall' must be one of \('allgather', 'ring'\)"):
        pd.cp_exposed_s(2, kv, grad, bw, blk, "alltoall")


def test_repeated_kv_moves_every_query_heads_width():
    """torchtitan's Llama (end of 2024) repeated K/V to all 32 heads before attention: 4x the bytes of 8 KV heads."""
    kw = dict(seq_len=65536, checkpointing="full", compile=True, float8=True)
    own, rep = (pd.plan(pl.LLAMA3_8B, TT(1), 1, pd.Dims(cp=2, repeat_kv=r), **kw) for r in (False, True))
    assert rep.ring_bytes == pytest.approx(own.ring_bytes * pl.LLAMA3_8B.d_model / pl.LLAMA3_8B.d_kv, rel=1e-12)
    assert rep.step_s >= own.step_s
    with pytest.raises(ValueError, match=r"cp_rotate='p2p' must be one of \('allgather', 'ring'\)"):
        pd.Dims(cp=2, cp_rotate="p2p")


def test_context_parallel_divides_tokens_not_attention():
    """At a fixed s/cp, doubling cp doubles each token's attention and leaves its matmuls alone."""
    kw = dict(checkpointing="full", compile=True, float8=True)
    a, b = (pd.plan(pl.LLAMA3_8B, TT(1), 1, pd.Dims(cp=cp), seq_len=32768 * cp, **kw) for cp in (2, 4))
    assert a.parts["compute"] == pytest.approx(b.parts["compute"], rel=1e-12)
    # cp - 1 extra shares of the s/cp attention: 1 at cp 2, 3 at cp 4
    assert b.parts["context-parallel attention"] == pytest.approx(3 * a.parts["context-parallel attention"], rel=1e-12)
    assert a.tokens_per_step == b.tokens_per_step == 32768
    layers = pl.LLAMA3_8B.n_layers
    f, bw = pd.ring_bytes_per_layer(4, 1, 131072, pl.LLAMA3_8B.d_kv)
    assert b.ring_bytes == pytest.approx(layers * (2 * f + bw))  # full AC: the forward ring runs twice


# -- the composed step ----------------------------------------------------------------------------------------
def test_without_pp_or_cp_the_step_is_planner_plan():
    kw = dict(seq_len=8192, checkpointing="selective")
    base = pl.plan(pl.LLAMA3_8B, TT(1), "fsdp", 2, **kw)
    dp = pd.plan(pl.LLAMA3_8B, TT(1), 2, pd.Dims(), **kw)
    assert dp.step_s == pytest.approx(base.device_s, rel=1e-12)
    assert dp.total == pytest.approx(base.total, rel=1e-12)
    assert dp.mfu == pytest.approx(base.tokens_per_s_per_gpu * base.model_flops_per_token / base.peak_flops
                                   * base.step_s / base.device_s, rel=1e-12)


def test_pipeline_step_and_memory_by_schedule():
    m, kw = pl.LLAMA3_70B, dict(seq_len=8192, tp=8, checkpointing="full")
    g = pd.plan(m, TT(8), 12, pd.Dims(pp=4, micro_batches=12, schedule="gpipe"), **kw)
    f = pd.plan(m, TT(8), 12, pd.Dims(pp=4, micro_batches=12), **kw)
    i = pd.plan(m, TT(8), 12, pd.Dims(pp=4, micro_batches=12, schedule="interleaved", virtual_stages=2), **kw)
    assert g.step_s == pytest.approx(f.step_s, rel=1e-12)            # same bubble ...
    layer = work.saved_bytes_per_token(m, "full") * 8192 / 8 * 20    # one micro-batch of a 20-layer stage
    assert g.total - f.total == pytest.approx((12 - 4) * layer, rel=1e-9)   # ... GPipe holds m, 1F1B p
    assert i.bubble == pytest.approx(3 / 27) and f.bubble == pytest.approx(3 / 15)
    assert i.parts["bubble"] < f.parts["bubble"] and i.p2p_bytes == 2 * f.p2p_bytes
    assert f.p2p_bytes == 2 * 12 * 1 * 8192 * 8192 * 2 / 8
    steady = f.step_s - f.parts["bubble"]
    assert f.parts["bubble"] == pytest.approx((steady - f.parts["fsdp exposed"] - f.parts["optimizer"]
                                               - f.parts["p2p exposed"]) * 3 / 12, rel=1e-9)


def test_pipeline_memory_holds_a_gathered_stage_only_when_parameters_are_sharded():
    """FSDP under PP keeps the stage gathered with an fp32 gradient (6 B a parameter); ZeRO-1 already holds both."""
    m, kw = pl.LLAMA3_8B, dict(seq_len=4096, checkpointing="full")
    for strategy in ("fsdp", "zero1"):
        d = pd.Dims(pp=2, micro_batches=6)
        r = pd.plan(m, TT(2), 6, d, strategy=strategy, **kw)
        stage = dataclasses.replace(m, n_layers=16)
        flight = (2 - 1) * 16 * work.saved_bytes_per_token(m, "full") * 4096
        held = 6 * stage.params if strategy == "fsdp" else r.stage.buffers
        assert r.total == pytest.approx(r.stage.total - r.stage.buffers + held + flight, rel=1e-12)


# -- expert parallel ------------------------------------------------------------------------------------------
def test_moe_parameters_match_mixtral():
    """Jiang et al., "Mixtral of Experts" (2024), sec. 2: 47B parameters, 13B active per token (Mistral AI's
    announcement: 46.7B and 12.9B)."""
    dense, experts = pm.moe_params(MIXTRAL, MIXTRAL_MOE)
    assert (dense + experts) / 1e9 == pytest.approx(46.7, abs=0.05)
    assert pm.moe_active_params(MIXTRAL, MIXTRAL_MOE) / 1e9 == pytest.approx(12.9, abs=0.05)
    s = 4096
    assert pm.moe_flops_per_token(MIXTRAL, MIXTRAL_MOE, s) == pytest.approx(
        6 * (pm.moe_active_params(MIXTRAL, MIXTRAL_MOE) - 32000 * 4096) + 12 * 32 * 4096 * s, rel=1e-12)


def test_all_to_all_and_expert_memory():
    moe = pm.MoE(n_experts=12, top_k=3, d_ff_expert=1000, moe_layers=5, shared_experts=1)
    assert pm.all_to_all_bytes_per_layer(1001, moe, 257, 6) == 4 * 1001 * 3 * 257 * 2 * 5 / 6
    assert pm.all_to_all_bytes_per_layer(1001, moe, 257, 1) == 0
    _, experts = pm.moe_params(MIXTRAL, moe)
    assert experts == 5 * 12 * 3 * 4096 * 1000
    assert pm.expert_state_bytes(MIXTRAL, moe, 4, shards=3) == pytest.approx(experts / 4 / 3 * 16)
    with pytest.raises(ValueError, match=r"ep\(5\) must divide n_experts\(12\)"):
        pm.expert_state_bytes(MIXTRAL, moe, 5)


def test_the_active_shape_runs_the_active_parameters():
    act = pm.active_shape(MIXTRAL, MIXTRAL_MOE)
    assert act.d_ff == 2 * 14336
    assert act.params + 32 * 4096 * 8 == pm.moe_active_params(MIXTRAL, MIXTRAL_MOE)   # + the routers
    half = pm.MoE(n_experts=16, top_k=4, d_ff_expert=1000, moe_layers=8, shared_experts=1)   # every 4th layer MoE
    assert pm.active_shape(MIXTRAL, half).d_ff == round((24 * 14336 + 8 * 5 * 1000) / 32)


def test_expert_parallel_plan():
    """Mixtral 8x7B on 16 H100: the all-to-alls are the only difference ep makes to the step; state is the same."""
    c = pl.Cluster(pl.H100, 8, 2, NVLINK_H100, IB_NDR)
    kw = dict(seq_len=4096, checkpointing="full")
    one, eight = (pd.plan(MIXTRAL, c, 4, pd.Dims(ep=ep, moe=MIXTRAL_MOE), **kw) for ep in (1, 8))
    tok = 4 * 4096
    assert eight.a2a_bytes == pytest.approx(32 * 4 * tok * 2 * 4096 * 2 * 7 / 8 * 6 / 4, rel=1e-12)   # 6 with AC
    assert one.a2a_bytes == 0 and one.parts["expert all-to-all"] == 0
    assert eight.step_s - one.step_s == pytest.approx(eight.parts["expert all-to-all"], rel=1e-9)
    assert eight.stage.state == one.stage.state
    gathered = 2 * 2 * (8 / 8 - 8 / 1) * 3 * 4096 * 14336          # two layers: 1 expert a rank instead of 8
    assert eight.total - one.total == pytest.approx(gathered, rel=1e-9)
    assert eight.mfu == pytest.approx(eight.tokens_per_s_per_gpu * pm.moe_flops_per_token(MIXTRAL, MIXTRAL_MOE, 4096)
                                      / pl.H100.peak_flops, rel=1e-12)
    state = pm.expert_state_bytes(MIXTRAL, MIXTRAL_MOE, 8, shards=2)   # E/ep experts, FSDP over the other 2
    assert one.total > state > 0


# -- bad configurations ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    ({"pp": 0}, r"'pp': 0.*ints >= 1"),
    ({"cp": 2.0}, r"'cp': 2.0"),
    ({"schedule": "zero-bubble"}, r"schedule='zero-bubble' must be one of \('gpipe', '1f1b', 'interleaved'\)"),
    ({"schedule": "interleaved"}, r"needs virtual_stages >= 2"),
    ({"virtual_stages": 2}, r"schedule='1f1b' with virtual_stages=2"),
    ({"pp": 4, "micro_batches": 6, "schedule": "interleaved", "virtual_stages": 2},
     r"micro_batches\(6\) must be a multiple of pp\(4\)"),
    ({"ep": 3, "moe": MIXTRAL_MOE}, r"ep=3 needs a MoE whose n_experts divides"),
    ({"ep": 2}, r"ep=2 needs a MoE"),
    ({"moe": {"n_experts": 8}}, r"must be a planner_moe.MoE"),
])
def test_bad_dims_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        pd.Dims(**kw)


def test_bad_moe_and_plans_are_refused_by_name():
    with pytest.raises(ValueError, match=r"top_k\(9\) must be <= n_experts\(8\)"):
        pm.MoE(8, 9, 100, 2)
    with pytest.raises(ValueError, match=r"world\(8\) must divide by tp\(1\) x cp\(3\) x pp\(1\)"):
        pd.plan(pl.LLAMA3_8B, TT(1), 1, pd.Dims(cp=3), seq_len=6144)
    with pytest.raises(ValueError, match=r"batch\(6\) by micro_batches\(4\)"):
        pd.plan(pl.LLAMA3_8B, TT(1), 6, pd.Dims(pp=2, micro_batches=4))
    with pytest.raises(ValueError, match=r"seq_len\(8190\) by 2 x cp"):
        pd.plan(pl.LLAMA3_8B, TT(1), 1, pd.Dims(cp=2), seq_len=8190)
    with pytest.raises(ValueError, match=r"ep\(4\) must divide dp\(2\) x cp\(1\)"):
        pd.plan(MIXTRAL, TT(1), 1, pd.Dims(ep=4, moe=MIXTRAL_MOE), tp=4)
    with pytest.raises(ValueError, match=r"moe_layers\(33\) must be <= n_layers\(32\)"):
        pm.active_shape(MIXTRAL, pm.MoE(8, 2, 14336, 33))
    with pytest.raises(ValueError, match=r"must fill whole nodes of 8"):
        pd.plan(pl.LLAMA3_70B, TT(3), 4, pd.Dims(pp=2, micro_batches=4), tp=4)


# -- the published runs -----------------------------------------------------------------------------------------
#: rows the planner misses by more than 20%: the context-parallel rows of the benchmark past cp 2 on one node
#: and the 256K row of the 4-D run, faster by 21-36% in the plan. The published step time grows faster with cp
#: than attention's FLOPs do (8B: +4.5 s from cp 1 to 2, +17.7 s from 2 to 4 at the same s/cp and kernel
#: shapes); nothing the planner models (the all-gather, the ring, merges, kernels) grows that way. Kept, not hidden.
KNOWN_MISSES = {"torchtitan 8B, 8 H100, CP4, 128K", "torchtitan 8B, 8 H100, CP8, 256K",
                "torchtitan 405B, 512 H100, PP8, CP8, 256K"}
#: held-out Megatron-Core rows missed: the 405B's plan is slower (0.70): its TP collectives are charged exposed
#: (Megatron-Core overlaps them) and the CP ring's small cross-node messages ride NCCL's collective ramp
KNOWN_HELD_OUT_MISSES = {"Megatron-Bridge Llama-3.1-405B, 1024 H100, TP8 PP8 VP8 CP2"}


def test_published_pipeline_and_context_parallel_runs(capsys):
    rows = runs.compare(runs.DIMS_VALIDATION)
    with capsys.disabled():
        print("\n" + runs.table(rows, "PIPELINE / CONTEXT PARALLEL (no constant fitted to these runs)"))
    assert len({r.dims.schedule for r in runs.DIMS_VALIDATION}) == 2 and len(rows) >= 3
    assert all(r.title for r in runs.DIMS_VALIDATION)
    missed = {r["run"] for r in rows if not 0.8 <= r["ratio"] <= 1.2}
    assert missed == KNOWN_MISSES, {r["run"]: round(r["ratio"], 3) for r in rows}
    for r in rows:
        if "PP8" in r["run"] and "CP" not in r["run"] or "CP1," in r["run"]:
            assert 0.8 <= r["ratio"] <= 1.2, r                       # every pipeline-only row
        assert 0.8 <= r["predicted_gib"] / r["memory_gib"] <= 1.2, r  # memory, every row
    # interleaving's gain: published 1.28x, the bubble alone gives (1 - 7/23) / (1 - 7/15)
    one, inter = rows[0], rows[1]
    assert inter["predicted"] / one["predicted"] == pytest.approx(inter["published"] / one["published"], rel=0.05)


def test_held_out_megatron_runs(capsys):
    """Megatron-Core runs with CP and interleaved pipelines, priced after the CP terms were last changed."""
    rows = runs.compare(runs.DIMS_HELD_OUT)
    with capsys.disabled():
        print("\n" + runs.table(rows, "HELD OUT: MEGATRON-CORE, DGX-H100 (priced after the model was last changed)"))
    assert {r.dims.cp_rotate for r in runs.DIMS_HELD_OUT} == {"ring"} and not any(r.dims.repeat_kv
                                                                                  for r in runs.DIMS_HELD_OUT)
    assert sum(r.dims.cp > 1 for r in runs.DIMS_HELD_OUT) >= 3 and all(r.dims.schedule == "interleaved"
                                                                        for r in runs.DIMS_HELD_OUT[1:])
    assert any(r.dims.ep > 1 and r.dims.moe for r in runs.DIMS_HELD_OUT)          # expert parallel, published
    missed = {r["run"] for r in rows if not 0.8 <= r["ratio"] <= 1.2}
    assert missed == KNOWN_HELD_OUT_MISSES, {r["run"]: round(r["ratio"], 3) for r in rows}
    # every held-out row: global batch / (micro-batch 1 x dp) micro-batches, the run's GPUs all used
    for run in runs.DIMS_HELD_OUT:
        p = run.plan()
        assert p.tokens_per_step * run.cluster.world == pytest.approx(
            run.batch * run.seq_len * run.cluster.world / (run.tp * run.dims.cp * run.dims.pp))
        assert run.batch == run.dims.micro_batches and run.title
        assert p.total <= run.cluster.gpu.memory_bytes, (run.name, p.total / GiB)   # the run fit on its GPUs


def test_megatrons_flop_count_by_hand():
    """Megatron-LM's count (MCore v0.9), Mixtral 8x7B at 4,096 tokens: 12·L·h²·[(1 + 8/32 + 4096/4096)
    + 14336/4096 · 2 · 3/2 + 32000/(2·32·4096)], and a dense 4K-vocabulary toy with a plain MLP at 17 tokens."""
    mix = 12 * 32 * 4096**2 * ((1 + 8 / 32 + 1) + 3.5 * 2 * 1.5 + 32000 / (2 * 32 * 4096))
    assert runs.megatron_flops_per_token(MIXTRAL, 4096, top_k=2) == pytest.approx(mix, rel=1e-12)
    toy = pl.ModelShape("toy", 3, 256, 4, 2, 1024, 4096, 64, gated_mlp=False)
    assert runs.megatron_flops_per_token(toy, 17) == pytest.approx(
        12 * 3 * 256**2 * ((1 + 2 / 4 + 17 / 256) + 4 + 4096 / (2 * 3 * 256)), rel=1e-12)
    mixtral_row = [r for r in runs.DIMS_HELD_OUT if r.dims.moe][0]
    assert mixtral_row.tokens_per_s == round(468e12 / mix) == 5643


def test_dims_rows_are_plain_and_cite_their_table():
    assert doctest.testmod(runs).failed == 0
    rows = runs.dims_rows()
    assert len(rows) == len(runs.DIMS_VALIDATION)
    for r in rows:
        assert {type(v) for v in r.values()} <= {str, int, float}
        assert "llama3_h100_202412_torchtitan.md" in r["source"] and "table" in r["source"]
        assert r["ratio"] == pytest.approx(r["predicted"] / r["published"])
    assert rows[0]["bubble"] == pytest.approx(7 / 15) and rows[1]["bubble"] == pytest.approx(7 / 23)


def test_the_plans_optimizer_field_is_the_once_per_step_part():
    """planner.plan's ``optimizer_s`` (what planner_dims needs to run m micro-batches through one optimizer step):
    one more micro-batch adds compute, never optimizer time."""
    for run in runs.CALIBRATION + runs.VALIDATION[:5]:
        one, two = (dataclasses.replace(run, grad_accum=g).plan() for g in (1, 2))
        micro = two.compute_s - one.compute_s
        assert one.optimizer_s == two.optimizer_s > 0
        assert one.compute_s - micro == pytest.approx(one.optimizer_s, rel=1e-9)
