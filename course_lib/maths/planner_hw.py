"""The planner's hardware: what a GPU and a link can really do, each number with its source.

Vocabulary (used the same way in :mod:`course_lib.maths.planner` and Lab 08):

* **peak** -- the datasheet's dense FLOP/s (no sparsity). MFU divides by it.
* **achievable fraction** -- what a kernel family really reaches, as a fraction of peak: big bf16 GEMMs,
  flash attention, streaming memory traffic. A run never beats these; the planner charges every piece
  of work at its own family's rate instead of one "efficiency" for everything.
* **clock factor** -- a power-capped part runs every compute kernel slower by the same factor.
* **bus bandwidth** -- nccl-tests' ``busbw``: what a collective reaches per GPU, normalised so that it
  is comparable to the link's speed; it rises with the message size (small messages pay latency).

Sources (every constant below names which):

* [A100] NVIDIA A100 Tensor Core GPU datasheet: bf16 dense 312 TFLOP/s; HBM2 1,555 GB/s (40GB) and HBM2e
  2,039 GB/s (80GB); NVLink 3 600 GB/s (both directions); 108 SMs (A100 whitepaper).
* [H100] NVIDIA H100 Tensor Core GPU datasheet, SXM5: bf16 dense 989 TFLOP/s, fp8 dense 1,979 TFLOP/s;
  HBM3 3.35 TB/s; NVLink 4 900 GB/s (both directions); 132 SMs (H100 whitepaper).
* [TT-HW] pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``: Meta's Grand Teton H100s have
  96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU and run at a 500 W power limit ("the actual peak TFLOPs
  number is between SXM and NVL, and we don't know its exact value").
* [GEMM] published bf16 matmul sweeps reach ~87% of dense peak on A100 and ~80% on H100 for large square
  GEMMs (e.g. Stas Bekman, "Machine Learning Engineering", chapter compute/accelerator, "maximum achievable
  matmul FLOPS" table: A100 ~271 of 312, H100 SXM ~794 of 989 TFLOP/s).
* [WAVE] NVIDIA, "Matrix Multiplication Background User's Guide" (Deep Learning Performance docs): tile and
  wave quantisation -- a GEMM whose inner dimension is small keeps fewer tensor cores busy.
* [FA2] Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning" (2023,
  arXiv:2307.08691), fig. 4-6: causal forward+backward, head dim 128, on A100 rises from ~100 TFLOP/s at 512
  tokens to ~190 at 16K (FLOPs counted the papers' way: causal halves, backward = 2.5 x forward).
* [FA3] Shah et al., "FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision"
  (2024, arXiv:2407.08608), fig. 5-6: FlashAttention-2 on H100 SXM5 reaches only ~35% of peak
  (~330-350 TFLOP/s at long causal sequences, ~200 at 512), the kernel PyTorch's SDPA runs.
* [CUDNN-H] the same FlashAttention-3 paper, fig. 5-6, which also plots cuDNN's fused attention on H100 SXM5
  (head dim 128, bf16): causal forward ~550-600 TFLOP/s and backward ~430-470 at long sequences, i.e.
  ~480 TFLOP/s fwd + bwd counted the papers' way (bwd = 2.5 x fwd): 1.4 x FlashAttention-2 on Hopper, the
  kernel ``jax.nn.dot_product_attention(..., implementation="cudnn")`` and PyTorch SDPA's cuDNN backend run.
  Hopper only: on an A100 cuDNN's kernel is charged FlashAttention-2's rate.
* [H200] NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute (bf16 dense 989 TFLOP/s, 132 SMs)
  with 141 GB of HBM3e at 4.8 TB/s.
* [FA2-TRITON] the same FlashAttention-2 paper, abstract and sec. 4.1: FlashAttention-2 is "1.3-2.5x faster than
  FlashAttention in Triton" -- the Triton kernel MosaicML's benchmarks ran (``--attn_impl triton``): charged
  at the FlashAttention-2 rate / 1.8 (the geometric middle of that range).
* [STREAM] large copies reach ~85-90% of HBM peak (NVIDIA CUDA samples ``bandwidthTest``; BabelStream
  results on A100/H100): elementwise kernels are charged at 85%.
* [NCCL] NVIDIA nccl-tests ``PERFORMANCE.md`` (busbw definition) and published DGX runs: 8 x A100 NVLink
  all-reduce busbw ~230 GB/s (of 300), 8 x H100 ~360 GB/s (of 450); across nodes busbw approaches the node's
  NICs (8 x HDR: ~185 GB/s of 200). Half the large-message busbw is reached around a few MiB on NVLink and
  tens of MiB across nodes. NCCL runs each channel as one thread block on one SM (``NCCL_MAX_NCHANNELS``):
  16 channels take 16 SMs from the model's kernels while a collective runs.
* [DGX] NVIDIA DGX A100 / DGX H100 user guides: one 200 Gb/s HDR or 400 Gb/s NDR adapter per GPU.
* [L4] NVIDIA L4 Tensor Core GPU datasheet: bf16 dense 121 TFLOP/s (242 with sparsity); 24 GB GDDR6 at 300 GB/s.
* [A10] NVIDIA A10 Tensor Core GPU datasheet: bf16 dense 125 TFLOP/s (250 with sparsity); 24 GB GDDR6 at 600 GB/s.
* [MOSAIC] mosaicml/llm-foundry ``scripts/train/benchmarking/README.md``: A100 clusters with "1600 Gbps
  node-node interconnect (RoCE)".

This module is the course's one table of GPU peaks: :func:`peak_flops` gives MFU's denominator to
``course_lib.train``, ``course_lib.train_jax`` and ``python -m course_lib bench gpu-mfu`` from the device's name.
"""
from __future__ import annotations

