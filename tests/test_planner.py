"""The planner at real scale, against figures computed by hand (in the comments) and published parameter counts."""
import math

import pytest

from course_lib.maths import planner
from course_lib.maths.planner import (A100_40GB, GPT3_175B, H100, IB_HDR, LLAMA3_8B, LLAMA3_70B, LLAMA_65B,
                                      NVLINK_H100, Cluster, GiB, ModelShape, plan)

PSI_8B = 8_030_261_248      # Meta's published Llama-3-8B count
NODE = Cluster(H100, 8, 1)


@pytest.mark.parametrize("model, params", [
    (LLAMA3_8B, PSI_8B),
    (LLAMA3_70B, 70_553_706_496),
    # 80 x (4·8192² + 3·8192·22016 + 2·8192) + 2·32000·8192 + 8192
    (LLAMA_65B, 65_285_660_672),
    # 96 x (12·12288² + 2·12288) + 50257·12288 + 12288 (tied head, no biases / position embedding)
    (GPT3_175B, 174_566_105_088),
])
def test_parameter_counts(model, params):
    assert model.params == params


def test_activation_bytes_per_token_and_layer():
    # Llama-3-8B: 12·4096 + 4·1024 + 6·14336 = 139,264 bytes; GPT-3: 32·d (Korthikanti's 34·d minus dropout masks)
    assert LLAMA3_8B.activation_bytes_per_token_layer() == 139_264
    assert GPT3_175B.activation_bytes_per_token_layer() == 32 * 12288


def test_fsdp_memory_by_hand():
    p = plan(LLAMA3_8B, NODE, "fsdp", 1, seq_len=8192)
    assert p.state == 16 * PSI_8B / 8 == 16_060_522_496           # 16Ψ/N
    # 32 layers x 139,264 B x 8192 tokens + the loss 14 x 128,256 x 8192 (bf16 logits 2, fp32 log-probs 4 and
    # two fp32 gradients 8) + 1 GiB of reserve
    assert p.activations == 32 * 139_264 * 8192 + 14 * 128_256 * 8192 + GiB == 52_290_387_968
    # two biggest units (head+norm 525,340,672; embedding 525,336,576) in bf16 + the biggest's fp32 gradient
    assert p.buffers == 2 * (525_340_672 + 525_336_576) + 4 * 525_340_672 == 4_202_717_184
    assert p.total == 16_060_522_496 + 52_290_387_968 + 4_202_717_184
    assert p.fits                                                  # 67.6 GiB of 80 GiB
    assert not plan(LLAMA3_8B, NODE, "fsdp", 2, seq_len=8192).fits  # torchtitan's batch 2 needs checkpointing


def test_full_checkpointing_by_hand():
    p = plan(LLAMA3_8B, NODE, "fsdp", 1, seq_len=8192, checkpointing="full")
    # each layer keeps its input (2·4096 B/token), one layer is rebuilt at a time, the loss as before
    assert p.activations == 32 * 2 * 4096 * 8192 + 139_264 * 8192 + 14 * 128_256 * 8192 + GiB == 19_071_500_288
    assert p.fits
    # the recomputed forward: every block's matmuls once more (2 x their parameters) and attention's 2·s·d·L;
    # the head is not recomputed
    blocks = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert p.hardware_flops_per_token == p.model_flops_per_token + 2 * blocks + 6 * 32 * 4096 * 8192
    assert p.hfu / p.mfu == pytest.approx(p.hardware_flops_per_token / p.model_flops_per_token)


@pytest.mark.parametrize("strategy, per_psi", [("dp", 16), ("zero1", 4 + 12 / 8), ("zero2", 2 + 14 / 8),
                                               ("zero3", 2), ("fsdp", 2)])
def test_state_by_strategy_mixed_precision(strategy, per_psi):
    assert plan(LLAMA3_8B, NODE, strategy, 1).state == pytest.approx(per_psi * PSI_8B)


