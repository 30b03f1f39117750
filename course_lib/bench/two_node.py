"""A real two-node job on one machine: FSDP vs HSDP across a (throttled) network link, measured and predicted.

    python -m course_lib bench two-node [--rate 100] [--steps 3] [--jax]

Two network namespaces joined by a veth pair (:class:`course_lib.runtime.netns.TwoNodes`) are the two
"nodes". The job starts the way a real two-node job does: **torchrun, two agents, c10d rendezvous**, one
agent per namespace, two workers each::

    ip netns exec <node i> torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=<node 0's address>:<port> --local-addr=<node i's address> \\
        [--rdzv-conf=is_host=1 on node 0] -m course_lib.bench.two_node_worker --out ...
    with GLOO_SOCKET_IFNAME=<node i's veth end>

Without ``--local-addr`` the workers dial the host's address, unreachable from inside a namespace, and hang;
without ``GLOO_SOCKET_IFNAME`` gloo binds the address the hostname resolves to, likewise. The workers
(:mod:`course_lib.bench.two_node_worker`) time FSDP (1-D mesh of 4: every all-gather crosses the link) and
HSDP (mesh (2, 2): shard inside a node, replicate across: only the gradient shard's all-reduce crosses),
and count the bytes on the veth. The JAX variant (``--jax``) runs one process per node with
``jax.distributed.initialize`` and 2 CPU devices each.

**The α-β model, one (α, β) per link class** (:func:`predict`): the workers time 2-rank all-reduces inside
the nodes (loopback) and across them (the veth, both replica pairs at once); :func:`fit_links` fits
``t = α + β·bytes`` for each class, where the bytes are what one rank sends (intra) or what crosses the
link in one direction (inter). A collective's predicted time is its class's α plus β times its bytes: for
a ring over ranks ``g``, each rank sends its ring wire bytes (:func:`course_lib.maths.costs.wire_bytes`)
to the next, so a direction of the link carries that once per ring edge that crosses it, times the number
of groups running at once. A step is predicted as its compute (timed alone) plus every collective, with no
overlap: an upper bound where gloo overlaps, a floor where an implementation sends more than the ring
(gloo's reduce-scatter sends about twice the ring bytes).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from course_lib.maths.costs import AlphaBeta, fit_alpha_beta, wire_bytes
from course_lib.runtime import netns

__all__ = ["run_torch", "run_jax", "fit_links", "link_load", "predict", "format_report", "link_ledger", "main"]

REPO = Path(__file__).resolve().parents[2]
NPROC = 2   # workers per node: 2 nodes x 2 ranks


def _wait(procs, timeout_s: float, what: str, expect_s: float | None = None):
    if expect_s:                        # a job of many seconds: show the clock while it runs (course_lib.bench.progress)
        from course_lib.bench.progress import clock
        with contextlib.suppress(TimeoutError):         # the deadline below words the error
            clock(lambda: all(p.poll() is not None for p in procs), what, expect_s, timeout_s=timeout_s)
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:
            raise TimeoutError(f"{what} did not finish within {timeout_s:g} s (the namespaces and every "
                               "process in them are removed on the way out)") from None
    if any(codes):
        raise RuntimeError(f"{what} failed: exit codes {codes} (node 0, node 1); its output is above")
    return codes


def run_torch(rate_mbit: float | None = 100, *, steps: int = 3, warmup: int = 1, batch: int = 8,
              port: int = 29400, timeout_s: float = 150, quiet: bool = True, kinds=("fsdp", "hsdp"),
              expect_s: float | None = None) -> dict:
    """Two torchrun agents in two namespaces, 2 workers each; returns the workers' measurements plus the
    link's counters (``"link"``) and what was left of our namespaces afterwards (``"left_over"``: ``[]``).
    ``kinds``: which runs (``fsdp``, ``hsdp``, ``tp_in``: FSDP × TP with TP inside a node, ``tp_across``:
    the same with TP across the link). ``expect_s``: show a progress clock against this usual duration."""
    with tempfile.TemporaryDirectory(prefix="two_node_") as tmp, netns.TwoNodes(rate_mbit=rate_mbit) as net:
        out = os.path.join(tmp, "result.json")
        a = net.nodes[0]
        procs = []
        for node in net.nodes:
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={NPROC}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={a.addr}:{port}", "--rdzv-id=lab06",
                    f"--local-addr={node.addr}", "--max-restarts=0"]
            if node.index == 0:
                argv.append("--rdzv-conf=is_host=1")   # this agent hosts the rendezvous store
            argv += ["-m", "course_lib.bench.two_node_worker", "--out", out, "--steps", str(steps),
                     "--warmup", str(warmup), "--batch", str(batch), "--kinds", *kinds]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.iface, "OMP_NUM_THREADS": "1",
                   "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(REPO)}
            procs.append(net.popen(node, argv, env=env, cwd=str(REPO), stdout=_output(quiet),
                                   stderr=_output(quiet)))
        t0 = time.perf_counter()
        _wait(procs, timeout_s, "the two-node torchrun job", expect_s)
        result = json.loads(Path(out).read_text())
        result.update(seconds=time.perf_counter() - t0, link=net.link_bytes(), rate_mbit=rate_mbit,
                      nodes_desc=[(n.netns, n.iface, n.addr) for n in net.nodes], subnet=str(net.subnet))
    result["left_over"] = netns.ours()
    return result


def run_jax(rate_mbit: float | None = 100, *, steps: int = 3, warmup: int = 1, batch: int = 32,
            port: int = 29500, timeout_s: float = 150, quiet: bool = True, expect_s: float | None = None) -> dict:
    """Two JAX processes (``jax.distributed.initialize``), one per namespace, 2 CPU devices each; ``expect_s``:
    show a progress clock against this usual duration."""
    with tempfile.TemporaryDirectory(prefix="two_node_jax_") as tmp, netns.TwoNodes(rate_mbit=rate_mbit) as net:
        out = os.path.join(tmp, "result.json")
        a = net.nodes[0]
        procs = []
        for node in net.nodes:
            argv = [sys.executable, "-m", "course_lib.bench.two_node_worker", "--jax", "--out", out,
                    "--process-id", str(node.index), "--coordinator", f"{a.addr}:{port}", "--iface", node.iface,
                    "--steps", str(steps), "--warmup", str(warmup), "--batch", str(batch)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3"}
            procs.append(net.popen(node, argv, env=env, cwd=str(REPO), stdout=_output(quiet),
                                   stderr=_output(quiet)))
        t0 = time.perf_counter()
        _wait(procs, timeout_s, "the two-node JAX job", expect_s)
        result = json.loads(Path(out).read_text())
        result.update(seconds=time.perf_counter() - t0, link=net.link_bytes(), rate_mbit=rate_mbit)
    result["left_over"] = netns.ours()
    return result


def _output(quiet: bool):
    """Where a worker's output goes: nowhere when quiet, else this process's own stdout/stderr."""
    import subprocess
    return subprocess.DEVNULL if quiet else None


# -- the model ------------------------------------------------------------------------------------------
def link_load(group: list[int], wire: float, node_of: list[int], world: int) -> float:
    """Bytes one direction of the inter-node link carries for one collective on ``group`` (ring order),
    when every group of the same size runs it at once: ``wire`` per crossing ring edge, per group."""
    k = len(group)
    crossing = sum(1 for i in range(k) if node_of[group[i]] == 0 and node_of[group[(i + 1) % k]] == 1)
    return crossing * wire * (world // k)


def fit_links(calibration: dict) -> dict[str, AlphaBeta]:
    """``{"intra": AlphaBeta, "inter": AlphaBeta}`` from the workers' 2-rank all-reduce timings. Intra: seconds
    per byte a rank sends (ring wire bytes); inter: seconds per byte that crossed the link in one direction,
    as the veth's counter measured it -- the link's own speed, whatever algorithm filled it."""
    intra, inter = calibration["shard"], calibration["replicate"]
    return {"intra": fit_alpha_beta([wire_bytes("all_reduce", row[0], 2) for row in intra], [row[1] for row in intra]),
            "inter": fit_alpha_beta([row[2] for row in inter], [row[1] for row in inter])}


#: How many times the ring's bytes an implementation sends, per op: gloo's reduce-scatter is an all-reduce
#: followed by a copy of one's own chunk (measured on loopback: 2.004x the ring bytes; NCCL: 1x).
GLOO_FACTORS = {"reduce_scatter": 2.0}


def predict(result: dict, links: dict[str, AlphaBeta] | None = None, factors: dict | None = None) -> dict:
    """Per strategy: predicted step seconds and link bytes (both directions) from the α-β model, next to the
    measured ones. ``result`` is :func:`run_torch`'s. ``factors``: ``{op: k}`` multiplies an op's ring
    bytes (``GLOO_FACTORS`` for what gloo really sends; None: the ring floor)."""
    links = links or fit_links(result["calibration"])
    factors = factors or {}
    world, nodes = result["world_size"], result["nodes"]
    node_of = [r // (world // nodes) for r in range(world)]
    out = {}
    for kind, run in result["runs"].items():
        comm = link = 0.0
        for op, nbytes, size, ranks, _axis in run["ops"]:
            ranks = ranks or list(range(world))
            w = wire_bytes(op, nbytes, size) * factors.get(op, 1.0)
            if len({node_of[r] for r in ranks}) == 1:
                comm += links["intra"].alpha_s + links["intra"].beta_s_per_byte * w
            else:
                load = link_load(ranks, w, node_of, world)
                comm += links["inter"].alpha_s + links["inter"].beta_s_per_byte * load
                link += 2 * load   # both directions
        steps = len(run["step_s_max"])
        measured_step = sorted(run["step_s_max"])[steps // 2]
        compute = run.get("compute_s", result["compute_s"])
        out[kind] = {"predicted_s": compute + comm, "comm_s": comm, "measured_s": measured_step,
                     "predicted_link": link, "measured_link": sum(run["tx_by_rank"]) / steps,
                     "measured_intra": sum(run.get("lo_by_rank", [0])) / steps}
    return out


def link_ledger(result: dict, kind: str):
    """One step of ``kind`` on rank 0 as a :class:`~course_lib.comm.ledger.Ledger` whose ``axis`` says the mesh
    axis *and* the link class (``"replicate, inter-node"``), so the traffic widget groups by both."""
    from course_lib.comm.ledger import CollectiveRecord, Ledger
    world, nodes = result["world_size"], result["nodes"]
    node_of = [r // (world // nodes) for r in range(world)]
    out = []
    for op, nbytes, size, ranks, axis in result["runs"][kind]["ops"]:
        link = "intra-node" if len({node_of[r] for r in ranks or range(world)}) == 1 else "inter-node"
        out.append(CollectiveRecord(op=op, nbytes=nbytes, dtype="float32", group_size=size, rank=0,
                                    group_ranks=tuple(ranks), axis=f"{axis or 'world'}, {link}", step=0))
    return Ledger(out)


def format_report(result: dict, pred: dict | None = None) -> str:
    pred = pred or predict(result, factors=GLOO_FACTORS)
    links = fit_links(result["calibration"])
    rate = f"{result['rate_mbit']:g} Mbit/s" if result.get("rate_mbit") else "unthrottled"
    lines = [f"two nodes x {result['world_size'] // result['nodes']} ranks, link {rate}; compute alone "
             f"{result['compute_s'] * 1e3:.1f} ms/step",
             f"alpha-beta: intra alpha {links['intra'].alpha_s * 1e3:.2f} ms, "
             f"{links['intra'].bandwidth_bytes_per_s / 1e6:,.0f} MB/s; inter alpha {links['inter'].alpha_s * 1e3:.2f} ms, "
             f"{links['inter'].bandwidth_bytes_per_s / 1e6:,.1f} MB/s per direction",
             f"{'':<6}{'step ms':>9}{'model ms':>10}{'link B/step':>13}{'model B':>11}{'ratio':>7}"]
    for kind, p in pred.items():
        lines.append(f"{kind:<6}{p['measured_s'] * 1e3:>9.1f}{p['predicted_s'] * 1e3:>10.1f}"
                     f"{p['measured_link']:>13,.0f}{p['predicted_link']:>11,.0f}"
                     f"{p['measured_link'] / max(p['predicted_link'], 1):>7.2f}")
    if {"tp_in", "tp_across"} <= set(pred):
        i, a = pred["tp_in"], pred["tp_across"]
        lines.append(f"TP across the link / TP inside a node, step time: measured {a['measured_s'] / i['measured_s']:.1f}x, "
                     f"model {a['predicted_s'] / i['predicted_s']:.1f}x")
    if {"fsdp", "hsdp"} <= set(pred):
        f, h = pred["fsdp"], pred["hsdp"]
        lines.append(f"FSDP - HSDP per step: measured {(f['measured_s'] - h['measured_s']) * 1e3:.1f} ms, "
                     f"model {(f['predicted_s'] - h['predicted_s']) * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m course_lib bench two-node", description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100, help="Mbit/s on the inter-node link; 0: unthrottled")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--jax", action="store_true", help="the JAX variant (jax.distributed, 2 CPU devices per node)")
    ap.add_argument("--tp", action="store_true", help="FSDP × tensor parallel, TP inside a node vs across the link")
    ap.add_argument("--verbose", action="store_true", help="show the workers' output")
    ap.add_argument("--json", metavar="PATH", help="also write the whole result (what run_torch / run_jax return) "
                                                   "to PATH, as JSON")
    a = ap.parse_args(argv)
    ok, why = netns.available()
    if not ok:
        print(f"two-node run skipped: {why}")
        return 0
    rate = a.rate or None
    if a.jax:
        res = run_jax(rate, steps=a.steps, quiet=not a.verbose)
        for kind, run in res["runs"].items():
            print(f"{kind}: mesh {run['mesh']}, median step {sorted(run['step_s'])[len(run['step_s']) // 2] * 1e3:.1f} ms, "
                  f"link {run['tx'] / a.steps:,.0f} B/step (node 0 -> 1), wire by axis {run['wire_by_axis']}")
    else:
        res = run_torch(rate, steps=a.steps, quiet=not a.verbose,
                        kinds=("tp_in", "tp_across") if a.tp else ("fsdp", "hsdp"))
        print(format_report(res))
    print(f"namespaces left behind: {res['left_over'] or 'none'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    return 1 if res["left_over"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
