"""The course at real scale: memory per GPU, step time and MFU of a real model on a published cluster.

``plan(model, cluster, strategy, batch, ...)`` applies the course's formulas to shapes nobody can run in a lab.

**Step time, per operation** (one micro-batch; a step is ``grad_accum`` of them plus the optimizer). Every piece
of work runs at the rate of its own kernel family (:mod:`course_lib.maths.planner_hw`, each rate cited), on the
FLOPs and bytes counted in :mod:`course_lib.maths.planner_work`:

* **matmul** -- ``6 x`` the linears' parameters per token, at ``peak · matmul_fraction`` (bf16) or the fp8 rate
  (``float8=True``: the blocks' linears; the head stays bf16);
* **attention** -- causal flash attention, forward + 2.5 x for its backward, at the FlashAttention papers'
  measured rate for that sequence length;
* **memory-bound** -- norms, residual adds, RoPE, the MLP activation, the loss over the vocabulary, float8's
  casts, the optimizer and FSDP's copy-in/copy-out: bytes ÷ HBM bandwidth (``compile=True`` fuses the blocks'
  pointwise ops, as torchtitan compiles each block; the loss stays eager);
* **recompute** -- activation checkpointing's second forward: ``"full"`` the whole block, ``"selective"``
  (torchtitan's per-op policy) every second matmul of a block and every pointwise op, no attention;
* **exposed communication** -- FSDP's all-gathers and reduce-scatters at the bus bandwidth their message size
  reaches on the link their group crosses, hidden under compute by prefetch except the first gather, the last
  reduce and whatever does not fit; the compute slowed by NCCL's borrowed SMs while it hides; tensor
  parallelism's per-layer collectives (on NVLink, on the critical path).

**The host** -- the CPU issuing the step (:mod:`course_lib.maths.planner_host`): dispatches per step, counted for
the model as written (eager, compiled, XLA; FSDP2's hooks per unit) x seconds per dispatch calibrated on a tiny run.
``step = max(device, host) + serial host work``; :attr:`Plan.host_bound` when the host is the slower. At the
published runs' sizes the host never binds (at most 6% of the device's time), so their figures are unchanged.

**MFU** (model FLOPs utilisation) = tokens/s · model FLOPs per token / peak (Chowdhery et al., "PaLM: Scaling
Language Modeling with Pathways", 2022, appendix B): ``6N + 12·L·d·s`` per token. **HFU** counts what the
hardware really ran: recomputed matmuls too. Neither counts memory-bound work, which is why a run whose time
goes to norms and softmax shows a low MFU on fast GPUs.

**Memory per GPU** = model state (:func:`course_lib.maths.memory.state_bytes`: mixed precision + Adam, the ZeRO
paper's ``K = 12``) + FSDP's gathered buffers (two units in flight, one unit's unsharded gradient) + activations
(:func:`course_lib.maths.planner_work.saved_bytes_per_token` per layer; under checkpointing plus one layer
rebuilt at a time) + the loss (:data:`LOGITS_BYTES`, by how it is written: ``loss="fp32"``: bf16 logits kept by
the caller, fp32 log-probabilities saved for backward, their gradient and the logits' fp32 gradient alive
together = ``14·V`` bytes per token, not 6; ``"bf16"``: the same four in bf16, ``8·V``; ``"fused"``: the bf16
logits and one fp32 gradient, ``6·V``) + 1 GiB of reserve (cuBLAS workspaces, NCCL buffers, the caching
allocator's rounding), which :attr:`Plan.allocated` leaves out: it is what ``torch.cuda.max_memory_allocated``
and JAX's ``peak_bytes_in_use`` count.

**Gradient accumulation**: FSDP / ZeRO-2 / HSDP reduce (and FSDP gathers) on every micro-batch; DDP
(``no_sync``) and ZeRO-1 reduce the accumulated gradient once per step, and ZeRO-1 gathers the updated
parameters once per step. Tensor parallelism composes with every strategy (Megatron-LM runs its distributed
optimizer, ZeRO-1, and plain DP beside TP; FSDP2 and torchtitan run FSDP x TP).

Calibration and validation against published runs: :mod:`course_lib.maths.planner_runs`.

Longer than ~300 lines: the model shapes, the plan and its validation sit beside the one function that uses them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from course_lib.maths import memory
from course_lib.maths import planner_host as host
from course_lib.maths import planner_work as work
from course_lib.maths import strategy as strategies
from course_lib.maths.costs import AlphaBeta, step_cost
from course_lib.maths.flops import model_flops_per_token
from course_lib.maths.planner_hw import (A100_40GB, A100_80GB, ETH_10G, ETH_100G, GPU, H100, H100_TT500W, H200, IB_HDR,
                                         IB_NDR, NVLINK_A100, NVLINK_H100, PCIE4, ROCE_1600G, GiB, Link)

__all__ = ["positive_ints",
           "ModelShape", "GPU", "Link", "Cluster", "Plan", "plan", "course_gpt", "CHECKPOINTING", "BREAKDOWN",
           "LLAMA3_8B", "LLAMA3_70B", "LLAMA_65B", "GPT3_175B", "A100_40GB", "A100_80GB", "H100", "H100_TT500W", "H200",
           "NVLINK_A100", "NVLINK_H100", "IB_HDR", "IB_NDR", "ROCE_1600G", "ETH_100G", "ETH_10G", "PCIE4", "GiB"]

CHECKPOINTING = ("none", "selective", "full")
#: the parts of a step, in the order Lab 08 stacks them
BREAKDOWN = ("matmul", "attention", "memory-bound", "recompute", "exposed comm")
RESERVE_BYTES = 1 * GiB       #: cuBLAS workspaces, NCCL buffers, allocator rounding (an assumption)
#: per token and vocabulary entry, by ``loss=`` (docstring); "chunked" adds one fp32 chunk (8 B per entry of its rows)
LOGITS_BYTES = {"fp32": 14, "bf16": 8, "fused": 6, "chunked": 4}
NCCL_CHANNELS = 16            #: SMs a running collective takes from compute (planner_hw [NCCL])
#: share of a step in which the GPU runs no kernel at all (launch gaps, host synchronisation, Python): every
#: compute part is stretched by 1 / (1 - IDLE_FRACTION). The one constant fitted to a training run for every GPU:
#: the calibration run of :mod:`course_lib.maths.planner_runs` (torchtitan Llama-3.1-8B, 8 H100, eager).
IDLE_FRACTION = 0.148


def positive_ints(what: str, **sizes) -> None:
    """Raise naming every one of ``sizes`` that is not an int >= 1 (bools refused): the planner's sizes, degrees and
    counts, checked up front by every config (``what`` names it)."""
    bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"{what} sizes must be positive ints, got {bad}: all must be ints >= 1")


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
    norm: str = "rms"              #: "rms" (Llama's RMSNorm, several kernels eager) or "layer" (one fused kernel)
    rope: bool = True              #: rotary embeddings on q and k (elementwise work); False: ALiBi / learned
    fused_qkv: bool = False        #: one Wqkv matmul (MPT, GPT) instead of three

    def __post_init__(self):
        positive_ints(type(self).__name__, **{k: getattr(self, k) for k in ("n_layers", "d_model", "n_heads",
                                                                             "n_kv_heads", "d_ff", "vocab_size",
                                                                             "seq_len")})
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"d_model({self.d_model}) must divide by n_heads({self.n_heads}) and n_heads by "
                             f"n_kv_heads({self.n_kv_heads}); e.g. d_model=4096, n_heads=32, n_kv_heads=8")
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm={self.norm!r} must be 'rms' or 'layer'")

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
        """:func:`course_lib.maths.flops.model_flops_per_token`: ``6·N + 12·L·d·s`` with ``N`` every block's
        linears and the head (the input embedding is a lookup; norms are not matmuls)."""
        n = self.n_layers * sum(i * o for i, o in work.block_matmuls(self)) + self.vocab_size * self.d_model
        return model_flops_per_token(n, self.n_layers, self.d_model, seq_len or self.seq_len)

    def activation_bytes_per_token_layer(self) -> int:
        """Bytes one layer saves for backward per token, bf16, flash attention: ``12d + 4·d_kv + 6·d_ff``."""
        return int(work.saved_bytes_per_token(self, "none"))


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs: ``intra`` links GPUs of a node, ``inter`` the nodes."""

    gpu: GPU
    gpus_per_node: int
    nodes: int = 1
    intra: Link = NVLINK_H100
    inter: Link = IB_NDR

    def __post_init__(self):
        positive_ints(type(self).__name__, gpus_per_node=self.gpus_per_node, nodes=self.nodes)

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

    def collective_s(self, wire_bytes: float, message_bytes: float, calls: int, group: int,
                     per_node: int) -> float:
        """Seconds of ``calls`` ring collectives moving ``wire_bytes`` per GPU in all, ``message_bytes`` per call,
        over ``group`` GPUs of which ``per_node`` sit in each node. Inside a node: NVLink. Across nodes: the
        ring may use the NICs of its ``per_node`` members (each GPU has ``inter / gpus_per_node``), capped by
        NVLink. Either way at the bus bandwidth a message of that size reaches (latency-bound when small)."""
        if group <= 1 or wire_bytes <= 0:
            return 0.0
        link = self.intra if group <= per_node else self.inter
        bw = link.bandwidth_bytes_per_s * (1 if link is self.intra else per_node / self.gpus_per_node)
        bw = min(bw, self.intra.bandwidth_bytes_per_s) * link.bus_fraction_at(message_bytes)
        return calls * (group - 1) * link.hop_latency_s + wire_bytes / bw


