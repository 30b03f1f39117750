"""Predict one training step's time for DP, FSDP and HSDP: compute + communication, each with α and β.

Two straight lines, fitted on this machine, and the course's byte counts in between:

* **compute** -- ``t = overhead + FLOPs / rate``: the same shape as the α-β model of a collective (a fixed
  cost per step -- Python, autograd, kernel launches, the optimizer -- plus a cost per unit of work), so it
  is fitted with the same :func:`course_lib.maths.costs.fit_alpha_beta`. FLOPs are :func:`train_flops`.
* **communication** -- per collective ``α + β · wire_bytes`` (:class:`course_lib.maths.costs.AlphaBeta`),
  one fit per op and group size (:class:`CommModel`), summed over the ops of
  :func:`course_lib.maths.costs.step_cost` -- the analytic bytes of Labs 01-06, never a ledger.

A third term, ``framework = γ · (all-gather and reduce-scatter calls)``, is the work FSDP does around each
of its unit collectives on the ranks' own threads (FSDP2: hooks, all-gather copy-in/copy-out, the gradient's
chunk-cat, DTensor bookkeeping); the c10d-level α-β never sees it. All-reduces (DDP's buckets, HSDP's
replicate step) get none: they reduce the gradient in place. It is measured once per machine (:func:`fit_framework_overhead`) -- on a CPU
it is the largest error of the two-line model.

``step = compute + framework + (1 - overlap) · comm``. On a CPU ``overlap`` is ~0: gloo runs its work on background
threads, but they need the same cores the ranks compute on. On a GPU, NCCL kernels run beside compute
kernels on their own stream, and FSDP's prefetch hides the comm that fits under compute
(:mod:`course_lib.maths.planner` models that).

The α-β model: Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2", Parallel
Computing 1994; the ring costs: Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH", 2005. Pure arithmetic: no torch, no process group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.maths import strategy as strategies
from course_lib.maths.costs import AlphaBeta, OpCost, StepCost, fit_alpha_beta, step_cost
from course_lib.maths.flops import gpt_block_shapes, gpt_flops_per_token

__all__ = ["gpt_units", "train_flops", "ComputeModel", "CommModel", "Prediction", "predict", "STRATEGIES",
           "fit_framework_overhead", "framework_calls"]

#: What :func:`predict` knows how to price (the ``costs.step_cost`` names).
STRATEGIES = ("dp", "fsdp", "hsdp")


def gpt_units(cfg) -> list[list[tuple[int, ...]]]:
    """The course GPT's FSDP units from its sizes (any object with ``vocab_size, seq_len, d_model,
    n_layers, d_ff``, e.g. ``GPTConfig``): the root's own parameters (tok_emb, pos_emb, ln_f, head), then
    each block's, in ``state_dict`` order -- what :func:`course_lib.strategies.hsdp.torch.unit_shapes` reads off
    a model (the tests hold the two equal). Computed here so that this module needs no torch."""
    V, T, C = cfg.vocab_size, cfg.seq_len, cfg.d_model
    return [[(V, C), (T, C), (C,), (C,), (V, C)]] + [gpt_block_shapes(cfg) for _ in range(cfg.n_layers)]


def train_flops(cfg, tokens: int) -> float:
    """FLOPs of one forward + backward over ``tokens`` tokens of the course GPT: ``tokens`` x
    :func:`course_lib.maths.flops.model_flops_per_token` (6·N + 12·L·d·s, PaLM's count: embeddings are lookups)."""
    return float(tokens) * gpt_flops_per_token(cfg)


@dataclass(frozen=True)
class ComputeModel:
    """``seconds = overhead_s + flops / flops_per_s`` for one rank's forward + backward + optimizer step."""

    overhead_s: float     #: per step, independent of the work (Python, autograd, the optimizer's loop)
    flops_per_s: float    #: the rate the FLOPs run at, with every rank of the run computing at once

    def __post_init__(self):
        if self.overhead_s < 0 or not self.flops_per_s > 0:
            raise ValueError(f"overhead_s({self.overhead_s}) must be >= 0 and flops_per_s({self.flops_per_s}) > 0")

    def seconds(self, flops: float) -> float:
        return self.overhead_s + flops / self.flops_per_s

    @classmethod
    def fit(cls, flops, seconds) -> "ComputeModel":
        """Least squares in relative error (:func:`course_lib.maths.costs.fit_alpha_beta`) of measured
        compute-only steps: ``flops`` per step and their ``seconds``; at least two distinct sizes."""
        ab = fit_alpha_beta(flops, seconds)
        if ab.beta_s_per_byte <= 0:
            raise ValueError(f"the compute times {list(seconds)} do not grow with the FLOPs {list(flops)}: "
                             "measure sizes further apart (or the machine was busy)")
        return cls(ab.alpha_s, 1.0 / ab.beta_s_per_byte)


@dataclass(frozen=True)
class CommModel:
    """α-β fits per ``(op, group_size)``: ``{("all_gather", 4): AlphaBeta(...), ...}``.

    One fit per op because implementations differ (gloo's reduce-scatter costs about as much as an
    all-reduce, twice the ring bound), one per group size because α lumps a ring's ``N - 1`` steps.
    """

    fits: dict = field(default_factory=dict)

    def __post_init__(self):
        for key, ab in self.fits.items():
            if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)):
                raise ValueError(f"CommModel key {key!r} must be (op, group_size), e.g. ('all_gather', 4)")
            if not isinstance(ab, AlphaBeta):
                raise ValueError(f"CommModel[{key!r}] = {ab!r} must be a costs.AlphaBeta")

    def alpha_beta(self, op: str, group: int) -> AlphaBeta:
        try:
            return self.fits[(op, group)]
        except KeyError:
            raise KeyError(f"no α-β fit for {op!r} over {group} ranks; calibrated: {sorted(self.fits)}. "
                           f"Calibrate that op at world size {group}") from None

    def seconds(self, op: OpCost) -> float:
        """``count · α + β · wire_bytes`` of one :class:`~course_lib.maths.costs.OpCost` (0 for a group of 1)."""
        if op.group_size == 1:
            return 0.0
        ab = self.alpha_beta(op.op, op.group_size)
        return op.count * ab.alpha_s + ab.beta_s_per_byte * op.wire_bytes


