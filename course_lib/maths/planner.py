"""The course at real scale: memory per GPU, step time and MFU of a real model on a published cluster.

``plan(model, cluster, strategy, batch)`` applies the course's formulas to shapes nobody can run in a lab:

* **memory per GPU** = model state (:func:`course_lib.maths.memory.state_bytes`, mixed precision + Adam:
  the ZeRO paper's ``K = 12``) + FSDP's gathered buffers (two units in flight, one unit's unsharded
  gradient) + **activations** (per token and layer, below) + the logits.
* **step time** = compute (FLOPs / (peak · ``compute_efficiency``)) and communication
  (:func:`course_lib.maths.costs.step_cost` through :class:`course_lib.maths.costs.AlphaBeta`, with the
  link each collective's group crosses), overlapped the way FSDP's prefetch overlaps them.
* **MFU** (model FLOPs utilisation) = tokens/s · model FLOPs per token / peak (Chowdhery et al., "PaLM:
  Scaling Language Modeling with Pathways", 2022, appendix B): ``6N + 12·L·d·s`` per token; recomputation
  is work the hardware does but the model does not count.

Activations per token and layer, bf16, with a fused (flash) attention that stores no ``s × s`` matrix and
no dropout: the block's saved inputs -- 2 norms, the qkv input, Q, K, V, the attention output, the MLP
input (``12d + 4·d_kv`` bytes) -- plus the MLP's hidden tensors (``6·d_ff`` for a gated SwiGLU MLP: gate,
up and their product; ``4·d_ff`` for GELU). For GPT-3 (``d_ff = 4d``) that is ``32·d``: the ``34·s·b·h``
of Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (MLSys 2023), less
its two dropout masks. Full checkpointing keeps each layer's input (``2d``) and rebuilds one layer at a
time in backward. The logits cost ``6·V`` bytes per token (bf16 output + fp32 copy for the loss).

Hardware figures are datasheet numbers: NVIDIA A100 and H100 Tensor Core GPU datasheets (dense bf16 312
and 989 TFLOP/s; NVLink 600 and 900 GB/s both directions together, so 300 and 450 GB/s each way); NVIDIA
DGX A100 / DGX H100 user guides (one 200 Gb/s HDR or 400 Gb/s NDR InfiniBand adapter per GPU). Latencies
(``hop_latency_s``) are assumptions of a few microseconds per ring step, not measurements.

Where this model is too optimistic: it assumes every FLOP runs at ``compute_efficiency`` of peak (a big
bf16 GEMM does ~80%; attention, norms, the 128K-entry softmax and the optimizer do not), a collective
reaches the link's datasheet bandwidth, and prefetch hides all communication that fits under compute.

Longer than ~300 lines: the published shapes and hardware sit beside the one function that uses them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from course_lib.maths import memory
from course_lib.maths import strategy as strategies
from course_lib.maths.costs import AlphaBeta, step_cost

__all__ = ["ModelShape", "GPU", "Link", "Cluster", "Plan", "plan", "CHECKPOINTING",
           "LLAMA3_8B", "LLAMA3_70B", "LLAMA_65B", "GPT3_175B", "A100_40GB", "A100_80GB", "H100",
           "NVLINK_A100", "NVLINK_H100", "IB_HDR", "IB_NDR", "ETH_100G", "ETH_10G", "PCIE4", "GiB"]

GiB = 1024 ** 3
CHECKPOINTING = ("none", "full")


def _positive_ints(obj, names):
    bad = {k: getattr(obj, k) for k in names
           if isinstance(getattr(obj, k), bool) or not isinstance(getattr(obj, k), int) or getattr(obj, k) < 1}
    if bad:
        raise ValueError(f"{type(obj).__name__} sizes must be positive ints, got {bad}")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (no biases; norms counted as one vector of ``d_model``)."""

    name: str
    n_layers: int        #: L
    d_model: int         #: d, the residual width
    n_heads: int         #: query heads
    n_kv_heads: int      #: key/value heads (grouped-query attention when < n_heads)
    d_ff: int            #: MLP hidden width
    vocab_size: int      #: V
    seq_len: int         #: s, the training context
    gated_mlp: bool = True         #: SwiGLU (3 matrices, Llama) or GELU (2 matrices, GPT)
    tied_embeddings: bool = False  #: the head reuses the input embedding (GPT-3) or has its own (Llama 3)

    def __post_init__(self):
        _positive_ints(self, ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"))
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"d_model({self.d_model}) must divide by n_heads({self.n_heads}) and n_heads by "
                             f"n_kv_heads({self.n_kv_heads}); e.g. d_model=4096, n_heads=32, n_kv_heads=8")

    @property
    def d_kv(self) -> int:   # width of K (and of V): n_kv_heads · head_dim
        return self.n_kv_heads * (self.d_model // self.n_heads)

    def layer_shapes(self) -> list[tuple[int, ...]]:
        d, kv, f = self.d_model, self.d_kv, self.d_ff
        mlp = [(f, d), (f, d), (d, f)] if self.gated_mlp else [(f, d), (d, f)]
        return [(d,), (d, d), (kv, d), (kv, d), (d, d), (d,)] + mlp

    def units(self) -> list[list[tuple[int, ...]]]:
        """FSDP units as :func:`course_lib.maths.costs.step_cost` wants them, wrapped as torchtitan wraps
        Llama: the embedding, each layer, then the final norm with the head (tied: the embedding owns both)."""
        d, emb = self.d_model, (self.vocab_size, self.d_model)
        layers = [self.layer_shapes() for _ in range(self.n_layers)]
        if self.tied_embeddings:
            return [[emb, (d,)]] + layers
        return [[emb]] + layers + [[(d,), emb]]

    params = property(lambda self: sum(math.prod(s) for u in self.units() for s in u))

    def model_flops_per_token(self, seq_len: int | None = None) -> float:
        """``6·N + 12·L·d·s`` (PaLM appendix B): matmuls fwd + bwd, and attention's two ``s × s`` products.
        ``N`` leaves out the input embedding, a lookup rather than a matmul."""
        s = seq_len or self.seq_len
        return 6 * (self.params - self.vocab_size * self.d_model * (not self.tied_embeddings)) \
            + 12 * self.n_layers * self.d_model * s

    def activation_bytes_per_token_layer(self) -> int:
        """Bytes one layer saves for backward per token, bf16, flash attention: ``12d + 4·d_kv + 6·d_ff``."""
        return 12 * self.d_model + 4 * self.d_kv + (6 if self.gated_mlp else 4) * self.d_ff


# -- hardware -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int      #: HBM per GPU
    peak_flops: float      #: dense bf16 FLOP/s, datasheet

    def __post_init__(self):
        if self.memory_bytes <= 0 or self.peak_flops <= 0:
            raise ValueError(f"GPU {self.name!r}: memory_bytes({self.memory_bytes}) and peak_flops"
                             f"({self.peak_flops}) must be > 0")


@dataclass(frozen=True)
class Link:
    """A link's bandwidth in one direction: per GPU for NVLink/PCIe inside a node, per node between nodes."""

    name: str
    bandwidth_bytes_per_s: float   #: per direction (per GPU inside a node, per node between nodes)
    hop_latency_s: float = 5e-6    #: per ring step (assumed); a ring over F ranks pays F - 1 of them

    def __post_init__(self):
        if self.bandwidth_bytes_per_s <= 0 or self.hop_latency_s < 0:
            raise ValueError(f"Link {self.name!r}: bandwidth_bytes_per_s({self.bandwidth_bytes_per_s}) must be > 0 "
                             f"and hop_latency_s({self.hop_latency_s}) >= 0")

    def alpha_beta(self, group: int) -> AlphaBeta:
        """The α-β model of one collective over a ring of ``group`` ranks on this link."""
        return AlphaBeta((group - 1) * self.hop_latency_s, 1.0 / self.bandwidth_bytes_per_s)


A100_40GB = GPU("A100-SXM4-40GB", 40 * GiB, 312e12)
A100_80GB = GPU("A100-SXM4-80GB", 80 * GiB, 312e12)
H100 = GPU("H100-SXM5-80GB", 80 * GiB, 989e12)
NVLINK_A100 = Link("NVLink 3 (A100)", 300e9, 2e-6)
NVLINK_H100 = Link("NVLink 4 (H100)", 450e9, 2e-6)
PCIE4 = Link("PCIe 4.0 x16", 32e9, 5e-6)
#: inter-node links are per *node*: a DGX A100 has 8 HDR adapters (8 x 200 Gb/s), a DGX H100 8 NDR (8 x 400 Gb/s)
IB_HDR = Link("InfiniBand 8 x HDR 200 Gb/s per node", 8 * 25e9, 5e-6)
IB_NDR = Link("InfiniBand 8 x NDR 400 Gb/s per node", 8 * 50e9, 5e-6)
ETH_100G = Link("Ethernet 100 Gb/s per node", 12.5e9, 10e-6)
ETH_10G = Link("Ethernet 10 Gb/s per node", 1.25e9, 20e-6)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs: ``intra`` links GPUs of a node, ``inter`` the nodes."""

    gpu: GPU
    gpus_per_node: int
    nodes: int = 1
    intra: Link = NVLINK_H100
    inter: Link = IB_NDR

    def __post_init__(self):
        _positive_ints(self, ("gpus_per_node", "nodes"))

    world = property(lambda self: self.gpus_per_node * self.nodes)

    def alpha_beta(self, group: int, hybrid_replicate: bool = False) -> AlphaBeta:
        """The α-β model of one ring collective over ``group`` GPUs.

        Inside a node (``group <= gpus_per_node``): the GPU's NVLink share. Across nodes, NCCL runs one ring
        per NIC, so a ring over every GPU moves at the node's whole ``inter`` bandwidth (capped by NVLink).
        HSDP's replicate all-reduces are ``gpus_per_node`` rings at once (one per shard index): each gets
        ``inter / gpus_per_node``.
        """
        if group <= self.gpus_per_node and not (hybrid_replicate and self.nodes > 1):
            return self.intra.alpha_beta(group)
        bw = self.inter.bandwidth_bytes_per_s / (self.gpus_per_node if hybrid_replicate else 1)
        bw = min(bw, self.intra.bandwidth_bytes_per_s)
        return AlphaBeta((group - 1) * self.inter.hop_latency_s, 1.0 / bw)


@dataclass(frozen=True)
class Plan:
    """Per GPU: memory (bytes), time (seconds) and throughput of one training step."""

    strategy: str
    world: int
    replicate: int
    batch: int                 #: sequences per GPU per step
    seq_len: int
    checkpointing: str
    params: float              #: model-state bytes: parameters ...
    grads: float               #: ... gradients ...
    optimizer: float           #: ... and Adam (fp32 master, m, v)
    buffers: float             #: FSDP's gathered units and unsharded gradient in flight
    activations: float         #: saved for backward (incl. the logits)
    memory_limit: float        #: the GPU's HBM
    compute_s: float           #: all FLOPs (recomputation included) at peak · efficiency
    comm_s: float              #: every collective, one after the other
    exposed_comm_s: float      #: the part of comm_s that compute does not hide
    model_flops_per_token: float
    hardware_flops_per_token: float   #: model FLOPs + the recomputed forward under full checkpointing
    peak_flops: float
    comm_by_op: dict = field(default_factory=dict)   #: op -> seconds

    state = property(lambda self: self.params + self.grads + self.optimizer)
    total = property(lambda self: self.state + self.buffers + self.activations)
    fits = property(lambda self: self.total <= self.memory_limit)
    step_s = property(lambda self: self.compute_s + self.exposed_comm_s)
    tokens_per_s_per_gpu = property(lambda self: self.batch * self.seq_len / self.step_s)

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.model_flops_per_token / self.peak_flops

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: like :attr:`mfu`, counting the recomputed forward too."""
        return self.tokens_per_s_per_gpu * self.hardware_flops_per_token / self.peak_flops

    @property
    def compute_bound(self) -> bool:
        """Compute time >= communication time: prefetch can hide all of it (scaling-book's B > C/W)."""
        return self.compute_s >= self.comm_s

    def summary(self) -> str:
        g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
        return (f"{self.strategy} on {self.world} GPUs, batch {self.batch} x {self.seq_len}, AC {self.checkpointing}: "
                f"{g(self.total)} GiB/GPU (state {g(self.state)}, buffers {g(self.buffers)}, activations "
                f"{g(self.activations)}) of {g(self.memory_limit)} -> {'fits' if self.fits else 'does NOT fit'}; "
                f"step {self.step_s:.3f} s (compute {self.compute_s:.3f}, comm {self.comm_s:.3f}, exposed "
                f"{self.exposed_comm_s:.3f}), {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {self.mfu:.0%}")


def plan(model: ModelShape, cluster: Cluster, strategy: str, batch: int, *, seq_len: int | None = None,
         checkpointing: str = "none", replicate: int | None = None, compute_efficiency: float = 0.8,
         reduce_bytes: int = 4, overlap: bool = True) -> Plan:
    """One training step of ``model`` on ``cluster`` with ``batch`` sequences per GPU.

    ``strategy``: ``"dp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"`` (= ``"zero3"``) or ``"hsdp"`` (``replicate``
    copies, default one per node, each sharded over ``F = world / replicate`` GPUs). Parameters are
    gathered in bf16, gradients reduced in ``reduce_bytes`` (4: fp32, torchtitan's default). A group spans
    nodes -- and then runs at ``cluster.inter``'s bandwidth -- when it is larger than a node (or, for HSDP's
    replicate all-reduce, whenever there are several nodes). ``overlap``: forward all-gathers hide under
    the forward, backward traffic under the backward (DP, FSDP, HSDP), except the first unit's gather and the
    last unit's reduce; ZeRO-1/2's parameter all-gather after the optimizer step hides under nothing.
    """
    row = strategies.get(strategy)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch={batch!r} must be an int >= 1 (sequences per GPU per step)")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} must be one of {CHECKPOINTING}")
    if not 0 < compute_efficiency <= 1:
        raise ValueError(f"compute_efficiency={compute_efficiency} must be in (0, 1]: a fraction of peak")
    n, s = cluster.world, seq_len or model.seq_len
    r = (replicate or cluster.nodes) if row.hybrid else (1 if replicate is None else replicate)
    strategies.sharding_factor(strategy, n, r)                    # validates r, names every factor
    st = memory.state_bytes(strategy, model.params, n, precision="mixed", replicate=r)   # 16Ψ/F for HSDP
    units = model.units()
    sizes = sorted(sum(math.prod(x) for x in u) for u in units)
    # two units gathered in bf16 (the running one and the prefetched one) + one unsharded gradient
    buffers = 2 * (sizes[-1] + sizes[-2]) + reduce_bytes * sizes[-1] if row.params else 0.0
    tokens = batch * s
    per_layer = model.activation_bytes_per_token_layer()
    if checkpointing == "none":
        act = model.n_layers * per_layer * tokens
    else:
        act = model.n_layers * 2 * model.d_model * tokens + per_layer * tokens
    act += 6 * model.vocab_size * tokens
    # compute: the model's FLOPs plus one more forward (a third of 6N) when every layer is recomputed
    mf = model.model_flops_per_token(s)
    hw = mf * (4 / 3 if checkpointing == "full" else 1.0)
    compute = tokens * hw / (cluster.gpu.peak_flops * compute_efficiency)
    # communication: the course's per-step cost, each op on the link its group crosses
    cost = step_cost(strategy, units, n, param_bytes=2, reduce_bytes=reduce_bytes, padding="none", replicate=r)
    by_op, phase_s = {}, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for o in cost.ops:
        ab = cluster.alpha_beta(o.group_size, hybrid_replicate=row.hybrid and o.op == "all_reduce")
        t = o.count * ab.alpha_s + ab.beta_s_per_byte * o.wire_bytes
        by_op[f"{o.op} ({o.phase})"] = by_op.get(f"{o.op} ({o.phase})", 0.0) + t
        phase_s[o.phase] += t
    comm = sum(phase_s.values())
    if not overlap:
        exposed = comm
    else:
        k = len(units)
        passes = 4 if checkpointing == "full" else 3      # forward = 1 pass; backward = 2 (+1 recompute)
        fwd_c, bwd_c = compute / passes, compute * (passes - 1) / passes
        edge = (phase_s["forward"] + phase_s["backward"]) / k if row.params else 0.0   # first gather, last reduce
        exposed = (max(0.0, phase_s["forward"] - fwd_c) + max(0.0, phase_s["backward"] - bwd_c)
                   + phase_s["optimizer"] + min(edge, comm))
    return Plan(strategy, n, r, batch, s, checkpointing, st.params, st.grads, st.optimizer, float(buffers),
                float(act), float(cluster.gpu.memory_bytes), compute, comm, min(exposed, comm), mf,
                hw, cluster.gpu.peak_flops, by_op)


#: Meta, "The Llama 3 Herd of Models" (2024), table 3; sizes from the released config.json files.
LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192)
LLAMA3_70B = ModelShape("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192)
#: Touvron et al., "LLaMA: Open and Efficient Foundation Language Models" (2023), table 2 (the articles' "LLaMA-65B").
LLAMA_65B = ModelShape("LLaMA-65B", 80, 8192, 64, 64, 22016, 32000, 2048)
#: Brown et al., "Language Models are Few-Shot Learners" (2020), table 2.1: 96 layers, d 12288, 96 heads, 2048 ctx
#: (biases and the 25M learned position embeddings left out: 0.02% of the parameters).
GPT3_175B = ModelShape("GPT-3-175B", 96, 12288, 96, 96, 4 * 12288, 50257, 2048, gated_mlp=False, tied_embeddings=True)
