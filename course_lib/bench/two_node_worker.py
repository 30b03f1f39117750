"""The rank side of :mod:`course_lib.bench.two_node`: what each torchrun worker runs, on either "node".

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=ADDR:PORT \\
             --local-addr=<this node's address> -m course_lib.bench.two_node_worker --out result.json

(:func:`course_lib.bench.two_node.run_torch` builds that command for both namespaces.) Every rank joins the
process group through the ledger backend, so each collective is recorded with its mesh axis, then:

1. **calibrates** one (α, β) per link class: 2-rank all-reduces inside each node (both nodes at once, over
   the namespaces' loopback) and across the nodes (both replica pairs at once, over the veth link);
2. **times** ``steps`` training steps of each ``--kinds``: FSDP (1-D mesh of 4), HSDP (mesh (2, 2): shard
   inside a node, replicate across), and FSDP × tensor parallel placed two ways -- ``tp_in`` (TP inside a
   node, FSDP across: the right way) and ``tp_across`` (swapped: every TP all-reduce crosses the link), reading the veth's byte counter around them (local rank 0 of each node reads its
   own namespace's ``/proc/net/dev``: a namespace sees only its own interfaces);
3. times the same step's **compute** alone (one process, its local batch, no collectives).

Rank 0 writes everything as JSON to ``--out``. Ranks leave with ``os._exit`` (gloo's exit crash, see
:mod:`course_lib.launch`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time


def tx_bytes(iface: str) -> int:
    """Bytes sent so far by ``iface`` in *this process's* network namespace."""
    from course_lib.bench.wire import parse_net_dev
    with open("/proc/net/dev") as f:
        return parse_net_dev(f.read(), iface)[0]


def _counters(iface: str) -> tuple[int, int]:
    """(bytes sent on the veth, bytes sent on this namespace's loopback): inter- and intra-node traffic."""
    return tx_bytes(iface), tx_bytes("lo")