def test_hsdp_shards_over_one_node_only():
    c = Cluster(H100, 8, 8)                                        # 64 GPUs, replicate = 8 nodes by default
    p = plan(LLAMA3_70B, c, "hsdp", 1, seq_len=4096, checkpointing="full")
    assert p.replicate == 8 and p.state == 16 * LLAMA3_70B.params / 8
    assert not p.fits                                              # 141 GB of state per GPU
    two = plan(LLAMA3_70B, c, "hsdp", 1, seq_len=4096, checkpointing="full", replicate=2)
    assert two.state == 16 * LLAMA3_70B.params / 32 and two.fits


def test_communication_by_hand():
    p = plan(LLAMA3_8B, NODE, "fsdp", 1, seq_len=8192)
    alpha = 3 * 34 * 7 * NVLINK_H100.hop_latency_s                 # 34 units, 3 ops each, 7 ring steps
    # each op at the bus bandwidth its message reaches: 0.80 x 450 GB/s x m / (m + 4 MiB), m = one unit's payload
    units = [sum(math.prod(s) for s in u) for u in LLAMA3_8B.units()]
    busbw = lambda m: 450e9 * 0.80 * m / (m + 4 * 2**20)  # noqa: E731
    want = sum(7 / 8 * (2 * u * 2 + u * 4) / busbw(u * 2) for u in units)   # bf16 gathers x2: busbw at 2u bytes
    assert p.comm_s == pytest.approx(alpha + want, rel=0.02)       # the reduce-scatter's fp32 message is 4u: ~1%
    assert p.comm_s > (3 * 7 / 8 * PSI_8B * 2 + 0) / 450e9         # slower than the datasheet ring
    assert p.compute_bound and p.exposed_comm_s < p.comm_s


def test_cross_node_rings_use_the_nodes_network():
    c = Cluster(A100_40GB, 8, 4, intra=planner.NVLINK_A100, inter=IB_HDR)
    assert c.alpha_beta(8).beta_s_per_byte == pytest.approx(1 / 300e9)         # NVLink inside a node
    assert c.alpha_beta(32).beta_s_per_byte == pytest.approx(1 / 200e9)        # 8 x HDR per node
    assert c.alpha_beta(4, hybrid_replicate=True).beta_s_per_byte == pytest.approx(8 / 200e9)


def test_articles_memory_claims_count_parameters_only():
    # "LLaMA-65B with FSDP on 64 devices: ~4 GB per device" is 4 bytes x Ψ / 64: fp32 weights alone
    p = plan(LLAMA_65B, Cluster(A100_40GB, 8, 8), "fsdp", 1, checkpointing="full")
    assert 4 * LLAMA_65B.params / 64 / 1e9 == pytest.approx(4.08, abs=0.01)
    assert p.state / (4 * LLAMA_65B.params / 64) == 4                           # Adam + grads: 4x that
    assert p.total > 4 * (4 * LLAMA_65B.params / 64)


def test_more_batch_is_more_compute_bound():
    slow = Cluster(H100, 1, 8, inter=planner.ETH_100G)
    small, big = plan(LLAMA3_8B, slow, "fsdp", 1), plan(LLAMA3_8B, slow, "fsdp", 64, checkpointing="full")
    assert not small.compute_bound and big.compute_bound
    assert big.mfu > small.mfu


def test_validation_names_the_values():
    with pytest.raises(ValueError, match=r"n_heads\(32\).*n_kv_heads\(5\)"):
        ModelShape("x", 2, 4096, 32, 5, 100, 100, 100)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Cluster(H100, 0)
    with pytest.raises(ValueError, match="batch=0"):
        plan(LLAMA3_8B, NODE, "fsdp", 0)
    with pytest.raises(ValueError, match="checkpointing='some'"):
        plan(LLAMA3_8B, NODE, "fsdp", 1, checkpointing="some")
    with pytest.raises(ValueError, match=r"replicate\(3\).*n\(8\)"):
        plan(LLAMA3_8B, NODE, "hsdp", 1, replicate=3)
    with pytest.raises(ValueError, match="strategy='tp'"):
        plan(LLAMA3_8B, NODE, "tp", 1)