@dataclass(frozen=True)
class Prediction:
    """A predicted step, per rank, with its terms."""

    strategy: str
    n: int
    local_tokens: int
    flops: float
    compute_s: float
    comm_s: float
    overlap: float
    cost: StepCost
    comm_by_op: dict
    framework_s: float = 0.0   #: γ · framework_calls

    @property
    def collectives(self) -> int:
        return sum(o.count for o in self.cost.ops)

    @property
    def framework_calls(self) -> int:
        """All-gather and reduce-scatter calls: the ones FSDP wraps in copies and hooks."""
        return framework_calls(self.cost)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.framework_s + (1.0 - self.overlap) * self.comm_s

    @property
    def efficiency(self) -> float:
        """compute / step: the fraction of the step spent computing (the articles' "efficiency")."""
        return self.compute_s / self.step_s


def predict(strategy: str, cfg, n: int, batch: int, compute: ComputeModel, comm: CommModel, *,
            replicate: int = 1, overlap: float = 0.0, padding: str = "dim0", param_bytes: int = 4,
            reduce_bytes: int = 4, root_unit: int | None = None, per_collective_s: float = 0.0) -> Prediction:
    """The step time of ``strategy`` ("dp", "fsdp", "hsdp") for the course GPT ``cfg`` on ``n`` ranks with a
    *global* batch of ``batch`` sequences (``batch / n`` per rank). FSDP2 pads on dim 0 (``padding="dim0"``);
    ``root_unit=0`` when the root is not resharded after forward (FSDP2's default for the root).
    ``per_collective_s``: γ, FSDP's own seconds per all-gather or reduce-scatter call."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    strategies.sharding_factor(strategy, n, replicate)
    if not isinstance(batch, int) or batch < n or batch % n:
        raise ValueError(f"batch({batch}) must be a positive multiple of n({n}): each rank takes batch / n sequences")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap={overlap} must be in [0, 1]: the fraction of communication hidden under compute")
    tokens = batch // n * cfg.seq_len
    flops = train_flops(cfg, tokens)
    cost = step_cost(strategy, gpt_units(cfg), n, param_bytes=param_bytes, reduce_bytes=reduce_bytes,
                     padding="none" if strategy == "dp" else padding, replicate=replicate, root_unit=root_unit)
    by_op: dict[str, float] = {}
    for o in cost.ops:
        key = f"{o.op} ({o.phase})"
        by_op[key] = by_op.get(key, 0.0) + comm.seconds(o)
    if per_collective_s < 0:
        raise ValueError(f"per_collective_s={per_collective_s} must be >= 0")
    framework = per_collective_s * framework_calls(cost)
    return Prediction(strategy, n, tokens, flops, compute.seconds(flops), sum(by_op.values()), overlap, cost, by_op,
                      framework)


def framework_calls(cost: StepCost) -> int:
    """How many all-gather and reduce-scatter calls a step makes (what γ multiplies)."""
    return sum(o.count for o in cost.ops if o.op in ("all_gather", "reduce_scatter"))


def fit_framework_overhead(measured_s: float, prediction: Prediction) -> float:
    """γ from one measured step: what the compute and communication terms leave unexplained, per all-gather
    or reduce-scatter call (0 when the prediction already covers it). Fit it on a configuration you will not test."""
    if prediction.framework_calls == 0:
        raise ValueError("the prediction has no all-gather or reduce-scatter to spread the residual over (DP?)")
    rest = measured_s - prediction.compute_s - (1.0 - prediction.overlap) * prediction.comm_s
    return max(0.0, rest / prediction.framework_calls)
