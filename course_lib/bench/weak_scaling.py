"""Weak scaling, as the FSDP paper measures it: the batch *per rank* stays fixed while ranks are added.

    python -m course_lib bench weak-scaling [--ranks 1 2 4] [--batch 4] [--width 128] [--steps 10]

Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB 2023), report
"near-linear" scaling in TFLOPS per GPU as GPUs are added at a fixed batch per GPU, and that FSDP
performs like DDP for models that fit one GPU. Strong scaling (Lab 08's section 2: a fixed *global*
batch) asks a different question: there each rank's compute shrinks as 1/N while its traffic does not.

Per row (one strategy, ``N`` ranks, ``batch`` sequences on every rank) this measures, with
:func:`course_lib.bench.fsdp.measure` (DDP, and FSDP2 with every unit resharded after forward):

* **wire bytes per rank per step** from the c10d ledger (rank 0, one steady step), against the paper's
  formulas -- DDP's all-reduce ``2(N-1)/N · 4Ψ``, FSDP's all-gather + all-gather + reduce-scatter
  ``3(N-1)/N · 4Ψ`` -- and against :func:`course_lib.maths.costs.step_cost`, which adds FSDP2's padding
  of each parameter's rows to a multiple of ``N`` (the ledger must equal it to the byte);
* **model state per rank** (parameters, gradients, AdamW's m and v) measured on rank 0, against 16Ψ
  (DDP) and 16Ψpad/N (FSDP): DDP's is flat in ``N``, FSDP's falls as 1/N;
* **step time**: the median of the slowest rank's steps -- a clock, never asserted.

Both byte formulas *grow* with ``N`` only through (N-1)/N and are bounded (2·4Ψ, 3·4Ψ): with a fixed batch
per rank, a rank's compute and its traffic stay flat as ranks are added, which is why weak scaling can be
near-linear on hardware where every rank has its own device and link. On one shared CPU it cannot: the ranks
share the cores (see Lab 08).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["STRATEGIES", "PASSES", "Row", "paper_bytes", "row", "rows", "format_table", "main"]

#: the two strategies compared: ``bench.fsdp``'s names
STRATEGIES = ("ddp", "fsdp2")
#: ring passes over Ψ per step (all-reduce = 2; all-gather x2 + reduce-scatter = 3)
PASSES = {"ddp": 2, "fsdp2": 3}   # ring passes over Ψ per step: all-reduce = 2; all-gather x2 + reduce-scatter = 3


def paper_bytes(strategy: str, psi: int, n: int, elem: int = 4) -> float:
    """The paper's bytes one rank sends per step: ``2(N-1)/N · Ψ`` (DDP) or ``3(N-1)/N · Ψ`` (FSDP), times
    the element size (fp32: 4); no padding."""
    if strategy not in PASSES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    if not isinstance(n, int) or n < 1 or psi < 0:
        raise ValueError(f"n={n!r} must be an int >= 1 and psi={psi!r} >= 0")
    return PASSES[strategy] * (n - 1) / n * psi * elem


@dataclass(frozen=True)
class Row:
    """One strategy on ``ranks`` ranks with ``batch`` sequences per rank."""

    strategy: str           #: "ddp" or "fsdp2"
    ranks: int              #: N
    batch: int              #: sequences per rank (fixed across rows: weak scaling)
    counts: dict            #: collectives of one step on rank 0, by op
    wire: float             #: wire bytes of that step on rank 0, from the ledger (ring formulas per record)
    exact: float            #: costs.step_cost's bytes (FSDP2's padding included)
    paper: float            #: :func:`paper_bytes` (no padding)
    state: int              #: model state on rank 0, measured (bytes)
    state_formula: float    #: 16Ψ (DDP) or 16Ψpad/N (FSDP)
    step_s: float           #: median step time of the slowest rank (a clock: read it, never assert it)
    psi: int                #: Ψ, parameter elements
    psi_padded: int         #: Ψ as FSDP2 gathers it (rows padded to a multiple of N)


def row(strategy: str, cfg, ranks: int, batch: int, steps: int = 10, warmup: int = 2) -> Row:
    """Measure one row (:class:`Row`): ``ranks`` gloo ranks (NCCL with a GPU each), ``batch`` sequences each."""
    from course_lib.bench import fsdp
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    if batch < 1 or ranks < 1:
        raise ValueError(f"batch={batch} and ranks={ranks} must be >= 1 (sequences per rank, ranks)")
    r = fsdp.measure(strategy, cfg, ranks=ranks, steps=steps, warmup=warmup, batch=batch * ranks)
    return Row(strategy, ranks, batch, r["counts"], r["wire"], r["formula"], paper_bytes(strategy, r["psi"], ranks),
               r["state"], r["state_formula"], r["median_s"], r["psi"], r["psi_padded"])


def rows(cfg, batch: int = 4, ranks=(1, 2, 4), strategies=STRATEGIES, steps: int = 10, warmup: int = 2,
         progress=None) -> list[Row]:
    """Every strategy at every world size in ``ranks``, the batch per rank fixed at ``batch``."""
    out = []
    for n in ranks:
        for s in strategies:
            out.append(row(s, cfg, n, batch, steps, warmup))
            if progress is not None:
                progress.update(1)
    return out


def format_table(rs: list[Row], times: bool = False) -> str:
    """The deterministic columns (bytes, counts, state); with ``times`` the clock's columns too."""
    head = (f"{'strategy':<7}{'N':>3}{'AG':>4}{'RS':>4}{'AR':>4}{'ledger B/step':>15}{'step_cost B':>13}"
            f"{'paper B':>11}{'÷ paper':>8}{'state B':>11}{'16Ψ(/N) B':>11}")
    if times:
        head += f"{'step ms':>9}{'seq/s':>8}{'weak eff.':>10}"
    lines = [head, "-" * len(head)]
    base = {r.strategy: r.step_s for r in rs if r.ranks == 1}
    for r in rs:
        c = r.counts
        line = (f"{r.strategy:<7}{r.ranks:>3}{c.get('all_gather', 0):>4}{c.get('reduce_scatter', 0):>4}"
                f"{c.get('all_reduce', 0):>4}{r.wire:>15,.0f}{r.exact:>13,.0f}{r.paper:>11,.0f}"
                f"{(r.wire / r.paper if r.paper else 1.0):>8.4f}{r.state:>11,}{r.state_formula:>11,.0f}")
        if times:
            eff = f"{base[r.strategy] / r.step_s:>10.0%}" if r.strategy in base else f"{'':>10}"
            line += f"{r.step_s * 1e3:>9.1f}{r.ranks * r.batch / r.step_s:>8.0f}{eff}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    from course_lib.bench.step_time import lab_cfg
    ap = argparse.ArgumentParser(prog="python -m course_lib bench weak-scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank (fixed: weak scaling)")
    ap.add_argument("--width", type=int, default=128, help="d_model of Lab 08's GPT (2 blocks, 64 tokens)")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args(argv)
    rs = rows(lab_cfg(a.width), a.batch, tuple(a.ranks), steps=a.steps)
    print(f"weak scaling: {a.batch} sequences of 64 tokens per rank, d = {a.width}, Ψ = {rs[0].psi:,}")
    print(format_table(rs, times=True))
    bad = [f"{r.strategy} N={r.ranks}" for r in rs if r.wire != r.exact]
    if bad:
        print("ledger != step_cost for: " + ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
