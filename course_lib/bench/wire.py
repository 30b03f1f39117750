"""What actually crosses the wire, and how long it takes: loopback byte counters and the α-β sweep.

:mod:`course_lib.maths.costs` says what a collective *should* send (the ring formula, the algorithm's
floor). This module measures what an implementation *does* send, where the machine lets us see it:

* **loopback counters** -- on Linux, gloo ranks on one machine talk TCP over the loopback interface
  ``lo``, and ``/proc/net/dev`` counts every byte it carries. One reading covers the whole machine, so
  a difference around one collective is the bytes sent by *all* ranks together (``N`` × the per-rank
  formula) -- plus TCP/IP headers, plus whatever other processes sent at the same moment. Hence the
  protocol of :func:`measure_on_rank`: read, barrier, op, barrier, read; subtract a baseline measured
  the same way around no op (the two barriers' own bytes); repeat, and keep the cleanest window.
* **timings** -- :func:`measure_on_rank` also times the op on every rank; :func:`time_collectives`
  sweeps sizes × ops, and :func:`calibrate_alpha_beta` fits ``t = α + β · wire_bytes``
  (:func:`course_lib.maths.costs.fit_alpha_beta`) for Lab 08 to predict step times with.

Sizes are payloads ``V`` in the ledger's convention (all-gather: the gathered output; reduce-scatter:
the full input; all-reduce and broadcast: the tensor), float32, a multiple of ``4 · N`` bytes.

Longer than ~300 lines: the byte counters and the timing sweep share the rank-side code that
issues each collective; splitting them would duplicate it.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from course_lib.maths.costs import AlphaBeta, fit_alpha_beta, wire_bytes

__all__ = [
    "loopback_counters", "loopback_bytes", "loopback_available", "parse_net_dev", "TCP_HEADER_BYTES",
    "OPS", "DEFAULT_SIZES", "measure_on_rank", "measure_wire", "WireMeasurement",
    "time_collectives", "Sweep", "calibrate_alpha_beta", "Calibration",
]

NET_DEV = Path("/proc/net/dev")
#: Bytes of headers per packet on ``lo`` as /proc/net/dev counts them: Ethernet 14 + IPv4 20 +
#: TCP 20 + the timestamp option 12 (Linux's default). A pure ACK is exactly this; a data segment
#: carries it in front of up to ~64 KiB of payload (lo's MTU is 65536).
TCP_HEADER_BYTES = 66
OPS = ("broadcast", "all_reduce", "all_gather", "reduce_scatter")
KiB, MiB = 1024, 1024 * 1024
#: 4 KiB .. 4 MiB, ×4 apart: from latency-bound to bandwidth-bound on loopback.
DEFAULT_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)


# -- the counters ------------------------------------------------------------------------------------
def parse_net_dev(text: str, interface: str = "lo") -> tuple[int, int]:
    """``(tx_bytes, tx_packets)`` of ``interface`` from the text of ``/proc/net/dev``.

    On ``lo`` every byte sent is also received, so TX alone counts each byte once.
    """
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == interface:
            cols = rest.split()  # rx: bytes packets errs drop fifo frame compressed multicast; tx: bytes packets ...
            if len(cols) < 10:
                raise ValueError(f"/proc/net/dev line for {interface!r} has {len(cols)} columns, expected 16")
            return int(cols[8]), int(cols[9])
    raise ValueError(f"no interface {interface!r} in /proc/net/dev (interfaces: "
                     f"{[ln.split(':')[0].strip() for ln in text.splitlines() if ':' in ln]})")


def loopback_counters(interface: str = "lo") -> tuple[int, int]:
    """``(bytes, packets)`` sent so far on the loopback interface, machine-wide (Linux only)."""
    return parse_net_dev(NET_DEV.read_text(), interface)


def loopback_bytes(interface: str = "lo") -> int:
    """Bytes sent so far on the loopback interface, by every process on the machine (Linux only)."""
    return loopback_counters(interface)[0]


def loopback_available() -> bool:
    """True where :func:`loopback_bytes` works (Linux with ``/proc/net/dev`` listing ``lo``)."""
    try:
        loopback_counters()
        return True
    except (OSError, ValueError):
        return False


# -- one collective, on every rank -------------------------------------------------------------------
def _issuer(op: str, nbytes: int, device: str = "cpu"):
    """A zero-argument function issuing ``op`` on payload ``nbytes`` (float32) of buffers on ``device``."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    if op not in OPS:
        raise ValueError(f"op={op!r}; expected one of {OPS}")
    if nbytes <= 0 or nbytes % (4 * n):
        raise ValueError(f"nbytes={nbytes} must be a positive multiple of 4 * N = {4 * n} "
                         f"(float32 elements, split evenly over N={n} ranks)")
    numel = nbytes // 4
    # torch 2.13 renamed the tensor forms (all_gather_single); older torch has only the old names.
    from course_lib.comm.shim import ALL_GATHER as gather, REDUCE_SCATTER as scatter
    # zeros: repeated sums stay finite
    full, shard = torch.zeros(numel, device=device), torch.zeros(numel // n, device=device)
    return {
        "broadcast": lambda: dist.broadcast(full, src=0),
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: gather(full, shard),
        "reduce_scatter": lambda: scatter(shard, full),
    }[op]


def measure_on_rank(op, nbytes: int, repeats: int = 5, iters: int = 1, count_wire: bool = True,
                    device: str | None = None) -> dict:
    """Run inside ``course_lib.run``: time ``op`` on payload ``nbytes`` and (rank 0) count lo's bytes.

    Per repeat, twice -- once around nothing (the *baseline*), once around ``iters`` back-to-back ops::

        rank 0 reads lo -> barrier -> [op × iters, timed on every rank] -> barrier -> rank 0 reads lo

    The barriers make the window hold every rank's op and nothing else of ours; their own bytes are in
    the baseline too (skipped when ``count_wire`` is False: timing only). ``op`` may be a tuple of ops:
    they are then interleaved (op A, op B, ..., op A, ...), so that a burst of someone else's traffic
    spoils one window of each op rather than every window of one.

    ``device``: where the buffers live; default the rank's own (``"cpu"`` under gloo, ``"cuda:<i>"``
    under NCCL, where the time includes a ``cuda.synchronize``). CPU tensors always go through gloo,
    even in an NCCL run -- that is what :func:`measure_wire` counts.

    Returns ``{"seconds": [per-op seconds, one per repeat], "bytes": [...], "packets": [...],
    "base_bytes": [...], "base_packets": [...]}`` (counters on rank 0 only, else empty), or for a tuple
    of ops ``{op: that dict}``. The barriers are not recorded in the ledger; the ops are.
    """
    import time

    import torch
    import torch.distributed as dist

    from course_lib.comm import torch_ledger as lt
    from course_lib.launch import rank_info

    ops = (op,) if isinstance(op, str) else tuple(op)
    device = device or rank_info().device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    issuers = {o: _issuer(o, nbytes, device) for o in ops}
    for issue in issuers.values():
        issue()  # warm-up: first use of a buffer size allocates (NCCL: builds its communicator)
    sync()
    reading = count_wire and dist.get_rank() == 0
    out = {o: {k: [] for k in ("seconds", "bytes", "packets", "base_bytes", "base_packets")} for o in ops}
    for _ in range(repeats):
        for o, issue in issuers.items():
            for kind in ("base", "op") if count_wire else ("op",):
                c0 = loopback_counters() if reading else (0, 0)
                with lt.paused():
                    dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters if kind == "op" else 0):
                    issue()
                sync()
                t1 = time.perf_counter()
                with lt.paused():
                    dist.barrier()
                c1 = loopback_counters() if reading else (0, 0)
                prefix = "base_" if kind == "base" else ""
                if kind == "op":
                    out[o]["seconds"].append((t1 - t0) / iters)
                if reading:
                    out[o][prefix + "bytes"].append((c1[0] - c0[0]) / iters)
                    out[o][prefix + "packets"].append((c1[1] - c0[1]) / iters)
    return out[op] if isinstance(op, str) else out


