"""Calibrate the step-time model on this machine, predict DP / FSDP / HSDP steps, then measure them.

    python -m course_lib bench step-time [--ranks N] [--repeats 9] [--steps 15] [--rounds 3]

Without ``--ranks`` it runs the lab's :data:`CONFIGS` (2 and 4 ranks); ``--ranks N`` (2..8) runs
:func:`configs_for` ``N`` instead: DP, FSDP at two widths and batches, and HSDP when ``N`` has a divisor.

1. **Communication**: every op FSDP, HSDP and DDP issue, on the groups they issue it on, timed at 4 sizes
   (warm-up first, ``repeats`` windows, the slowest rank's time per window); ``α + β · wire`` fitted per op
   and group size with :func:`course_lib.bench.wire.calibrate_alpha_beta`. The spread (max/min) is reported.
2. **Compute**: the plain course GPT (no collective) stepped on every rank at once -- the ranks share this
   machine's cores exactly as they will in the real runs -- at two widths; ``overhead + FLOPs / rate`` fitted.
   Then γ, FSDP2's own work per collective, from FSDP runs at a width no test uses, and δ, DDP's own work
   per bucket, from a DP run at that width (:func:`calibrate`).
3. **Predict** (:func:`course_lib.maths.step_model.predict`) the configurations of :data:`CONFIGS` *before*
   running them, then **measure** each: median over ``steps`` timed steps of the slowest rank.

Prints predicted vs measured and the worst ratio; the course's goal is every ratio within 0.75-1.25.
Timings on a shared CPU wobble: take them under the course's CPU lock, read them, never assert them.
``COURSE_LIB_QUICK=1`` caps the windows and steps (:data:`QUICK_REPEATS`, :data:`QUICK_STEPS`): the test suite's
runs of Lab 08 (solution and lab), which check that every cell runs, not what it measures.

Longer than ~300 lines: calibration, prediction and measurement share the rank-side step loop and the
configurations; apart, each half would import the other.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from dataclasses import dataclass

from course_lib.maths import step_model
from course_lib.maths.costs import AlphaBeta

__all__ = ["Config", "CONFIGS", "configs_for", "group_payload", "CALIBRATION_WIDTHS", "CALIBRATE_STAGES", "Calibration", "calibrate", "calibrate_comm",
           "calibrate_compute", "measure", "predict_all", "run_all", "format_table", "lab_cfg", "main"]

KiB = 1024
COMM_SIZES = (16 * KiB, 128 * KiB, 1024 * KiB, 4096 * KiB)
COMM_OPS = ("all_gather", "reduce_scatter", "all_reduce")


#: ``COURSE_LIB_QUICK=1``: at most this many timed windows per size and timed steps per run. The same code runs,
#: with noisier numbers: for a run that checks a lab works, not what it measures (the test suite's runs of Lab 08,
#: whose timing cells nbval never compares; ``make solutions`` runs in full).
QUICK_REPEATS, QUICK_STEPS = 3, 4


def _quick(n: int, at_most: int) -> int:
    return min(n, at_most) if os.environ.get("COURSE_LIB_QUICK") == "1" else n


def lab_cfg(width: int, layers: int = 2, seq_len: int = 64):
    """The course GPT at ``width``: d_ff = 4·width, 4 heads, the lab vocabulary (67)."""
    from course_lib.models.config import GPTConfig
    return GPTConfig(vocab_size=67, seq_len=seq_len, d_model=width, n_heads=4, n_layers=layers, d_ff=4 * width)


#: what :func:`measure` can run: the step model's strategies, plus Lab 02's ZeRO-1/2 (the frontier of Lab 08)
MEASURABLE = step_model.STRATEGIES + ("zero1", "zero2")


@dataclass(frozen=True)
class Config:
    """One configuration to predict and measure."""

    strategy: str        #: "dp", "fsdp" or "hsdp" (predicted and measured); "zero1", "zero2" (measured)
    world_size: int      #: N ranks
    batch: int           #: global batch, sequences (batch / N per rank)
    width: int           #: d_model of :func:`lab_cfg`
    replicate: int = 1   #: HSDP's R (mesh (R, N / R))

    def __post_init__(self):
        if self.strategy not in MEASURABLE or self.batch % self.world_size:
            raise ValueError(f"strategy={self.strategy!r} must be one of {MEASURABLE} and batch("
                             f"{self.batch}) a multiple of world_size({self.world_size})")

    @property
    def label(self) -> str:
        mesh = f" {self.replicate}x{self.world_size // self.replicate}" if self.strategy == "hsdp" else ""
        return f"{self.strategy}{mesh} N={self.world_size} B={self.batch} d={self.width}"


CONFIGS = (Config("dp", 4, 16, 128), Config("fsdp", 4, 16, 128), Config("hsdp", 4, 16, 128, replicate=2),
           Config("fsdp", 2, 8, 256), Config("fsdp", 4, 64, 64))
CALIBRATION_WIDTHS = (48, 160, 320)   #: bracket every tested width: the line is fitted, not extrapolated




def configs_for(n: int) -> tuple[Config, ...]:
    """The lab's five kinds of configuration on ``n`` ranks (2..8): DP and FSDP at width 128 with 4 sequences
    per rank, HSDP on an (R, n / R) mesh when ``n`` has a divisor 1 < R < n (R the smallest), FSDP at width 256
    with 2 per rank, and FSDP at width 64 with 16 per rank."""
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= 8:
        raise ValueError(f"ranks={n!r} must be an int from 2 to 8 (this machine's gloo ranks); e.g. --ranks 3")
    out = [Config("dp", n, 4 * n, 128), Config("fsdp", n, 4 * n, 128)]
    r = next((k for k in range(2, n) if n % k == 0), None)
    if r:
        out.append(Config("hsdp", n, 4 * n, 128, replicate=r))
    return tuple(out + [Config("fsdp", n, 2 * n, 256), Config("fsdp", n, 16 * n, 64)])


def group_payload(v: int, group: int) -> int:
    """``v`` bytes rounded down to a payload a group of ``group`` ranks can split evenly (float32 elements):
    an all-gather of 16 KiB over 3 ranks would otherwise gather 3 x 1365 elements into 4096 (gloo refuses)."""
    return (v // (4 * group)) * 4 * group


# -- rank side -------------------------------------------------------------------------------------------
def _build(strategy: str, cfg, replicate: int):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_lib.models import torch_gpt
    from course_lib.strategies.hsdp import torch as hsdp
    n = dist.get_world_size()
    if strategy == "plain":
        return torch_gpt(cfg, seed=0)
    if strategy == "dp":
        return DDP(torch_gpt(cfg, seed=0))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = hsdp.hsdp_mesh(replicate, n // replicate) if strategy == "hsdp" else init_device_mesh("cpu", (n,))
    return hsdp.build_gpt(cfg, mesh, device=torch.device("cpu"))


def time_steps_on_rank(strategy: str, cfg, local_batch: int, steps: int, warmup: int = 2, replicate: int = 1) -> list:
    """Every rank: ``warmup`` + ``steps`` training steps (forward, backward, AdamW); seconds per timed step.
    ``strategy="plain"`` steps a local model with no collective at all: the compute-only calibration."""
    import time

    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.models import TokenTask, loss_fn
    torch.manual_seed(0)
    if strategy in ("zero1", "zero2"):      # Lab 02's ZeRO: a local model, the sharded Adam steps it
        from course_lib.models import torch_gpt
        from course_lib.strategies.zero.torch import ZeRO
        model = torch_gpt(cfg, seed=0)
        opt = ZeRO(model, int(strategy[-1]), units=[*model.blocks, model], lr=1e-3)
    else:
        model = _build(strategy, cfg, replicate)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task, r = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0), dist.get_rank()
    x, y = (torch.from_numpy(a) for a in task.rank_batch(0, local_batch * dist.get_world_size(), r,
                                                          dist.get_world_size()))
    times = []
    for s in range(warmup + steps):
        with lt.paused():
            dist.barrier()        # every rank starts the step together; not part of the step
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _slowest(result, steps: int) -> list[float]:   # the slowest rank sets the pace of every step
    return [max(rank[i] for rank in result) for i in range(steps)]


# -- calibration -------------------------------------------------------------------------------------------
def _groups(n: int, replicate: int):
    """Rank side: {"world": None, "shard": my row group, "replicate": my column group} of an R x F mesh."""
    import torch.distributed as dist

    from course_lib.strategies.hsdp import torch as hsdp
    out, r = {"world": None}, dist.get_rank()
    if 1 < replicate < n:
        for kind, groups in (("shard", hsdp.shard_groups(replicate, n // replicate)),
                             ("replicate", hsdp.replica_groups(replicate, n // replicate))):
            for g in groups:            # every rank creates every group, in the same order
                pg = dist.new_group(g)
                if r in g:
                    out[kind] = (pg, len(g))
    return out


def comm_sweep_on_rank(plan, sizes, repeats: int, replicate: int = 1) -> dict:
    """Every rank: time each ``(op, group kind)`` of ``plan`` at every payload size, all groups of a kind at once
    (as HSDP runs them): one warm-up, then ``repeats`` windows between unrecorded barriers."""
    import time

    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.comm.shim import ALL_GATHER, REDUCE_SCATTER
    n = dist.get_world_size()
    groups = _groups(n, replicate)
    out = {}
    for op, kind in plan:
        pg, g = groups[kind] if groups[kind] else (None, n)
        for v in sizes:
            elems = group_payload(v, g) // 4          # a multiple of g: every shard the same size
            full, shard = torch.zeros(elems), torch.zeros(elems // g)
            issue = {"all_gather": lambda: ALL_GATHER(full, shard, group=pg),
                     "reduce_scatter": lambda: REDUCE_SCATTER(shard, full, group=pg),
                     "all_reduce": lambda: dist.all_reduce(full, group=pg)}[op]
            issue()
            times = []
            for _ in range(repeats):
                with lt.paused():
                    dist.barrier()
                t0 = time.perf_counter()
                issue()
                times.append(time.perf_counter() - t0)
            out[(op, kind, v)] = times
    return out


def calibrate_comm(world_size: int, replicate: int = 1, ops=COMM_OPS, sizes=COMM_SIZES, repeats: int = 5):
    """``(CommModel, spread)`` for runs on ``world_size`` ranks: α-β per (op, group size), fitted by
    :func:`course_lib.bench.wire.calibrate_alpha_beta` on the median over ``repeats`` windows of the slowest
    rank; with ``replicate`` R > 1 also HSDP's groups (all-gather and reduce-scatter in the shard groups,
    all-reduce in the replicate groups), timed *all at once*, as HSDP runs them. ``spread[(op, group)]`` is
    the worst max/min over a size's windows."""
    from course_lib.bench import wire
    from course_lib.launch import run
    repeats = _quick(repeats, QUICK_REPEATS)
    plan = [(op, "world") for op in ops]
    if 1 < replicate < world_size:
        plan += [("all_gather", "shard"), ("reduce_scatter", "shard"), ("all_reduce", "replicate")]
    raw = run(comm_sweep_on_rank, plan, tuple(sizes), repeats, replicate, world_size=world_size, timeout=300)
    fits, spread = {}, {}
    for op, kind in plan:
        g = world_size if kind == "world" else (world_size // replicate if kind == "shard" else replicate)
        per_size, worst = [], 1.0
        for v in sizes:
            win = [max(raw[r][(op, kind, v)][k] for r in range(world_size)) for k in range(repeats)]
            per_size.append(statistics.median(win))
            worst = max(worst, max(win) / min(win))
        real = tuple(group_payload(v, g) for v in sizes)     # the bytes actually moved, for the fit
        sweep = wire.Sweep(g, real, {op: tuple(per_size)}, raw.backend)
        fits[(op, g)] = wire.calibrate_alpha_beta(g, real, op, sweep=sweep).alpha_beta
        spread[(op, g)] = worst
    return step_model.CommModel(fits), spread


def calibrate_compute(world_size: int, widths=CALIBRATION_WIDTHS, local_batch: int = 4, steps: int = 5):
    """``(ComputeModel, points)``: plain steps on ``world_size`` ranks at once at each width; ``points`` are
    ``(flops, median seconds, max/min)`` per width."""
    from course_lib.launch import run
    steps = _quick(steps, QUICK_STEPS)
    points = []
    for w in widths:
        cfg = lab_cfg(w)
        res = run(time_steps_on_rank, "plain", cfg, local_batch, steps, world_size=world_size, timeout=300)
        t = _slowest(res, steps)
        points.append((step_model.train_flops(cfg, local_batch * cfg.seq_len), statistics.median(t), max(t) / min(t)))
    return step_model.ComputeModel.fit([p[0] for p in points], [p[1] for p in points]), points


@dataclass(frozen=True)
class Calibration:
    """Everything measured on ``world_size`` ranks before predicting: α-β per (op, group), compute, γ."""

    world_size: int
    comm: step_model.CommModel
    comm_spread: dict
    compute: step_model.ComputeModel
    compute_points: list
    per_collective_s: float     #: γ, FSDP2's own work per all-gather / reduce-scatter, from FSDP runs at width 96
    ddp_per_bucket_s: float = 0.0   #: δ, DDP's own work per bucket all-reduce, from a DP run at width 96 (0: not probed)


def _dp_all_reduces(pred) -> int:
    return sum(o.count for o in pred.cost.ops if o.op == "all_reduce")


#: How many stages :func:`calibrate` reports to its ``progress`` bar (collectives, compute, two γ probes; + δ with ddp).
CALIBRATE_STAGES = 4


def calibrate(world_size: int, replicate: int = 1, repeats: int = 9, steps: int = 10, ddp: bool = False,
              progress=None) -> Calibration:
    """Collectives, then compute, then two FSDP runs at width 96 for γ (no tested configuration uses it); with
    ``ddp``, one DP run at width 96 for δ, DDP's own work per bucket.

    δ is to DDP what γ is to FSDP2: what the c10d α-β and the plain compute leave unexplained in a real step,
    per all-reduce call -- the reducer's hooks, its copies of gradients into and out of the bucket, and the
    bucket's all-reduce competing with backward for the cores (DDP starts it while backward still runs; with
    fewer cores than ranks the two share them). It is not a term of the course's step model (Lab 08 teaches
    γ alone): the bench adds it to DP's prediction, and prints it.

    ``progress``: a tqdm bar (:func:`course_lib.bench.progress.bar`) told each stage as it starts and advanced by one
    as it ends (:data:`CALIBRATE_STAGES` stages, one more with ``ddp``)."""
    def stage(what: str, fn):
        if progress is not None:
            progress.set_postfix_str(f"N={world_size}: {what}")
        out = fn()
        if progress is not None:
            progress.update(1)
        return out
    comm, spread = stage("collectives (α, β)", lambda: calibrate_comm(world_size, replicate, repeats=repeats))
    compute, points = stage("compute rate", lambda: calibrate_compute(world_size, steps=steps))
    gammas = []
    for local in (2, 8):                # two probes, averaged: γ is a residual and carries their noise
        probe = Config("fsdp", world_size, local * world_size, 96)
        pred = step_model.predict("fsdp", lab_cfg(96), world_size, probe.batch, compute, comm, root_unit=0)
        gammas.append(step_model.fit_framework_overhead(stage(f"γ probe, batch {local}/rank",
                                                              lambda: measure(probe, steps))[0], pred))
    gamma = sum(gammas) / len(gammas)
    delta = 0.0
    if ddp:
        probe = Config("dp", world_size, 4 * world_size, 96)
        pred = step_model.predict("dp", lab_cfg(96), world_size, probe.batch, compute, comm)
        delta = max(0.0, (stage("δ probe (DDP)", lambda: measure(probe, steps))[0] - pred.step_s)
                    / _dp_all_reduces(pred))
    return Calibration(world_size, comm, spread, compute, points, gamma, delta)


def predict_all(configs, calibrations: dict) -> list:
    """``step_model.predict`` for every config with its world size's :class:`Calibration`.
    FSDP2 leaves its root unsharded after forward by default: ``root_unit=0``."""
    out = []
    for c in configs:
        cal = calibrations[c.world_size]
        p = step_model.predict(c.strategy, lab_cfg(c.width), c.world_size, c.batch, cal.compute, cal.comm,
                               replicate=c.replicate, root_unit=None if c.strategy == "dp" else 0,
                               per_collective_s=cal.per_collective_s)
        if c.strategy == "dp":          # DDP's own work (δ, see calibrate) in the framework term
            p = dataclasses.replace(p, framework_s=cal.ddp_per_bucket_s * _dp_all_reduces(p))
        out.append(p)
    return out


def measure(config: Config, steps: int = 8) -> tuple[float, float]:
    """``(median, max/min)`` of the slowest rank's step time over ``steps`` timed steps."""
    from course_lib.launch import run
    steps = _quick(steps, QUICK_STEPS)
    res = run(time_steps_on_rank, config.strategy, lab_cfg(config.width), config.batch // config.world_size, steps,
              2, config.replicate, world_size=config.world_size, timeout=300)
    t = _slowest(res, steps)
    return statistics.median(t), max(t) / min(t)


def run_all(configs=CONFIGS, repeats: int = 9, steps: int = 15, rounds: int = 1, progress=None) -> dict:
    """``rounds`` times: calibrate every world size, predict every config (before measuring any), measure it.
    Returns per-round lists and the calibrations of the last round; :func:`format_table` takes medians."""
    tick = progress or (lambda what: None)
    preds, measured = [], []
    for k in range(rounds):
        cals = {}
        for n in sorted({c.world_size for c in configs}):
            tick(f"round {k + 1}: calibrating on {n} ranks")
            r = max([c.replicate for c in configs if c.world_size == n] + [1])
            ddp = any(c.strategy == "dp" for c in configs if c.world_size == n)
            cals[n] = calibrate(n, r, repeats, steps, ddp=ddp)
        preds.append(predict_all(configs, cals))       # written down before any of them is measured
        measured.append([])
        for c in configs:
            tick(f"round {k + 1}: measuring {c.label}")
            measured[-1].append(measure(c, steps))
    return {"configs": list(configs), "predictions": preds, "measured": measured, "calibrations": cals}


def format_table(out: dict) -> str:
    lines = ["α-β fits of the last round (per op and group size; spread = worst max/min of a size's windows):"]
    for n, cal in out["calibrations"].items():
        for (op, g), ab in sorted(cal.comm.fits.items(), key=lambda kv: (-kv[0][1], kv[0][0])):
            lines.append(f"  N={n} {op:<15} group {g}: α = {ab.alpha_s * 1e6:7.0f} µs, 1/β = "
                         f"{ab.bandwidth_bytes_per_s / 1e9:5.2f} GB/s   spread {cal.comm_spread[(op, g)]:.2f}")
        pts = ", ".join(f"{f / 1e9:.2f} GFLOP: {t * 1e3:.1f} ms (spread {s:.2f})" for f, t, s in cal.compute_points)
        lines.append(f"  N={n} compute, all ranks at once: {cal.compute.overhead_s * 1e3:.1f} ms + FLOPs / "
                     f"{cal.compute.flops_per_s / 1e9:.1f} GFLOP/s  [{pts}]")
        lines.append(f"  N={n} FSDP2's own work per all-gather / reduce-scatter γ = {cal.per_collective_s * 1e3:.2f} ms; "
                     f"DDP's own work per bucket δ = {cal.ddp_per_bucket_s * 1e3:.2f} ms")
    k = len(out["measured"])
    head = (f"{'configuration':<27}{'compute':>9}{'own work':>9}{'comm':>9}{'predicted':>11}{'measured':>10}"
            f"{'spread':>8}{'ratio':>7}")
    lines += ["", f"medians over {k} round(s), each: calibrate, predict, then measure", head, "-" * len(head)]
    med = statistics.median
    ratios = []
    for i, c in enumerate(out["configs"]):
        ps = [out["predictions"][r][i] for r in range(k)]
        pred, m = med(p.step_s for p in ps), med(out["measured"][r][i][0] for r in range(k))
        spread = max(out["measured"][r][i][1] for r in range(k))
        ratios.append(pred / m)
        lines.append(f"{c.label:<27}{med(p.compute_s for p in ps) * 1e3:>7.1f}ms{med(p.framework_s for p in ps) * 1e3:>7.1f}ms"
                     f"{med(p.comm_s for p in ps) * 1e3:>7.1f}ms{pred * 1e3:>9.1f}ms{m * 1e3:>8.1f}ms{spread:>8.2f}"
                     f"{ratios[-1]:>7.2f}")
    worst = max(ratios, key=lambda r: abs(r - 1))
    per_round = [max((out["predictions"][r][i].step_s / out["measured"][r][i][0] for i in range(len(ratios))),
                     key=lambda x: abs(x - 1)) for r in range(k)]
    for r in range(k):                  # every single round, not only the medians: the goal holds per round
        each = "  ".join(f"{out['predictions'][r][i].step_s / out['measured'][r][i][0]:.2f}" for i in range(len(ratios)))
        lines.append(f"round {r + 1} ratios, in the order above: {each}")
    lines.append(f"worst ratio predicted/measured: {worst:.2f} ({'within' if 0.75 <= worst <= 1.25 else 'OUTSIDE'} "
                 f"the ±25% goal); worst of each round: {', '.join(f'{x:.2f}' for x in per_round)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib bench step-time", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=None,
                    help="run configs_for(RANKS) (2..8) instead of the lab's configurations on 2 and 4 ranks")
    ap.add_argument("--repeats", type=int, default=9, help="timed windows per collective size")
    ap.add_argument("--steps", type=int, default=15, help="timed training steps per configuration")
    ap.add_argument("--rounds", type=int, default=3, help="calibrate-predict-measure rounds; medians are printed")
    a = ap.parse_args(argv)
    configs = CONFIGS if a.ranks is None else configs_for(a.ranks)
    out = run_all(configs, a.repeats, a.steps, a.rounds, progress=lambda what: print(f"... {what}", flush=True))
    print(format_table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
