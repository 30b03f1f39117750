"""Pipeline, context and expert parallelism: what each adds to a step, and a plan that composes them with FSDP x TP.

:func:`course_lib.maths.planner.plan` prices one data-parallel group (FSDP / HSDP / ZeRO, with TP inside a node).
:func:`plan` here splits the world further, as torchtitan's mesh does (``[pp, dp, cp, tp]``, ``tp`` innermost),
prices the busiest pipeline stage with ``planner.plan`` and adds the terms below. Every term is also a plain
function, tested against its hand formula (tests/test_planner_dims.py).

**Pipeline** (``pp`` stages, ``m`` micro-batches per step; GPipe: Huang et al., "GPipe: Efficient Training of Giant
Neural Networks using Pipeline Parallelism"; 1F1B and interleaved 1F1B: Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2):

* bubble -- the share of a step a rank idles while the pipeline fills and drains: ``(p-1)/(m+p-1)`` for GPipe and
  1F1B, ``(p-1)/(v·m+p-1)`` for interleaved 1F1B with ``v`` stages per rank; the step's compute is stretched by
  ``1/(1-bubble)``;
* point-to-point bytes -- each stage boundary carries one micro-batch's activation forward and its gradient
  backward: ``2·m·b·s·d·bytes`` per boundary and step (``/tp`` under sequence parallelism, ``x v`` per rank
  interleaved); the sends overlap compute except on the fill and drain path, ``2·(p·v-1)`` hops;
* stage memory -- activations of the micro-batches in flight: ``m`` for GPipe, ``min(m, p-rank)`` for 1F1B (the
  first stage holds ``p``), Megatron-LM's warm-up count ``2·(p-rank-1) + (v-1)·p + 1`` chunks for interleaved.
  torchtitan keeps a stage's parameters gathered for the whole step under PP (``reshard_after_forward=False``).

**Context parallel** (``cp`` ranks share each sequence; ring attention: Liu et al., "Ring Attention with
Blockwise Transformers for Near-Infinite Context"; PyTorch's ``context_parallel``, load-balanced): each rank keeps
``s/cp`` tokens, so matmuls, activations and pointwise work divide by ``cp``, while each of its tokens still
attends over the whole sequence. Per layer, every rank's K/V block reaches the other ``cp-1`` ranks:
``(cp-1)·2·b·(s/cp)·w·bytes`` forward, ``w`` the K/V width (``d_kv``, or ``d_model`` where the model repeats
K/V to every query head before attention, as torchtitan's Llama did at the end of 2024: ``Dims.repeat_kv``);
backward sends K/V again, and the dK/dV accumulators (``grad_bytes``: PyTorch keeps them in fp32) travel ``cp``
hops, the last one home. How K/V travel is ``Dims.cp_rotate``:

* ``"allgather"`` (PyTorch's default, and torchtitan's ``context_parallel_rotate_method`` at the benchmark's
  commit): one all-gather a pass, issued before the first block of attention and waited for at the second, so it
  hides under one block only;
* ``"ring"``: one block a step, each transfer under that step's block: ring attention proper (PyTorch's
  ``"alltoall"`` method, and Transformer Engine's ``"p2p"`` context parallel that Megatron-LM runs).

Backward, dK/dV go round the ring either way (PyTorch ``_templated_ring_attention_backward``: an all-to-all
rotater); each hop hides under a block's backward except the last, waited for after the loop. PyTorch merges
each step's partial output into an fp32 running output (``_SDPAMerger``, ``convert_to_f32=True``):
``MERGE_BYTES`` per element forward and ``GRAD_MERGE_BYTES`` per gradient element backward, memory-bound.

**Expert parallel** (the terms: :mod:`course_lib.maths.planner_moe`): a MoE model's compute and activations are
priced on its active shape; ``ep`` ranks, drawn from the data and context-parallel ranks as torchtitan draws them,
split each MoE layer's experts; dispatch and combine all-to-alls (``6`` a layer under full AC, else ``4``) sit on
the critical path (torchtitan's default dispatcher does not overlap them); every expert's state is sharded over
the whole stage either way (``E/ep`` experts, FSDP over the other ``dp·cp/ep``), and a rank gathers ``E/ep``
experts a layer where the active shape gathers ``top_k``. FSDP's traffic is priced on the active shape.

Validated against published runs that use them: :data:`course_lib.maths.planner_runs.DIMS_VALIDATION` (torchtitan)
and :data:`~course_lib.maths.planner_runs.DIMS_HELD_OUT` (Megatron-Core, Mixtral with EP 8 among them), printed by
:func:`course_lib.maths.planner_runs.dims_rows`. Not modelled: AsyncTP and Megatron-Core's overlapped TP
collectives, zero-bubble schedules, DualPipe, the host (:mod:`course_lib.maths.planner_host`: at these sizes a
step is tens of seconds of device time).

Longer than ~300 lines: :func:`plan` composes the pipeline, context and expert-parallel terms and their memory in one
step; each term is a small tested function above it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from course_lib.maths import memory
from course_lib.maths import planner as pl
from course_lib.maths import planner_moe as moe_
from course_lib.maths import planner_work as work
from course_lib.maths import strategy as strategies
from course_lib.maths.planner import positive_ints
from course_lib.maths.planner_moe import MoE

__all__ = ["SCHEDULES", "MoE", "Dims", "DimsPlan", "bubble_fraction", "busiest_rank_layers", "in_flight",
           "p2p_bytes_per_step", "ring_bytes_per_layer", "ring_exposed_s", "cp_exposed_s", "plan", "MERGE_BYTES",
           "GRAD_MERGE_BYTES", "CP_ROTATE"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
#: how context parallel moves K/V: all-gathered once (PyTorch's default ``set_rotate_method("allgather")``) or one
#: block a step round a ring (PyTorch's ``"alltoall"``, Transformer Engine's ``"p2p"``)
CP_ROTATE = ("allgather", "ring")
#: ring attention's fp32 merge per ring step, per element of the rank's output (PyTorch
#: ``torch/distributed/tensor/experimental/_attention.py`` at the end of 2024, ``_SDPAMerger._merge_one``): the
#: step's output cast to fp32 (r2 w4), ``out - block_out`` (r8 w4), the scaling (r4 w4), the update (r8 w4):
#: 38 bytes a merged element; half the steps merge half the rows and copy the whole output back with ``torch.cat``
#: (``_partial_update``: r4 w4), 19 + 8 = 27. Their mean, rounded:
MERGE_BYTES = 32
#: backward, per gradient element and step: dq, dk, dv (bf16, read 2) added into fp32 accumulators (r4 w4), and the
#: fp32 dK/dV concatenated to be sent on (r4 w4 for two of the three): 10 + 8·2/3, rounded
GRAD_MERGE_BYTES = 15


@dataclass(frozen=True)
class Dims:
    """The degrees beyond data and tensor parallel, and how the pipeline runs."""

    pp: int = 1                  #: pipeline stages (ranks)
    micro_batches: int = 1       #: per step; each DP rank's batch splits into this many
    schedule: str = "1f1b"       #: "gpipe", "1f1b" or "interleaved" (1F1B with ``virtual_stages`` per rank)
    virtual_stages: int = 1      #: stages per rank, v (interleaved only)
    cp: int = 1                  #: context-parallel ranks sharing each sequence
    ep: int = 1                  #: expert-parallel ranks sharing each MoE layer's experts
    moe: MoE | None = None       #: the model's mixture-of-experts layers (:class:`~course_lib.maths.planner_moe.MoE`)
    cp_rotate: str = "allgather"  #: how K/V reach the other cp ranks: "allgather" or "ring" (:data:`CP_ROTATE`)
    repeat_kv: bool = False      #: K/V repeated to every query head before attention: the ring moves d_model a token

    def __post_init__(self):
        if self.moe is not None and not isinstance(self.moe, MoE):
            raise ValueError(f"moe={self.moe!r} must be a planner_moe.MoE, e.g. MoE(n_experts=8, top_k=2, "
                             "d_ff_expert=14336, moe_layers=32)")
        positive_ints("Dims", pp=self.pp, micro_batches=self.micro_batches, virtual_stages=self.virtual_stages,
                      cp=self.cp, ep=self.ep)
        if self.cp_rotate not in CP_ROTATE:
            raise ValueError(f"cp_rotate={self.cp_rotate!r} must be one of {CP_ROTATE}: PyTorch's default "
                             "all-gathers K/V, a ring passes one block a step")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} must be one of {SCHEDULES}")
        if (self.schedule == "interleaved") != (self.virtual_stages > 1):
            raise ValueError(f"schedule={self.schedule!r} with virtual_stages={self.virtual_stages}: interleaved 1F1B "
                             "needs virtual_stages >= 2, the other schedules exactly 1; e.g. "
                             "Dims(pp=8, micro_batches=8, schedule='interleaved', virtual_stages=2)")
        if self.schedule == "interleaved" and self.micro_batches % self.pp:
            raise ValueError(f"interleaved 1F1B runs micro-batches in rounds of pp: micro_batches"
                             f"({self.micro_batches}) must be a multiple of pp({self.pp})")
        if self.ep > 1 and (self.moe is None or self.moe.n_experts % self.ep):
            raise ValueError(f"ep={self.ep} needs a MoE whose n_experts divides by it, got moe={self.moe}")


def bubble_fraction(d: Dims) -> float:
    """Share of a step a pipeline rank idles: ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(v·m+p-1)``."""
    p, m, v = d.pp, d.micro_batches, d.virtual_stages
    return (p - 1) / (v * m + p - 1)


def busiest_rank_layers(n_layers: int, d: Dims) -> int:
    """Layers on the rank that sets the pace: ``v`` stages of ``ceil(L/(p·v))`` layers."""
    if n_layers < d.pp * d.virtual_stages:
        raise ValueError(f"n_layers({n_layers}) < pp({d.pp}) x virtual_stages({d.virtual_stages}): a stage "
                         "needs at least one layer")
    return math.ceil(n_layers / (d.pp * d.virtual_stages)) * d.virtual_stages


def in_flight(d: Dims, rank: int = 0) -> float:
    """Micro-batches whose activations ``rank`` holds at its peak, in whole-rank units (all its layers):
    GPipe ``m``; 1F1B ``min(m, p-rank)``; interleaved ``min(v·m, 2(p-rank-1) + (v-1)·p + 1) / v`` (chunks of
    ``1/v`` of the rank's layers; Megatron-LM ``schedules.py``, the interleaved warm-up count)."""
    if not 0 <= rank < d.pp:
        raise ValueError(f"rank={rank} must be in [0, pp({d.pp}))")
    p, m, v = d.pp, d.micro_batches, d.virtual_stages
    if d.schedule == "gpipe":
        return float(m)
    if d.schedule == "1f1b":
        return float(min(m, p - rank))
    return min(v * m, 2 * (p - rank - 1) + (v - 1) * p + 1) / v


def p2p_bytes_per_step(d: Dims, micro_batch: int, seq_len: int, d_model: int, bytes_per: int = 2,
                       shards: int = 1) -> float:
    """Bytes one rank sends per step across its stage boundaries: ``2·m·b·s·d·bytes`` per boundary (forward the
    activation, backward its gradient), ``shards`` (TP x CP) GPUs each sending their slice, ``v`` boundaries a
    rank interleaved."""
    return 2 * d.micro_batches * micro_batch * seq_len * d_model * bytes_per / shards * d.virtual_stages


def ring_bytes_per_layer(cp: int, batch: int, seq_len: int, d_kv: int, bytes_per: int = 2,
                         grad_bytes: int = 4) -> tuple[float, float]:
    """``(forward, backward)`` bytes one rank sends per layer: ``(cp-1)`` K/V blocks of ``b·(s/cp)`` tokens
    ``d_kv`` wide; backward the K/V blocks again and ``cp`` hops of their dK/dV in ``grad_bytes`` (the last hop
    brings a rank's accumulated gradient home)."""
    if cp == 1:
        return 0, 0
    blk = batch * seq_len / cp * d_kv
    return (cp - 1) * 2 * blk * bytes_per, (cp - 1) * 2 * blk * bytes_per + cp * 2 * blk * grad_bytes


def ring_exposed_s(cp: int, step_bytes: float, bandwidth: float, block_s: float) -> float:
    """Seconds a layer's ring leaves exposed: each of ``cp-1`` steps sends ``step_bytes`` at ``bandwidth`` while
    one block of attention (``block_s``) runs."""
    return (cp - 1) * max(0.0, step_bytes / bandwidth - block_s) if cp > 1 else 0.0


def cp_exposed_s(cp: int, kv_step_bytes: float, grad_step_bytes: float, bandwidth: float, block_s: float,
                 rotate: str = "allgather", forward_passes: int = 1) -> tuple[float, float]:
    """``(forward, backward)`` seconds one layer's context parallel leaves exposed, ``block_s`` one block's
    forward attention (its backward 2.5x): K/V all-gathered under the first block (``"allgather"``) or passed one
    block a step (``"ring"``), ``forward_passes`` times (2 under full AC); backward K/V the same way under
    the backward's blocks, dK/dV round the ring, the last of ``cp`` hops waited for after the loop."""
    if cp == 1:
        return 0.0, 0.0
    if rotate not in CP_ROTATE:
        raise ValueError(f"rotate={rotate!r} must be one of {CP_ROTATE}")

    def kv(block):
        if rotate == "allgather":
            return max(0.0, (cp - 1) * kv_step_bytes / bandwidth - block)
        return ring_exposed_s(cp, kv_step_bytes, bandwidth, block)

    back = kv(2.5 * block_s) + ring_exposed_s(cp, grad_step_bytes, bandwidth, 2.5 * block_s) \
        + grad_step_bytes / bandwidth
    return forward_passes * kv(block_s), back


@dataclass(frozen=True)
class DimsPlan:
    """One step with PP / CP on top of FSDP x TP: per GPU, seconds and bytes."""

    stage: pl.Plan              #: the busiest stage's plan, one micro-batch of ``s/cp`` tokens per sequence
    dims: Dims
    step_s: float
    tokens_per_step: float      #: per GPU
    model_flops_per_token: float
    peak_flops: float
    bubble: float
    p2p_bytes: float            #: per GPU and step
    p2p_exposed_s: float
    ring_bytes: float           #: per GPU and step
    ring_exposed_s: float
    total_bytes: float          #: memory per GPU: the busiest rank's layers, the first stage's micro-batches in flight
    a2a_bytes: float = 0.0      #: expert parallel's all-to-all bytes per GPU and step
    parts: dict = field(default_factory=dict)   #: what the step is made of, seconds

    total = property(lambda self: self.total_bytes)
    tokens_per_s_per_gpu = property(lambda self: self.tokens_per_step / self.step_s)
    mfu = property(lambda self: self.tokens_per_s_per_gpu * self.model_flops_per_token / self.peak_flops)


def _stage_cluster(cluster, group):
    if group <= cluster.gpus_per_node:
        return dataclasses.replace(cluster, gpus_per_node=group, nodes=1)
    if group % cluster.gpus_per_node:
        raise ValueError(f"a stage's {group} GPUs (dp x cp x tp) must fill whole nodes of {cluster.gpus_per_node}")
    return dataclasses.replace(cluster, nodes=group // cluster.gpus_per_node)


def plan(model, cluster, batch: int, dims: Dims, *, seq_len: int | None = None, strategy: str = "fsdp",
         tp: int = 1, checkpointing: str = "none", **kw) -> DimsPlan:
    """One step of ``batch`` sequences per data-parallel rank, split into ``dims.micro_batches``, on a world of
    ``dp x cp x pp x tp`` GPUs. ``kw`` goes to :func:`course_lib.maths.planner.plan` (compile, float8, ...)."""
    s = seq_len or model.seq_len
    p, cp, m = dims.pp, dims.cp, dims.micro_batches
    if cluster.world % (tp * cp * p) or batch % m or s % (2 * cp):
        raise ValueError(f"world({cluster.world}) must divide by tp({tp}) x cp({cp}) x pp({p}), batch({batch}) by "
                         f"micro_batches({m}), seq_len({s}) by 2 x cp (load-balanced halves)")
    dp = cluster.world // (tp * cp * p)
    group = dp * cp * tp                                   # the GPUs of one stage (torchtitan: pp outermost)
    moe, ep = dims.moe, dims.ep
    if moe is not None and (dp * cp) % ep:
        raise ValueError(f"ep({ep}) must divide dp({dp}) x cp({cp}): expert-parallel ranks are drawn from the data "
                         "and context-parallel ranks (torchtitan)")
    layers = busiest_rank_layers(model.n_layers, dims)
    stage_model = dataclasses.replace(moe_.active_shape(model, moe) if moe else model, n_layers=layers)
    stage = pl.plan(stage_model, _stage_cluster(cluster, group), strategy, batch // m,
                    seq_len=s // cp, tp=tp, checkpointing=checkpointing, **kw)
    gpu, stretch = cluster.gpu, 1 / (1 - pl.IDLE_FRACTION)
    tp_s = stage.comm_by_op.get("tensor parallel (every layer)", 0.0)
    micro = stage.compute_s - stage.optimizer_s + tp_s    # one micro-batch on the busiest rank
    # -- context parallel: each token attends over s, not s/cp; the ring; the fp32 merges ------------------
    attn = stage.parts["attention"]                      # at s/cp: the kernel's blocks are s/cp long
    fwd_passes = 2 if checkpointing == "full" else 1      # full AC runs attention's forward (and its ring) again
    extra_attn = (cp - 1) * attn * (1 + (fwd_passes - 1) / 3.5)
    b, tok = batch // m, batch // m * s / cp
    kv_w = (model.d_model if dims.repeat_kv else model.d_kv) // tp      # K/V width a rank's attention sees
    f_bytes, b_bytes = ring_bytes_per_layer(cp, b, s, kv_w)
    ring_bytes = layers * (fwd_passes * f_bytes + b_bytes)
    ring_exp = merge_s = 0.0
    if cp > 1:
        across = cp * tp > cluster.gpus_per_node
        link = cluster.inter if across else cluster.intra
        kv_step = f_bytes / (cp - 1)                      # one rank's K/V block
        bw = (link.bandwidth_bytes_per_s / (cluster.gpus_per_node if across else 1)) * link.bus_fraction_at(
            kv_step)
        block = (attn + extra_attn) / layers / cp / (fwd_passes + 2.5)   # one ring step's attention, one pass
        ring_exp = layers * sum(cp_exposed_s(cp, kv_step, kv_step * 2, bw, block, dims.cp_rotate, fwd_passes))
        merged = (cp - 1) * tok / tp * layers
        merge_s = stretch * merged * (fwd_passes * MERGE_BYTES * model.d_model
                                      + GRAD_MERGE_BYTES * (model.d_model + 2 * kv_w * tp)) / gpu.stream_bytes_per_s
    # -- expert parallel: dispatch + combine on the critical path -------------------------------------------
    a2a = a2a_s = extra_experts = 0.0
    if moe is not None:
        moe_layers = moe.moe_layers * layers / model.n_layers          # this stage's share of the MoE layers
        a2a = moe_layers * moe_.all_to_all_bytes_per_layer(tok / tp, moe, model.d_model, ep) * (fwd_passes + 1) / 2
        if ep > 1:
            across = ep * tp > cluster.gpus_per_node
            link = cluster.inter if across else cluster.intra
            msg = a2a / moe_layers / (2 * fwd_passes + 2)
            bw = link.bandwidth_bytes_per_s / (cluster.gpus_per_node if across else 1) * link.bus_fraction_at(msg)
            a2a_s = a2a / bw + moe_layers * (2 * fwd_passes + 2) * (ep - 1) * link.hop_latency_s
        # a rank gathers E/ep experts of a layer, the active shape top_k (negative when E/ep < top_k)
        extra_experts = (moe.n_experts / ep - moe.top_k) * 3 * model.d_model * moe.d_ff_expert
    micro += extra_attn + merge_s + ring_exp + a2a_s
    # -- the pipeline ------------------------------------------------------------------------------------
    bubble = bubble_fraction(dims)
    p2p = p2p_bytes_per_step(dims, b, s, model.d_model, shards=tp * cp) if p > 1 else 0.0
    p2p_exp = 0.0
    if p > 1:
        across = group >= cluster.gpus_per_node
        link = cluster.inter if across else cluster.intra
        hop_bytes = p2p / (2 * m * dims.virtual_stages)
        bw = link.bandwidth_bytes_per_s / (cluster.gpus_per_node if across else 1) * link.bus_fraction_at(hop_bytes)
        p2p_exp = 2 * (p * dims.virtual_stages - 1) * (hop_bytes / bw + link.hop_latency_s)
    fsdp_exposed = stage.exposed_comm_s - tp_s             # under PP: gathered once, reduced once per step
    pipeline_s = m * micro / (1 - bubble)
    step = pipeline_s + fsdp_exposed + stage.optimizer_s + p2p_exp
    # -- memory at the first stage's peak -------------------------------------------------------------------
    layer_act = work.saved_bytes_per_token(stage_model, checkpointing) * tok / tp   # MoE: the active shape
    extra_flight = (in_flight(dims) - 1) * layers * layer_act
    # under PP torchtitan keeps an FSDP stage gathered (bf16) all step, and FSDP2, told not to reduce until the last
    # micro-batch, accumulates its unsharded gradient in the reduce dtype (FSDPParam.unsharded_accumulated_grad)
    sharded = strategies.get(strategy).params                # FSDP / HSDP: parameters sharded between uses
    held = (2 + kw.get("reduce_bytes", 4)) * stage_model.params / tp if p > 1 and sharded else stage.buffers
    idle_state = 0.0
    if moe is not None:   # the experts the active shape leaves out: their state, and what a rank gathers of them
        stage_moe = moe.moe_layers * layers / model.n_layers
        expert = 3 * model.d_model * moe.d_ff_expert * stage_moe / tp   # one expert of every MoE layer of the stage
        state = lambda experts, ranks: memory.state_bytes(strategy, round(experts * expert), ranks,  # noqa: E731
                                                          precision="mixed").total
        # E/ep experts a rank, the strategy sharding them over the other dp·cp/ep; the plan counted top_k over dp·cp
        idle_state = state(moe.n_experts // ep, dp * cp // ep) - state(moe.top_k, dp * cp)
        if sharded:   # PP: the stage's experts held gathered with their gradient; else two layers (bf16) at a time
            held += extra_experts / tp * ((2 + kw.get("reduce_bytes", 4)) * stage_moe if p > 1 else 2 * 2)
    total = stage.total - stage.buffers + held + extra_flight + idle_state
    parts = {"compute": m * (stage.compute_s - stage.optimizer_s), "context-parallel attention": m * extra_attn,
             "ring merge + exposed ring": m * (merge_s + ring_exp), "tensor parallel": m * tp_s,
             "bubble": pipeline_s - m * micro, "fsdp exposed": fsdp_exposed, "optimizer": stage.optimizer_s,
             "p2p exposed": p2p_exp, "expert all-to-all": m * a2a_s}
    mf = moe_.moe_flops_per_token(model, moe, s) if moe else model.model_flops_per_token(s)
    return DimsPlan(stage=stage, dims=dims, step_s=step, tokens_per_step=batch * s / (tp * cp * p),
                    model_flops_per_token=mf, peak_flops=gpu.peak_flops, bubble=bubble,
                    p2p_bytes=p2p, p2p_exposed_s=p2p_exp, ring_bytes=m * ring_bytes, ring_exposed_s=m * ring_exp,
                    total_bytes=total, a2a_bytes=m * a2a, parts=parts)