@dataclass(frozen=True)
class WireMeasurement:
    """One collective on loopback: bytes counted on ``lo`` (all ranks together) vs the ring formula."""

    op: str
    nbytes: int              #: payload V per rank
    world_size: int
    measured_bytes: float    #: lo's TX bytes in the cleanest window, baseline (barriers) subtracted
    packets: float           #: the same for packets
    seconds: float           #: median over repeats of the slowest rank's time for one op

    @property
    def formula_bytes(self) -> float:
        """Ring formula summed over ranks: ``N · costs.wire_bytes(op, V, N)``."""
        return self.world_size * wire_bytes(self.op, self.nbytes, self.world_size)

    @property
    def header_bytes(self) -> float:
        """TCP/IP/Ethernet headers in ``measured_bytes``: ``packets · TCP_HEADER_BYTES``."""
        return self.packets * TCP_HEADER_BYTES

    @property
    def ratio(self) -> float:
        """measured / formula: 1.0 means the implementation sends what the ring algorithm sends."""
        return self.measured_bytes / self.formula_bytes

    @property
    def ratio_without_headers(self) -> float:
        return (self.measured_bytes - self.header_bytes) / self.formula_bytes


def _net(values, base) -> float:
    """Our bytes in a window: the smallest op window minus the smallest baseline window.

    Other processes can only *add* loopback bytes to a window, never remove ours, so the noise is
    one-sided and the cleanest window is the smallest one: a minimum survives even when most windows
    were hit, where a median needs more than half of them clean.
    """
    return min(values) - min(base)