def _calibrate(mesh, sizes, reps: int, iface: str, local_rank: int) -> dict:
    """Per mesh axis and payload size: the median seconds of a 2-rank all-reduce (all groups of the axis at
    once) and the bytes this node sent per call on the veth and on its loopback (local rank 0 reads them)."""
    import torch
    import torch.distributed as dist
    from course_lib.comm import torch_ledger as lt
    out = {}
    for axis in ("shard", "replicate"):
        group = mesh.get_group(axis)
        rows = []
        for nbytes in sizes:
            t = torch.zeros(nbytes // 4)
            times = []
            with lt.paused():
                dist.barrier()
                c0 = _counters(iface) if local_rank == 0 else (0, 0)
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(t, group=group)
                    times.append(time.perf_counter() - t0)
                dist.barrier()
                c1 = _counters(iface) if local_rank == 0 else (0, 0)
            rows.append((nbytes, statistics.median(times), (c1[0] - c0[0]) / reps, (c1[1] - c0[1]) / reps))
        out[axis] = rows
    return out


KINDS = ("fsdp", "hsdp", "tp_in", "tp_across")
#: FSDP × TP runs the course GPT with heads and d_ff divisible by T = 2 (LAB_CONFIG's 3 heads are not).
TP_CONFIG = dict(d_model=66, n_heads=6, d_ff=198, seq_len=31, vocab_size=67, n_layers=2)   # as Lab 06, section 6


def _mesh_and_model(kind: str, cfg, n: int, nodes: int):
    """The mesh, the sharded model, this rank's data-parallel (index, size) and its compute config."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_lib.models import torch_gpt
    from course_lib.strategies.hsdp import torch as hsdp
    from course_lib.strategies.tp import torch as tpt
    if kind in ("fsdp", "hsdp"):
        mesh = init_device_mesh("cpu", (n,)) if kind == "fsdp" else hsdp.hsdp_mesh(nodes, n // nodes)
        return mesh, hsdp.build_gpt(cfg, mesh), (dist.get_rank(), n), cfg
    cfg = dataclasses.replace(cfg, **TP_CONFIG)
    per_node = n // nodes
    # rank = i·(size of dim 1) + j: the last dim holds consecutive ranks, i.e. one node's
    shape, names = ((nodes, per_node), ("dp_shard", "tp")) if kind == "tp_in" else ((per_node, nodes), ("tp", "dp_shard"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = tpt.apply_tp(torch_gpt(cfg, seed=0), mesh["tp"])
    tpt.apply_fsdp(model, mesh["dp_shard"])
    return mesh, model, (mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].size()), cfg


def _train(kind: str, cfg, steps: int, warmup: int, batch: int, iface: str, local_rank: int) -> dict:
    import torch
    import torch.distributed as dist
    from course_lib.comm import torch_ledger as lt
    from course_lib.maths import costs
    from course_lib.models import loss_fn
    from course_lib.models.data import TokenTask
    from course_lib.strategies.hsdp import torch as hsdp
    r, n = dist.get_rank(), dist.get_world_size()
    nodes = n // int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    lt.recorder().reset()
    mesh, model, (d, dp), cfg = _mesh_and_model(kind, cfg, n, nodes)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)   # one kernel for every shard
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    data = [tuple(torch.from_numpy(a) for a in task.rank_batch(s, batch, d, dp)) for s in range(warmup + steps)]
    losses, times = [], []
    for s, (x, y) in enumerate(data):
        if s == warmup:
            with lt.paused():
                dist.barrier()
            c0, t_start = (_counters(iface) if local_rank == 0 else (0, 0)), time.perf_counter()
        lt.set_step(s)
        t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(lt.unrecorded_mean(loss))
    with lt.paused():
        dist.barrier()
    wall = time.perf_counter() - t_start
    c1 = _counters(iface) if local_rank == 0 else (0, 0)
    led = lt.recorder().ledger().filter(rank=r, step=warmup)
    if kind in ("fsdp", "hsdp"):
        led = hsdp.label_axes(led, *mesh.mesh.shape) if mesh.ndim == 2 else hsdp.label_axes(led, 1, n)
    rows = [(rec.op, rec.nbytes, rec.group_size, list(rec.group_ranks or ()), rec.axis) for rec in led]
    tp = 1 if kind in ("fsdp", "hsdp") else n // dp
    return {"losses": losses, "step_s": times[warmup:], "wall_s": wall, "tx": c1[0] - c0[0], "lo": c1[1] - c0[1], "ops": rows,
            "wire": costs.ledger_wire_bytes(led), "compute_s": _compute_only(cfg, batch, dp, tp=tp)}


def _compute_only(cfg, batch: int, n: int, reps: int = 3, tp: int = 1) -> float:
    """Median seconds of forward + backward + AdamW on one process's local batch: the step minus communication.
    With tensor parallel (``tp`` > 1) a rank does ``1/tp`` of that work on its data-parallel rank's rows (the
    model's assumption: a perfect split of the matmuls)."""
    import torch
    from course_lib.models import loss_fn, torch_gpt
    from course_lib.models.data import TokenTask
    model = torch_gpt(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)   # as the measured runs step
    x, y = (torch.from_numpy(a) for a in TokenTask(cfg.vocab_size, cfg.seq_len, seed=0).rank_batch(0, batch, 0, n))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / tp


# -- the JAX variant: one process per node, 2 CPU devices each ----------------------------------------------
def _gloo_on(iface: str) -> None:
    """Make JAX's CPU collectives (gloo) bind ``iface``. JAX calls ``make_gloo_tcp_collectives(client)``
    without a hostname, and gloo then resolves the machine's hostname -- an address the other namespace
    cannot reach. The function takes ``interface=``; JAX just does not pass it (jax 0.10: a private call)."""
    from jax._src import xla_bridge
    orig = xla_bridge._jax.make_gloo_tcp_collectives

    def bound(distributed_client, hostname=None, interface=None):
        return orig(distributed_client=distributed_client, interface=iface)
    xla_bridge._jax.make_gloo_tcp_collectives = bound


def jax_main(a) -> int:
    """One JAX process of the two-node run: FSDP (mesh (1, 4)) and HSDP (mesh (2, 2)), timed, with the veth's bytes."""
    import jax
    jax.config.update("jax_platforms", "cpu")          # the two "nodes" are CPU processes, GPUs or not
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _gloo_on(a.iface)
    jax.distributed.initialize(a.coordinator, num_processes=2, process_id=a.process_id, initialization_timeout=60)
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from course_lib import models
    from course_lib.comm import jax_ledger
    from course_lib.maths import costs
    from course_lib.models.data import TokenTask
    from course_lib.strategies.fsdp import jax as fsdp_jax
    from course_lib.strategies.hsdp import jax as hsdp_jax
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = models.GPTConfig(vocab_size=512, seq_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256)
    task = TokenTask(cfg.vocab_size, cfg.seq_len, seed=0)
    tx = optax.adamw(3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    devices = jax.devices()                      # process 0's two devices, then process 1's
    out = {"devices": [f"{d.id}@p{d.process_index}" for d in devices], "runs": {}}
    for kind, (R, F) in (("fsdp", (1, 4)), ("hsdp", (2, 2))):
        mesh = hsdp_jax.hsdp_mesh(R, F, devices)
        rule = hsdp_jax.hsdp_rule(F)
        model = models.flax_gpt(cfg, seed=0)
        fsdp_jax.shard_model(model, mesh, rule)
        opt = fsdp_jax.sharded_optimizer(model, tx, mesh, rule)
        step = fsdp_jax.make_train_step(mesh, rule)
        data = NamedSharding(mesh, hsdp_jax.batch_spec(mesh))
        per = a.batch // 2                           # rows this process feeds (its 2 devices' rows)

        def batch(s):
            x, y = task.global_batch(s, a.batch)
            mine = slice(a.process_id * per, (a.process_id + 1) * per)
            return tuple(jax.make_array_from_process_local_data(data, v[mine].astype(np.int32)) for v in (x, y))
        batches = [batch(s) for s in range(a.warmup + a.steps)]
        compiled = step.lower(model, opt, *batches[0]).compile(fsdp_jax.compile_options(mesh))
        losses, times = [], []
        for s, (x, y) in enumerate(batches):
            if s == a.warmup:
                tx0, t_start = tx_bytes(a.iface), time.perf_counter()
            t0 = time.perf_counter()
            losses.append(float(compiled(model, opt, x, y)))  # float(): waits for the step
            times.append(time.perf_counter() - t0)
        wall = time.perf_counter() - t_start
        led = jax_ledger.from_compiled(compiled.compiled, mesh)
        by_axis: dict = {}
        for rec in led:
            by_axis[rec.axis or "-"] = by_axis.get(rec.axis or "-", 0.0) + costs.record_wire_bytes(rec)
        out["runs"][kind] = {"losses": losses, "step_s": times[a.warmup:], "wall_s": wall,
                             "tx": tx_bytes(a.iface) - tx0, "wire_by_axis": by_axis, "mesh": [R, F]}
    gathered = [out["runs"][k]["tx"] for k in ("fsdp", "hsdp")]
    if a.process_id == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    else:
        with open(a.out + ".p1", "w") as f:
            json.dump({"tx": gathered}, f)
    jax.distributed.shutdown()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--jax", action="store_true", help="run the JAX variant (one process per node)")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator", default=None, help="JAX: ADDR:PORT of process 0")
    ap.add_argument("--iface", default=None, help="JAX: this node's veth")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256 * 1024, 1024 * 1024, 2048 * 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kinds", nargs="+", default=["fsdp", "hsdp"], choices=KINDS)
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.jax:
        return jax_main(a)
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("two_node_worker runs under torchrun, one worker per rank: start it with "
                         "`python -m course_lib bench two-node` (see course_lib.bench.two_node)")
    from course_lib.launch.forkserver import PRELOAD
    from course_lib.runtime.imports import import_quickly
    import_quickly(PRELOAD["full"])   # the collector paused: a quicker start for each rank
    import torch
    import torch.distributed as dist
    from course_lib.comm import torch_ledger as lt
    from course_lib.models import LAB_CONFIG
    from course_lib.strategies.hsdp import torch as hsdp
    torch.set_num_threads(1)
    dist.init_process_group(lt.register(), timeout=datetime.timedelta(seconds=60))
    r, n = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    iface = os.environ["GLOO_SOCKET_IFNAME"]
    nodes = n // int(os.environ.get("LOCAL_WORLD_SIZE", "2"))
    where = [None] * n
    with lt.paused():
        dist.all_gather_object(where, {"iface": iface, "node": int(os.environ.get("GROUP_RANK", -1))})
        calib = _calibrate(hsdp.hsdp_mesh(nodes, n // nodes), a.sizes, a.reps, iface, local)
    runs = {kind: _train(kind, LAB_CONFIG, a.steps, a.warmup, a.batch, iface, local) for kind in a.kinds}
    compute = _compute_only(LAB_CONFIG, a.batch, n)
    everyone = [None] * n
    with lt.paused():
        dist.all_gather_object(everyone, {"runs": runs, "compute_s": compute})
    if r == 0:
        out = {"world_size": n, "nodes": nodes, "where": where, "calibration": calib,
               "runs": {k: {**everyone[0]["runs"][k],
                            "tx_by_rank": [e["runs"][k]["tx"] for e in everyone],
                            "lo_by_rank": [e["runs"][k]["lo"] for e in everyone],
                            "step_s_max": [max(e["runs"][k]["step_s"][i] for e in everyone)
                                           for i in range(a.steps)]} for k in runs},
               "compute_s": max(e["compute_s"] for e in everyone)}
        with open(a.out, "w") as f:
            json.dump(out, f)
    with lt.paused():
        dist.barrier()
    dist.destroy_process_group()
    import sys
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