def test_frozen():
    with pytest.raises(Exception):
        LLAMA3_8B.d_model = 1
    assert math.isclose(plan(LLAMA3_8B, NODE, "fsdp", 2).tokens_per_s_per_gpu * plan(LLAMA3_8B, NODE, "fsdp", 2).step_s,
                        2 * 8192)


# -- the per-operation model and its knobs ------------------------------------------------------------------
TT = Cluster(planner.H100_TT500W, 8, 1)


def test_breakdown_adds_up_to_the_step():
    p = plan(LLAMA3_8B, TT, "fsdp", 2, seq_len=8192, checkpointing="selective")
    assert tuple(p.parts) == planner.BREAKDOWN
    assert sum(p.parts.values()) == pytest.approx(p.step_s)
    assert p.parts["recompute"] > 0 and p.parts["attention"] > 0 and p.parts["memory-bound"] > 0


def test_checkpointing_trades_memory_for_time():
    none, sel, full = (plan(LLAMA3_8B, TT, "fsdp", 1, seq_len=8192, checkpointing=ac)
                       for ac in ("none", "selective", "full"))
    assert none.activations > sel.activations > full.activations
    assert none.step_s < sel.step_s < full.step_s
    assert none.hfu == pytest.approx(none.mfu) and full.hfu > sel.hfu > sel.mfu


def test_selective_recomputes_every_second_matmul_of_a_block():
    from course_lib.maths import planner_work as work
    d, kv, f = 4096, 1024, 14336     # Llama q, k, v, o, w1, w3, w2: k, o and w3 are recomputed
    assert work.recomputed_matmul_fraction(LLAMA3_8B, "selective") == pytest.approx(
        (d * kv + d * d + d * f) / (2 * d * d + 2 * d * kv + 3 * d * f))


def test_compile_and_float8_speed_up_only_what_they_touch():
    eager = plan(LLAMA3_8B, TT, "fsdp", 2, seq_len=8192, checkpointing="selective")
    comp = plan(LLAMA3_8B, TT, "fsdp", 2, seq_len=8192, checkpointing="selective", compile=True)
    fp8 = plan(LLAMA3_8B, TT, "fsdp", 2, seq_len=8192, checkpointing="selective", compile=True, float8=True)
    assert comp.parts["memory-bound"] < eager.parts["memory-bound"]
    assert comp.parts["matmul"] == pytest.approx(eager.parts["matmul"])
    assert fp8.parts["matmul"] < comp.parts["matmul"] and fp8.parts["attention"] == pytest.approx(comp.parts["attention"])
    assert fp8.parts["memory-bound"] > comp.parts["memory-bound"]          # the scaling casts cost bytes


def test_small_messages_are_latency_bound():
    link = planner.NVLINK_H100
    assert link.bus_fraction_at(64 * 2**20) > 0.9 * link.bus_fraction
    assert link.bus_fraction_at(64 * 2**10) < 0.02 * link.bus_fraction


def test_tensor_parallel_runs_per_layer_collectives_on_nvlink():
    big = Cluster(H100, 8, 4)
    fsdp = plan(LLAMA3_70B, big, "fsdp", 1, seq_len=4096, checkpointing="full")
    tp = plan(LLAMA3_70B, big, "fsdp", 4, seq_len=4096, checkpointing="full", tp=4)
    assert "tensor parallel (every layer)" in tp.comm_by_op and tp.tp == 4
    assert tp.state == pytest.approx(fsdp.state, rel=1e-6)                 # 16Ψ over all 32 GPUs either way
    assert tp.tokens_per_step == fsdp.tokens_per_step                      # 4 sequences over a TP group of 4