def measure_wire(ops=OPS, nbytes: int = 4 * MiB, world_size: int = 4, repeats: int = 5) -> list[WireMeasurement]:
    """Measure each op in ``ops`` ``repeats`` times (interleaved) on ``world_size`` ranks, on CPU tensors.

    Bytes: see :func:`_net` (baseline subtracted, smallest window); time: the median over repeats of
    the slowest rank. The buffers are CPU tensors, so this measures gloo even on a GPU box (NCCL's
    traffic goes over NVLink or the network, which ``lo`` never sees). Raises ``RuntimeError`` where
    loopback cannot be read, or under ``torchrun`` (ranks may be on other machines).
    """
    from course_lib.launch import run

    if not loopback_available():
        raise RuntimeError("loopback byte counters need Linux's /proc/net/dev with an 'lo' interface; "
                           "on this machine only the formula (course_lib.maths.costs.wire_bytes) is available")
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    result = run(measure_on_rank, ops, nbytes, repeats, 1, True, "cpu", world_size=world_size)
    if result.backend == "torchrun":
        raise RuntimeError("under torchrun the ranks may be on several machines, and lo counts one machine's "
                           "loopback only; measure with course_lib.run's local ranks")
    out = []
    for op in ops:
        r0 = result[0][op]
        slowest = [max(result[r][op]["seconds"][k] for r in range(world_size)) for k in range(repeats)]
        out.append(WireMeasurement(op, nbytes, world_size,
                                   measured_bytes=_net(r0["bytes"], r0["base_bytes"]),
                                   packets=_net(r0["packets"], r0["base_packets"]),
                                   seconds=statistics.median(slowest)))
    return out