from dataclasses import dataclass

from course_lib.maths.costs import AlphaBeta

__all__ = ["GPU", "Link", "GiB", "ATTENTION_KERNELS", "A100_40GB", "A100_80GB", "H100", "H100_TT500W", "H200",
           "L4", "A10", "BY_NAME", "peak_flops",
           "NVLINK_A100",
           "NVLINK_H100",
           "PCIE4", "IB_HDR", "IB_NDR", "ROCE_1600G", "ETH_100G", "ETH_10G"]

GiB = 1024 ** 3
#: attention kernel -> its speed relative to FlashAttention-2 (PyTorch SDPA's flash backend) [FA2-TRITON];
#: "cudnn" runs at the GPU's own ``cudnn_attention_flops`` where it has one (Hopper) [CUDNN-H]
ATTENTION_KERNELS = {"flash2": 1.0, "triton": 1 / 1.8, "cudnn": 1.0}


@dataclass(frozen=True)
class GPU:
    """One accelerator: peaks from the datasheet, achievable fractions from published kernels."""

    name: str
    memory_bytes: int              #: HBM per GPU
    peak_flops: float              #: dense bf16 FLOP/s, datasheet (MFU's denominator)
    hbm_bytes_per_s: float = 2.0e12    #: HBM bandwidth, datasheet
    matmul_fraction: float = 0.8       #: big bf16 GEMMs reach this fraction of peak [GEMM]
    attention_flops: float = 0.0       #: flash attention fwd+bwd, causal, long sequences (FLOP/s) [FA2]/[FA3]
    attention_half_seq: int = 600      #: sequence length at which attention reaches half that rate
    peak_fp8_flops: float = 0.0        #: dense fp8 FLOP/s (0: no fp8 tensor cores)
    fp8_matmul_fraction: float = 0.0   #: fp8 GEMMs reach this fraction of the fp8 peak
    memory_fraction: float = 0.85      #: elementwise kernels reach this fraction of HBM bandwidth [STREAM]
    clock_factor: float = 1.0          #: < 1 for a power-capped part: every compute kernel slows by it
    sms: int = 108                     #: streaming multiprocessors (NCCL's channels borrow some)
    cudnn_attention_flops: float = 0.0  #: cuDNN's fused attention fwd+bwd, causal, long sequences (0: as flash2)

    def __post_init__(self):
        bad = {k: getattr(self, k) for k in ("memory_bytes", "peak_flops", "hbm_bytes_per_s")
               if getattr(self, k) <= 0}
        bad.update({k: getattr(self, k) for k in ("matmul_fraction", "memory_fraction", "clock_factor")
                    if not 0 < getattr(self, k) <= 1})
        if bad:
            raise ValueError(f"GPU {self.name!r}: {bad} out of range (sizes and rates > 0, fractions in (0, 1])")

    def attention_rate(self, seq_len: int, kernel: str = "flash2") -> float:
        """FLOP/s of causal flash attention (the papers' FLOP count) at ``seq_len``: rises with the sequence."""
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention={kernel!r} must be one of {sorted(ATTENTION_KERNELS)}")
        top = self.attention_flops or 0.5 * self.peak_flops   # a GPU without a published figure: half of peak
        if kernel == "cudnn" and self.cudnn_attention_flops:
            top = self.cudnn_attention_flops
        return self.clock_factor * top * ATTENTION_KERNELS[kernel] * seq_len / (seq_len + self.attention_half_seq)

    def matmul_rate(self, inner: int, fp8: bool = False) -> float:
        """FLOP/s of a GEMM whose smallest dimension is ``inner`` (d_model for a transformer's linears):
        ``peak · fraction · clock · inner / (inner + 128)`` -- one 128-wide tile of waste [WAVE]."""
        if fp8:
            if not self.peak_fp8_flops:
                raise ValueError(f"{self.name} has no fp8 tensor cores: float8=True needs an H100 (or later)")
            top = self.peak_fp8_flops * self.fp8_matmul_fraction
        else:
            top = self.peak_flops * self.matmul_fraction
        return self.clock_factor * top * inner / (inner + 128)

    @property
    def stream_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.memory_fraction


