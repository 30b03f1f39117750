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