@dataclass(frozen=True)
class Plan:
    """Per GPU: memory (bytes), time (seconds) and throughput of one training step."""

    strategy: str
    world: int
    replicate: int
    batch: int                 #: sequences per data-parallel rank per micro-batch
    seq_len: int
    checkpointing: str
    params: float              #: model-state bytes: parameters ...
    grads: float               #: ... gradients (alive at the step's peak) ...
    optimizer: float           #: ... and Adam (fp32 master, m, v)
    buffers: float             #: FSDP's gathered units and unsharded gradient in flight
    activations: float         #: saved for backward, the loss's buffers and the reserve
    memory_limit: float        #: the GPU's HBM
    compute_s: float           #: matmul + attention + memory-bound + recompute, the whole step
    comm_s: float              #: every collective, one after the other
    exposed_comm_s: float      #: communication compute does not hide, + NCCL's slowdown of what it hides
    model_flops_per_token: float
    hardware_flops_per_token: float   #: model FLOPs + the recomputed matmuls (and attention under full AC)
    peak_flops: float
    comm_by_op: dict = field(default_factory=dict)   #: op -> seconds
    parts: dict = field(default_factory=dict)        #: BREAKDOWN name -> seconds per step
    tp: int = 1
    grad_accum: int = 1
    compile: bool = False
    float8: bool = False
    reserve: float = RESERVE_BYTES   #: the part of ``activations`` outside the caching allocator's tensors
    host_s: float = 0.0              #: the host's time to issue the step (planner_host): hides under device time
    host_serial_s: float = 0.0       #: host work the device waits for (a batch built in the step, a sync)
    dispatches: int = 0              #: eager operator dispatches per step (planner_host)
    kernels: int = 0                 #: of them, those that launch a kernel, + compiled launches
    optimizer_s: float = 0.0         #: the optimizer's part of ``compute_s`` (once per step, not per micro-batch)

    state = property(lambda self: self.params + self.grads + self.optimizer)
    total = property(lambda self: self.state + self.buffers + self.activations)
    allocated = property(lambda self: self.total - self.reserve)   #: what max_memory_allocated would read
    fits = property(lambda self: self.total <= self.memory_limit)
    device_s = property(lambda self: self.compute_s + self.exposed_comm_s)   #: what the GPU alone would take
    #: step = max(device, host) + the host's serial work (planner_host)
    step_s = property(lambda self: max(self.device_s, self.host_s) + self.host_serial_s)
    host_bound = property(lambda self: self.host_s > self.device_s)        #: the host, not the GPU, sets the pace
    tokens_per_step = property(lambda self: self.batch * self.seq_len * self.grad_accum / self.tp)   #: per GPU
    tokens_per_s_per_gpu = property(lambda self: self.tokens_per_step / self.step_s)

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_gpu * self.model_flops_per_token / self.peak_flops

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: like :attr:`mfu`, counting the recomputed work too."""
        return self.tokens_per_s_per_gpu * self.hardware_flops_per_token / self.peak_flops

    @property
    def compute_bound(self) -> bool:
        """Compute time >= communication time: prefetch can hide all of it (scaling-book's B > C/W)."""
        return self.compute_s >= self.comm_s

    def summary(self) -> str:
        g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
        knobs = "".join(k for k, on in ((" +compile", self.compile), (" +float8", self.float8)) if on)
        knobs += f" TP {self.tp}" if self.tp > 1 else ""
        return (f"{self.strategy} on {self.world} GPUs, batch {self.batch} x {self.seq_len}"
                f"{f' x {self.grad_accum} accum' if self.grad_accum > 1 else ''}, AC {self.checkpointing}{knobs}: "
                f"{g(self.total)} GiB/GPU (state {g(self.state)}, buffers {g(self.buffers)}, activations "
                f"{g(self.activations)}) of {g(self.memory_limit)} -> {'fits' if self.fits else 'does NOT fit'}; "
                f"step {self.step_s:.3f} s (compute {self.compute_s:.3f}, comm {self.comm_s:.3f}, exposed "
                f"{self.exposed_comm_s:.3f}{f', host {self.host_s:.3f} HOST-BOUND' if self.host_bound else ''}"
                f"{f', serial {self.host_serial_s:.3f}' if self.host_serial_s else ''}), "
                f"{self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {self.mfu:.0%}")


def _check_knobs(model, cluster, strategy, batch, checkpointing, compute_efficiency, tp, grad_accum, compile,
                 float8):
    for name, v in (("batch", batch), ("tp", tp), ("grad_accum", grad_accum)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1" + (" (sequences per GPU per step)"
                                                                      if name == "batch" else ""))
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing={checkpointing!r} must be one of {CHECKPOINTING}")
    if compute_efficiency is not None:
        if not 0 < compute_efficiency <= 1:
            raise ValueError(f"compute_efficiency={compute_efficiency} must be in (0, 1]: a fraction of peak")
        if compile or float8 or tp > 1:
            raise ValueError(f"compute_efficiency={compute_efficiency} is the one-number model; it cannot price "
                             f"compile={compile}, float8={float8}, tp={tp}: leave compute_efficiency=None")
    if float8 and not cluster.gpu.peak_fp8_flops:
        raise ValueError(f"float8=True needs fp8 tensor cores; {cluster.gpu.name} has none: use an H100 or "
                         "float8=False")
    if tp > 1:
        if cluster.gpus_per_node % tp or model.n_kv_heads % tp:
            raise ValueError(f"tp({tp}) must divide gpus_per_node({cluster.gpus_per_node}) -- TP stays on NVLink "
                             f"inside a node -- and n_kv_heads({model.n_kv_heads}) -- each GPU owns whole heads; "
                             f"e.g. tp=8 for 8 GPUs and 8 KV heads")