def test_fsdp_stops_scaling_when_the_batch_per_gpu_is_small():
    slow = Cluster(H100, 8, 16, inter=planner.ETH_100G)
    small, big = plan(LLAMA3_8B, slow, "fsdp", 1, seq_len=2048), plan(LLAMA3_8B, slow, "fsdp", 16, seq_len=2048)
    assert small.parts["exposed comm"] > 0.5 * small.step_s
    assert big.mfu > 1.5 * small.mfu


def test_gradient_accumulation_multiplies_the_micro_batch():
    one = plan(LLAMA3_8B, TT, "fsdp", 1, seq_len=8192, checkpointing="full")
    four = plan(LLAMA3_8B, TT, "fsdp", 1, seq_len=8192, checkpointing="full", grad_accum=4)
    assert four.tokens_per_step == 4 * one.tokens_per_step and four.total == one.total
    assert four.step_s == pytest.approx(4 * one.step_s, rel=0.02)


@pytest.mark.parametrize("kwargs, says", [
    (dict(float8=True, cluster=Cluster(A100_40GB, 8, 1)), r"float8=True needs fp8 tensor cores; A100-SXM4-40GB"),
    (dict(tp=3), r"tp\(3\) must divide gpus_per_node\(8\).*n_kv_heads\(8\)"),
    (dict(loss="int8"), r"loss='int8' must be one of \['bf16', 'chunked', 'fp32', 'fused'\]"),
    (dict(compute_efficiency=0.8, compile=True), r"compute_efficiency=0.8 is the one-number model.*compile=True"),
    (dict(grad_accum=0), r"grad_accum=0 must be an int >= 1"),
    (dict(attention="xformers"), r"attention='xformers' must be one of \['cudnn', 'flash2', 'triton'\]"),
])
def test_bad_combinations_name_the_values(kwargs, says):
    cluster, strategy = kwargs.pop("cluster", TT), kwargs.pop("strategy", "fsdp")
    with pytest.raises(ValueError, match=says):
        plan(LLAMA3_8B, cluster, strategy, 1, **kwargs)


SLOW = Cluster(H100, 8, 2, inter=planner.ETH_100G)   # two nodes on 100 Gb/s: communication that shows


def test_dp_and_zero1_sync_once_per_step_under_accumulation():
    """DDP's no_sync and ZeRO-1 reduce the accumulated gradient once per step (ZeRO-1 gathers once too);
    FSDP reduce-scatters and gathers on every micro-batch."""
    for strategy, per_micro in (("dp", False), ("zero1", False), ("zero2", True), ("fsdp", True)):
        one = plan(LLAMA3_8B, SLOW, strategy, 1, seq_len=2048, checkpointing="full")
        four = plan(LLAMA3_8B, SLOW, strategy, 1, seq_len=2048, checkpointing="full", grad_accum=4)
        assert four.comm_s == pytest.approx((4 if per_micro else 1) * one.comm_s), strategy
        assert four.parts["exposed comm"] == pytest.approx((4 if per_micro else 1) * one.parts["exposed comm"])
        assert four.parts["matmul"] == pytest.approx(4 * one.parts["matmul"])


def test_zero1_and_dp_compose_with_tensor_parallel():
    """Megatron-LM runs its distributed optimizer (ZeRO-1) beside TP: each TP rank holds 1/tp of the model,
    and ZeRO-1 shards that slice's optimizer state over the dp = world / tp data-parallel ranks."""
    z1 = plan(LLAMA3_8B, NODE, "zero1", 2, seq_len=4096, checkpointing="full", tp=2)
    psi = math.ceil(LLAMA3_8B.params / 2)
    assert z1.params + z1.grads == pytest.approx(4 * psi) and z1.optimizer == pytest.approx(12 * psi / 4)
    assert "tensor parallel (every layer)" in z1.comm_by_op
    dp = plan(LLAMA3_8B, NODE, "dp", 2, seq_len=4096, checkpointing="full", tp=2)
    assert dp.state == pytest.approx(16 * psi)