@dataclass(frozen=True)
class Link:
    """A link's bandwidth in one direction: per GPU for NVLink/PCIe inside a node, per node between nodes."""

    name: str
    bandwidth_bytes_per_s: float   #: per direction, datasheet (per GPU inside a node, per node between nodes)
    hop_latency_s: float = 5e-6    #: per ring step (assumed); a ring over F ranks pays F - 1 of them
    bus_fraction: float = 0.85     #: nccl-tests' large-message busbw / datasheet [NCCL]
    half_bytes: float = 4 * 2**20  #: message size at which busbw is half its large-message value [NCCL]

    def __post_init__(self):
        if self.bandwidth_bytes_per_s <= 0 or self.hop_latency_s < 0 or not 0 < self.bus_fraction <= 1:
            raise ValueError(f"Link {self.name!r}: bandwidth_bytes_per_s({self.bandwidth_bytes_per_s}) must be > 0, "
                             f"hop_latency_s({self.hop_latency_s}) >= 0, bus_fraction({self.bus_fraction}) in (0, 1]")

    def alpha_beta(self, group: int) -> AlphaBeta:
        """The α-β model of one collective over a ring of ``group`` ranks at the datasheet bandwidth."""
        return AlphaBeta((group - 1) * self.hop_latency_s, 1.0 / self.bandwidth_bytes_per_s)

    def bus_fraction_at(self, message_bytes: float) -> float:
        """Fraction of the datasheet bandwidth a collective of ``message_bytes`` per call reaches."""
        return self.bus_fraction * message_bytes / (message_bytes + self.half_bytes)