# -- the α-β sweep -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sweep:
    """Seconds per op (slowest rank, median over repeats) for every size, per op, and their spread."""

    world_size: int
    sizes: tuple[int, ...]                  #: payloads V in bytes
    seconds: dict = field(default_factory=dict)   #: op -> tuple of seconds, one per size
    backend: str = "gloo"                   #: what the ranks ran on: "gloo" (CPU) or "nccl" (GPUs)
    spread: dict = field(default_factory=dict)    #: op -> tuple of max/min over the repeats, per size

    def wire(self, op: str) -> list[float]:
        """Per-rank ring wire bytes of ``op`` at every size (the x of an α-β fit)."""
        return [wire_bytes(op, v, self.world_size) for v in self.sizes]

    def fit(self, op: str) -> AlphaBeta:
        """``t = α + β · wire_bytes`` fitted to this op's points."""
        return fit_alpha_beta(self.wire(op), self.seconds[op])


def _iters_for(nbytes: int) -> int:
    """Back-to-back ops per timed window: many for tiny messages (µs each), one for MiBs."""
    return max(1, min(4, (256 * KiB) // nbytes))


def _sweep_on_rank(ops, sizes, repeats) -> dict:
    """Rank side of :func:`time_collectives`: buffers on the rank's own device (CPU, or its GPU)."""
    return {(op, v): measure_on_rank(op, v, repeats, _iters_for(v), count_wire=False)["seconds"]
            for op in ops for v in sizes}


def time_collectives(sizes=DEFAULT_SIZES, ops=("all_reduce", "all_gather", "reduce_scatter"),
                     world_size: int = 4, repeats: int = 3, backend: str | None = None) -> Sweep:
    """Time every op at every size on ``world_size`` ranks in one launched call; see :class:`Sweep`.

    Buffers live on each rank's device: CPU tensors over gloo here, GPU tensors over NCCL on a box with
    a GPU per rank. ``backend="gloo"`` forces CPU.
    """
    from course_lib.launch import run

    ops, sizes = tuple(ops), tuple(int(v) for v in sizes)
    result = run(_sweep_on_rank, ops, sizes, repeats, world_size=world_size, backend=backend, timeout=120)
    seconds, spread = {}, {}
    for op in ops:
        per_size, ratios = [], []
        for v in sizes:
            slowest = [max(result[r][(op, v)][k] for r in range(world_size)) for k in range(repeats)]
            per_size.append(statistics.median(slowest))
            ratios.append(max(slowest) / max(min(slowest), 1e-12))
        seconds[op], spread[op] = tuple(per_size), tuple(ratios)
    return Sweep(world_size, sizes, seconds, result.backend, spread)


@dataclass(frozen=True)
class Calibration:
    """An α-β model of one op on this machine, and the sweep it was fitted to."""

    op: str
    world_size: int
    backend: str
    alpha_beta: AlphaBeta
    sweep: Sweep

    def predict(self, nbytes: float, op: str | None = None) -> float:
        """Seconds for one ``op`` (default: the calibrated one) of payload ``nbytes`` on these ranks."""
        return self.alpha_beta.predict(op or self.op, nbytes, self.world_size)


def calibrate_alpha_beta(world_size: int = 4, sizes=DEFAULT_SIZES, op: str = "all_reduce",
                         repeats: int = 3, backend: str | None = None, sweep: Sweep | None = None) -> Calibration:
    """Fit ``t = α + β · wire_bytes`` for ``op`` on ``world_size`` ranks of this machine.

    Times ``op`` at ``sizes`` (median of ``repeats``) unless a :class:`Sweep` that has it is passed.
    Lab 00 calls it and plots the fit; Lab 08 calls it again to predict step times
    (``calibration.alpha_beta.step_seconds(costs.step_cost(...))``). Timings are this machine's, at
    this moment: on a shared 2-core laptop they wobble by tens of percent.
    """
    if sweep is None:
        sweep = time_collectives(sizes, (op,), world_size, repeats, backend)
    elif op not in sweep.seconds or sweep.world_size != world_size:
        raise ValueError(f"the sweep timed {sorted(sweep.seconds)} on {sweep.world_size} ranks; "
                         f"it cannot calibrate {op!r} on {world_size}")
    return Calibration(op, world_size, sweep.backend, sweep.fit(op), sweep)