def test_the_loss_is_priced_as_it_is_written():
    """fp32 logits (torchtitan, course_lib.train) keep 14 B per token and vocabulary entry, eager bf16 8, a fused
    cross-entropy (XLA, Inductor) 6; HBM traffic 40 / 16 / 8 B."""
    m = planner.course_gpt(type("C", (), dict(n_layers=12, d_model=1024, n_heads=8, d_ff=4096, vocab_size=32768,
                                             seq_len=1024))())
    one = Cluster(planner.H200, 1)
    p = {k: plan(m, one, "fsdp", 16, loss=k, optimizer_bytes=28) for k in ("fp32", "bf16", "fused")}
    tok, V = 16 * 1024, 32768
    assert p["fp32"].activations - p["bf16"].activations == pytest.approx(6 * V * tok)     # (14 - 8) B x V x tok
    assert p["bf16"].activations - p["fused"].activations == pytest.approx(2 * V * tok)
    assert p["fp32"].step_s > p["bf16"].step_s > p["fused"].step_s
    assert p["fp32"].allocated == pytest.approx(p["fp32"].total - GiB)       # the 1 GiB reserve is not a tensor


def test_cudnn_attention_is_faster_on_hopper_only():
    h = plan(LLAMA3_8B, NODE, "fsdp", 1, seq_len=8192, checkpointing="selective")
    hc = plan(LLAMA3_8B, NODE, "fsdp", 1, seq_len=8192, checkpointing="selective", attention="cudnn")
    assert hc.parts["attention"] == pytest.approx(h.parts["attention"] * 350 / 480)
    a100 = Cluster(planner.A100_80GB, 8, 1)
    assert plan(LLAMA3_8B, a100, "fsdp", 1, attention="cudnn").step_s == plan(LLAMA3_8B, a100, "fsdp", 1).step_s


def test_course_gpt_shape_counts_the_course_models_parameters():
    from course_lib.models.config import GPTConfig, param_count
    cfg = GPTConfig(vocab_size=32768, seq_len=1024, d_model=1024, n_heads=8, n_layers=12, d_ff=4096)
    shape = planner.course_gpt(cfg)
    assert shape.params == pytest.approx(param_count(cfg), rel=0.01)       # biases, norms' bias, positions: < 1%
    assert (shape.norm, shape.rope, shape.gated_mlp, shape.fused_qkv) == ("layer", False, False, True)
    # the activation table, counted for this GPT's ops (torch eager, SDPA): ln1 in 2d, qkv in 2d, q k v 6d,
    # attention out 2d, ln2 in 2d, fc in 2d, GELU in 2f, proj in 2f = 16d + 4f bytes per token and layer
    assert shape.activation_bytes_per_token_layer() == 16 * 1024 + 4 * 4096


def test_frameworks_bench_prices_each_run_before_it_runs():
    """``bench frameworks`` prints the planner's plan of each run first: torch eager / compiled (fp32 loss, SDPA's
    kernel) and JAX (cuDNN attention, XLA's fused loss); a size it cannot read is named."""
    from course_lib.bench import frameworks as fw
    size = fw.parse_size("L12-d1024-b16-s1024")
    assert (size["n_heads"], size["d_ff"], size["batch"], size["seq_len"]) == (8, 4096, 16, 1024)
    gpu = fw.planner_gpu("NVIDIA H200")
    eager, comp, jx = (fw.predict(size, r, gpu, "cudnn") for r in ("torch", "compiled", "jax"))
    assert eager.step_s > comp.step_s > jx.step_s and jx.allocated < eager.allocated
    assert fw.planner_gpu("NVIDIA H100 80GB HBM3") is planner.H100 and fw.planner_gpu("Tesla T4") is None
    with pytest.raises(ValueError, match="L12-d1024-b16-s1024"):
        fw.parse_size("12x1024")