def _host_kwargs(cal) -> dict:
    """:func:`planner_host.dispatches_per_step`'s keywords for a machine's calibration (None: the defaults)."""
    if cal is None:
        return {}
    return {"dispatch_s": cal.dispatch_s, "step_fixed_s": cal.step_fixed_s, "fsdp_unit_s": cal.fsdp_unit_s,
            "gpu": not cal.launch_included}


def plan(model: ModelShape, cluster: Cluster, strategy: str, batch: int, *, seq_len: int | None = None,
         checkpointing: str = "none", replicate: int | None = None, compute_efficiency: float | None = None,
         reduce_bytes: int = 4, overlap: bool = True, compile: bool = False, float8: bool = False, tp: int = 1,
         grad_accum: int = 1, optimizer_bytes: float = 72.0, attention: str = "flash2", loss: str = "fp32",
         autocast: bool = False, framework: str = "torch", host_serial_s: float = 0.0,
         host_calibration: "host.HostCalibration | None" = None) -> Plan:
    """One training step of ``model`` on ``cluster``: ``grad_accum`` micro-batches of ``batch`` sequences per
    data-parallel rank (a TP group of ``tp`` GPUs shares one), then the optimizer.

    ``strategy``: ``"dp"``, ``"zero1"``, ``"zero2"``, ``"fsdp"`` (= ``"zero3"``) or ``"hsdp"`` (``replicate``
    copies, default one per node, each sharded over ``F = world / (tp · replicate)`` GPUs). Parameters are
    gathered in bf16, gradients reduced in ``reduce_bytes`` (4: fp32, torchtitan's default), every micro-batch.
    ``checkpointing``: ``"none"``, ``"selective"`` (torchtitan's per-op policy) or ``"full"``. ``compile``:
    torch.compile per block. ``float8``: the blocks' linears in fp8 with dynamic scaling. ``tp``: tensor
    parallel degree inside a node, with sequence parallelism. ``optimizer_bytes``: HBM bytes AdamW moves per
    local parameter (72: PyTorch's foreach implementation, 6 kernels over fp32 param, grad, m, v).
    ``attention``: the kernel, ``"flash2"`` (PyTorch SDPA's flash backend), ``"cudnn"`` (cuDNN's fused attention:
    JAX's ``implementation="cudnn"``, SDPA's cuDNN backend) or ``"triton"`` (MosaicML's 2023 runs). ``loss``: how
    the cross-entropy is written (:data:`~course_lib.maths.planner_work.LOSS_KINDS`): ``"fp32"`` (logits cast to
    fp32, eager), ``"bf16"`` (eager on bf16 logits) or ``"fused"`` (one fused kernel: compiled, or XLA).
    ``"chunked"`` (``course_lib.train``: the gradient made in the forward, one fp32 chunk at a time).
    ``autocast``: bf16 by ``torch.autocast`` on fp32 weights (``course_lib.train`` at world size 1, where there is no
    FSDP2 policy): norms and the residual stream stay fp32, each weight's bf16 copy is kept for backward.
    ``framework``: ``"torch"`` (eager dispatches, or compiled blocks) or ``"xla"`` (JAX: one program per step) --
    the host's side of the step (:mod:`course_lib.maths.planner_host`); ``host_serial_s``: host seconds per step the
    device waits for (a batch built inside the step, a synchronising read); ``host_calibration``: the machine's own
    host constants (:class:`~course_lib.maths.planner_host.HostCalibration`; default: this course's CPU machine).
    ``compute_efficiency``: the course's old one-number model -- every FLOP at that fraction of peak, no
    memory-bound work -- kept to show what it misses. ``overlap=False``: nothing hides under compute.
    """
    row = strategies.get(strategy)
    if loss not in LOGITS_BYTES:
        raise ValueError(f"loss={loss!r} must be one of {sorted(LOGITS_BYTES)}")
    _check_knobs(model, cluster, strategy, batch, checkpointing, compute_efficiency, tp, grad_accum, compile, float8)
    n, s, gpu = cluster.world, seq_len or model.seq_len, cluster.gpu
    if n % tp:
        raise ValueError(f"tp({tp}) must divide the world size({n})")
    dp = n // tp                                                 # data-parallel ranks (FSDP's mesh dim)
    r = (replicate or cluster.nodes) if row.hybrid else (1 if replicate is None else replicate)   # HSDP: a copy per node
    strategies.sharding_factor(strategy, dp, r)                  # validates r, names every factor
    # -- memory -----------------------------------------------------------------------------------------
    st = memory.state_bytes(strategy, math.ceil(model.params / tp), dp, precision="mixed", replicate=r)
    units = [[(math.ceil(sum(math.prod(x) for x in u) / tp),)] for u in model.units()]
    sizes = sorted(u[0][0] for u in units)
    buffers = 2 * (sizes[-1] + sizes[-2]) + reduce_bytes * sizes[-1] if row.params else 0.0
    if autocast:   # each matmul weight's bf16 copy, cast once per forward and kept for backward
        buffers += 2 * sum(work.matmul_flops_per_token(model)) / 2 / tp     # 2 B x matmul parameters (FLOPs / 2)
    tok = batch * s / tp                                          # tokens each GPU computes per micro-batch
    L, V = model.n_layers, model.vocab_size
    act = L * work.saved_bytes_per_token(model, checkpointing, autocast) * tok
    if checkpointing != "none":
        act += work.saved_bytes_per_token(model, "none", autocast) * tok   # one layer rebuilt at a time in backward
    if autocast or loss == "chunked":   # course_lib.train's path, where it was measured (below 0.3% of a published
        act += work.outside_layers_bytes_per_token(model, autocast) * tok   # run's memory: left out there)
    act += LOGITS_BYTES[loss] * V * tok + RESERVE_BYTES
    grads_at_peak = st.grads
    if autocast or loss == "chunked":   # course_lib.train: zero_grad(set_to_none=True), so backward starts with no
        # gradient and each layer's appears as its saved activations are freed: the peak holds the larger of the two
        # (measured on an H200: without this, 1.10-1.11x the allocator's peak at 1.3-1.4B parameters)
        grads_at_peak = max(0.0, st.grads - L * work.saved_bytes_per_token(model, checkpointing, autocast) * tok)
    if loss == "chunked":   # one chunk's fp32 cast and log-probabilities at a time
        act += 8 * V * min(tok, max(1, work.LOSS_CHUNK_BYTES // (4 * V)))
    # -- compute, per micro-batch ------------------------------------------------------------------------
    mm_block, mm_head = work.matmul_flops_per_token(model)
    attn = work.attention_flops_per_token(model, s)
    frac = work.recomputed_matmul_fraction(model, checkpointing)
    mf = model.model_flops_per_token(s)
    hw = mf + frac * mm_block + (6 * L * model.d_model * s if checkpointing == "full" else 0)
    if compute_efficiency is not None:                            # the one-number model
        rate = gpu.peak_flops * compute_efficiency
        mm_s, attn_s, mem_s = tok * mf / rate, 0.0, 0.0
        rec_s = tok * (hw - mf) / rate
    else:
        blk_rate = gpu.matmul_rate(model.d_model, fp8=float8)
        head_rate = gpu.matmul_rate(model.d_model)
        attn_rate = gpu.attention_rate(s, attention)
        bw = gpu.stream_bytes_per_s
        pw = work.pointwise_bytes_per_token(model, compile) * L
        mm_s = tok * 3 * (mm_block / blk_rate + mm_head / head_rate)
        attn_s = tok * 3.5 * attn / attn_rate
        per_tok = 3 * pw + work.loss_bytes_per_token(model, loss)
        per_tok += work.float8_bytes_per_token(model, compile) if float8 else 0.0
        fsdp_copies = 18 * model.params / tp if row.params else 0.0   # copy-out of 2 gathers, cast + copy-in
        mem_s = (tok * per_tok + fsdp_copies) / bw
        rec_s = tok * (frac * mm_block / blk_rate + (pw / bw if checkpointing != "none" else 0.0)
                       + (attn / attn_rate if checkpointing == "full" else 0.0))
    stretch = 1.0 if compute_efficiency is not None else 1 / (1 - IDLE_FRACTION)
    mm_s, attn_s, mem_s, rec_s = (x * stretch for x in (mm_s, attn_s, mem_s, rec_s))
    micro_c = mm_s + attn_s + mem_s + rec_s
    # -- communication, per micro-batch ------------------------------------------------------------------
    cost = step_cost(strategy, units, dp, param_bytes=2, reduce_bytes=reduce_bytes, padding="none", replicate=r)
    by_op, phase_s = {}, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    shard_per_node = max(1, cluster.gpus_per_node // tp)
    for o in cost.ops:
        across_replicas = row.hybrid and o.op == "all_reduce"
        per_node = 1 if across_replicas and cluster.nodes > 1 else min(o.group_size, shard_per_node)
        if across_replicas and cluster.nodes == 1:
            per_node = o.group_size
        t = cluster.collective_s(o.wire_bytes, o.payload_bytes / o.count, o.count, o.group_size, per_node)
        by_op[f"{o.op} ({o.phase})"] = by_op.get(f"{o.op} ({o.phase})", 0.0) + t
        phase_s[o.phase] += t
    fsdp_comm = sum(phase_s.values())
    tp_s = 0.0
    if tp > 1:   # sequence parallel: 2 all-gathers + 2 reduce-scatters of the activations per layer and pass
        msg = batch * s * model.d_model * 2
        passes = 2 + (checkpointing != "none")
        calls = 4 * L * passes
        tp_s = cluster.collective_s(calls * msg * (tp - 1) / tp, msg, calls, tp, tp)
        by_op["tensor parallel (every layer)"] = tp_s
    if not overlap:
        exposed, hidden = fsdp_comm, 0.0
    else:
        k = len(units)
        fwd_c = (micro_c - rec_s) / 3
        bwd_c = micro_c - fwd_c
        edge = (phase_s["forward"] + phase_s["backward"]) / k if row.params else 0.0   # first gather, last reduce
        exposed = (max(0.0, phase_s["forward"] - fwd_c) + max(0.0, phase_s["backward"] - bwd_c)
                   + phase_s["optimizer"] + min(edge, fsdp_comm))
        exposed = min(exposed, fsdp_comm)
        hidden = fsdp_comm - exposed
    slowdown = hidden * NCCL_CHANNELS / gpu.sms if compute_efficiency is None else 0.0
    # DDP (no_sync) and ZeRO-1 sync the accumulated gradient once per step: only the last micro-batch's
    # backward can hide it. FSDP / ZeRO-2 / HSDP reduce-scatter (and FSDP gathers) every micro-batch.
    syncs = grad_accum if (row.params or row.grads) else 1
    # -- the step ----------------------------------------------------------------------------------------
    opt_s = 0.0 if compute_efficiency is not None else \
        stretch * optimizer_bytes * st.optimizer / 12 / gpu.stream_bytes_per_s   # Adam state: 12 B per local param
    parts = {"matmul": grad_accum * mm_s, "attention": grad_accum * attn_s,
             "memory-bound": grad_accum * mem_s + opt_s, "recompute": grad_accum * rec_s,
             "exposed comm": syncs * (exposed + slowdown) + grad_accum * tp_s}
    # -- the host ----------------------------------------------------------------------------------------
    hw_ = host.dispatches_per_step(model, fsdp=bool(row.params), bf16=True, compile=compile, framework=framework,
                                   checkpointing=checkpointing, grad_accum=grad_accum,
                                   **_host_kwargs(host_calibration))
    return Plan(strategy=strategy, world=n, replicate=r, batch=batch, seq_len=s, checkpointing=checkpointing,
                params=st.params, grads=grads_at_peak, optimizer=st.optimizer, buffers=float(buffers),
                activations=float(act), memory_limit=float(gpu.memory_bytes),
                compute_s=grad_accum * micro_c + opt_s, comm_s=syncs * fsdp_comm + grad_accum * tp_s,
                exposed_comm_s=parts["exposed comm"], model_flops_per_token=mf, hardware_flops_per_token=hw,
                peak_flops=gpu.peak_flops, comm_by_op=by_op, parts=parts, tp=tp, grad_accum=grad_accum,
                compile=compile, float8=float8, host_s=hw_.seconds if compute_efficiency is None else 0.0,
                host_serial_s=host_serial_s, dispatches=hw_.dispatches, kernels=hw_.kernels + hw_.launches,
                optimizer_s=opt_s)


#: Meta, "The Llama 3 Herd of Models" (2024), table 3; sizes from the released config.json files.
LLAMA3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256, 8192)
LLAMA3_70B = ModelShape("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256, 8192)
#: Touvron et al., "LLaMA: Open and Efficient Foundation Language Models" (2023), table 2 (the articles' "LLaMA-65B").
LLAMA_65B = ModelShape("LLaMA-65B", 80, 8192, 64, 64, 22016, 32000, 2048)
#: Brown et al., "Language Models are Few-Shot Learners" (2020), table 2.1: 96 layers, d 12288, 96 heads, 2048 ctx
#: (biases and the 25M learned position embeddings left out: 0.02% of the parameters).
def course_gpt(cfg, name: str = "") -> ModelShape:
    """The course GPT (:class:`course_lib.models.config.GPTConfig`, or anything with its fields) as a
    ModelShape: GELU MLP, LayerNorm, fused qkv, learned positions (no RoPE), untied head. Its biases and
    position table (under 1% of the parameters at the sizes a GPU runs) are left out, as for GPT-3 below."""
    return ModelShape(name or f"course GPT L{cfg.n_layers} d{cfg.d_model}", cfg.n_layers, cfg.d_model, cfg.n_heads,
                      cfg.n_heads, cfg.d_ff, cfg.vocab_size, cfg.seq_len, gated_mlp=False, tied_embeddings=False,
                      norm="layer", rope=False, fused_qkv=True)


GPT3_175B = ModelShape("GPT-3-175B", 96, 12288, 96, 96, 4 * 12288, 50257, 2048, gated_mlp=False, tied_embeddings=True,
                       norm="layer", rope=False, fused_qkv=True)