#: [A100] [GEMM] [FA2] [STREAM]
A100_40GB = GPU("A100-SXM4-40GB", 40 * GiB, 312e12, 1.555e12, 0.87, 190e12, 600, sms=108)
A100_80GB = GPU("A100-SXM4-80GB", 80 * GiB, 312e12, 2.039e12, 0.87, 190e12, 600, sms=108)
#: [H100] [GEMM] [FA3]; fp8 GEMMs' fraction of the fp8 peak is fitted to the calibration set's float8 run
#: (planner_runs.fit_calibration)
H100 = GPU("H100-SXM5-80GB", 80 * GiB, 989e12, 3.35e12, 0.80, 350e12, 900, 1979e12, 0.62, sms=132,
           cudnn_attention_flops=480e12)
#: [H200]: the H100 with HBM3e
H200 = GPU("H200-SXM-141GB", 141 * 10**9, 989e12, 4.8e12, 0.80, 350e12, 900, 1979e12, 0.62, sms=132,
           cudnn_attention_flops=480e12)
#: [TT-HW]: torchtitan's H100s -- 96 GB HBM2e at 2.4 TB/s, 500 W, "peak between SXM and NVL". Clock factor: the
#: peak interpolated by power limit between H100 NVL (835 TFLOP/s dense bf16 at 400 W, NVIDIA H100 NVL datasheet)
#: and SXM5 (989 at 700 W): 835 + (989 - 835) · (500 - 400) / (700 - 400) = 886 TFLOP/s, 0.896 of 989.
H100_TT500W = GPU("H100-96GB-HBM2e-500W", 96 * GiB, 989e12, 2.4e12, 0.80, 350e12, 900, 1979e12, 0.62,
                  clock_factor=886 / 989, sms=132, cudnn_attention_flops=480e12)
#: [L4], [A10]: no published attention or GEMM sweeps here -- attention is charged at half of peak
L4 = GPU("L4", 24 * 10**9, 121e12, 0.3e12, sms=58)
A10 = GPU("A10", 24 * 10**9, 125e12, 0.6e12, sms=72)

#: [A100] [H100] [NCCL]: NVLink per GPU, one direction
NVLINK_A100 = Link("NVLink 3 (A100)", 300e9, 2e-6, 0.78, 4 * 2**20)
NVLINK_H100 = Link("NVLink 4 (H100)", 450e9, 2e-6, 0.80, 4 * 2**20)
PCIE4 = Link("PCIe 4.0 x16", 32e9, 5e-6, 0.80, 1 * 2**20)
#: inter-node links are per *node* [DGX]: 8 HDR adapters (8 x 200 Gb/s) or 8 NDR (8 x 400 Gb/s) [NCCL]
IB_HDR = Link("InfiniBand 8 x HDR 200 Gb/s per node", 8 * 25e9, 5e-6, 0.92, 32 * 2**20)
IB_NDR = Link("InfiniBand 8 x NDR 400 Gb/s per node", 8 * 50e9, 5e-6, 0.92, 32 * 2**20)
ROCE_1600G = Link("RoCE 1600 Gb/s per node", 200e9, 8e-6, 0.85, 32 * 2**20)   #: [MOSAIC]
ETH_100G = Link("Ethernet 100 Gb/s per node", 12.5e9, 10e-6, 0.85, 16 * 2**20)
ETH_10G = Link("Ethernet 10 Gb/s per node", 1.25e9, 20e-6, 0.85, 4 * 2**20)


#: device-name fragment -> GPU, first match wins ("A100" before "A10": an A100's name contains both). Every
#: H100 and H200 is charged the SXM part's peak.
BY_NAME = (("H100", H100), ("H200", H200), ("A100", A100_80GB), ("L4", L4), ("A10", A10))


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU a device name (``torch.cuda.get_device_name``, JAX's ``device_kind``)
    names, e.g. ``"NVIDIA H100 80GB HBM3"`` -> 989e12; None for a CPU or a GPU not in :data:`BY_NAME` (no MFU)."""
    return next((gpu.peak_flops for fragment, gpu in BY_NAME if fragment in (device_name or "")), None)
