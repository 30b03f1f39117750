"""``python -m course_lib.train_jax``: the course GPT in Flax NNX, FSDP or HSDP over a JAX mesh, resumable
with Orbax, one process per host under ``jax.distributed``.

The same task, flags and log as :mod:`course_lib.train` (see there), plus how the processes find each other::

    python -m course_lib.train_jax --steps 20                                  # one process, its devices
    python -m course_lib.train_jax --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0 \\
        --replicate 2 --shard 2 --ckpt-dir ck --ckpt-every 5 --resume           # ... and --process-id 1
    srun python -m course_lib.train_jax --replicate 2 --shard 8 ...            # SLURM: all from the environment

``--coordinator / --num-processes / --process-id`` fall back to ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, and with none of them on SLURM, ``jax.distributed.initialize()``
reads SLURM's own variables. ``--cpu-devices D`` runs on D CPU devices per process with gloo collectives
across processes: 2 processes x 2 devices is a real multi-process run on a laptop. The mesh is
``(replicate, fsdp)`` over ``jax.devices()`` (process 0's devices first); parameters of at least 1024
elements are cut over ``fsdp`` and copied over ``replicate``; the batch rows are cut over both. ``--bf16``
casts the fp32 parameters to bf16 inside the step (gradients come back fp32); ``--act-ckpt`` wraps every block
in ``nnx.remat``. Orbax's ``CheckpointManager`` writes ``<step>.orbax-checkpoint-tmp`` and renames it when
complete; ``--resume`` names any unfinished ``<step>.orbax-checkpoint-tmp`` (a process killed mid-save) and
restores the newest complete step with every array laid out for the *current* mesh, so 2 processes x 2
devices resumes at 1 x 2 or 1 x 4. As in "Train Your Large Model on Multiple GPUs with Fully Sharded Data
Parallelism", the same saved state fits any layout.

Longer than ~300 lines: one program's life -- its processes, mesh, jitted step over the split state, checkpoint
folder checks and resume -- reads best top to bottom, as :mod:`course_lib.apps.train` does for torch.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import time

from course_lib.apps.train_config import (ConfigError, add_arguments, check_folder, check_paths, check_ranks, check_resume,
                                          from_args, quiet_parser_errors, write_run_record)


def _parser():
    p = add_arguments(argparse.ArgumentParser(prog="python -m course_lib.train_jax", description=__doc__.split("\n")[0]))
    env = os.environ.get
    p.add_argument("--coordinator", default=env("JAX_COORDINATOR_ADDRESS"), help="host:port of process 0")
    p.add_argument("--num-processes", type=int, default=int(env("JAX_NUM_PROCESSES", 0)) or None)
    p.add_argument("--process-id", type=int, default=int(env("JAX_PROCESS_ID", -1)) if env("JAX_PROCESS_ID") else None)
    p.add_argument("--cpu-devices", type=int, default=0, help="run on this many CPU devices per process (0: default backend)")
    return p


PEER_TIMEOUT_S = 8   #: seconds without a heartbeat before a process is declared dead (jax.distributed)


def _initialize(a) -> None:
    from course_lib.runtime.imports import import_quickly
    import_quickly(["jax", "jax.numpy", "optax", "flax.nnx", "orbax.checkpoint"])   # the collector paused: faster
    import jax
    if a.cpu_devices:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", a.cpu_devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if a.coordinator or (a.num_processes or 1) > 1 or "SLURM_JOB_ID" in os.environ:
        import inspect
        # A dead peer is noticed by the coordination service's heartbeat: JAX's default (100 s) left the survivor
        # waiting ~94 s; PEER_TIMEOUT_S makes it seconds (a healthy process heartbeats every few seconds).
        kw = {k: PEER_TIMEOUT_S for k in ("heartbeat_timeout_seconds", "shutdown_timeout_seconds")
              if k in inspect.signature(jax.distributed.initialize).parameters}
        from course_lib.apps.jax_peers import initialize   # XLA's fatal path made one that PeerWatch can name
        initialize(a.coordinator, num_processes=a.num_processes, process_id=a.process_id,
                   initialization_timeout=120, **kw)


def make_step(mesh, rule, bf16: bool, remat: bool, model, opt):
    """The train step as one ``jax.jit`` function of the state: ``step(state, x, y) -> (loss, state)``, the state
    donated (updated in place); loss (bf16 compute when asked), grads, AdamW, pin. Returns ``(step, state)``.

    ``nnx.split`` runs once, here: ``nnx.jit`` would split and merge the model and optimizer in Python on every
    call (measured here: 75 ms per call for 12 layers on this 2-core machine, next to a GPU step of ~70 ms).
    ``model`` and ``opt`` keep stale (donated) arrays until :func:`sync` writes the state back into them."""
    import functools

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from course_lib.strategies.fsdp.jax import forward, pin

    def loss_fn(model, x, y):
        if bf16:   # compute copy in bf16; the cast is differentiable, so gradients arrive in fp32
            gd, st = nnx.split(model)
            model = nnx.merge(gd, jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, st))
            for _, m in nnx.iter_modules(model):   # nnx.Embed fixed its compute dtype (fp32) when it was built: a
                if getattr(m, "dtype", None) == jnp.float32:   # bf16 table still gave fp32 activations, and every
                    m.dtype = jnp.bfloat16                      # layer after it promoted to fp32 (measured on H100)
        logits = forward(model, x, remat).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    graphdef, state = nnx.split((model, opt))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        pin(model, optimizer, mesh=mesh, rule=rule)
        return loss, nnx.state((model, optimizer))
    return train_step, state


def sync(model, opt, state) -> None:
    """Write the step's state back into the NNX objects (before a checkpoint, and at the end)."""
    from flax import nnx
    nnx.update((model, opt), state)


def _peak_memory() -> int:
    import jax
    stats = jax.local_devices()[0].memory_stats() or {}
    return int(stats.get("peak_bytes_in_use") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _compiled_facts(compiled) -> dict:
    """What XLA made of the step: its scratch memory (``temp_bytes``) and whether attention runs as cuDNN's
    fused kernel (a ``__cudnn$fmha`` custom call) or as separate matmuls and a softmax."""
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:   # a backend without memory analysis
        temp = None
    return {"temp_bytes": temp, "fused_attention": "__cudnn$fmha" in compiled.as_text()}


def _process_id(argv) -> int:
    """This process's id before argparse runs (for who prints argparse's error): --process-id or the env."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--process-id" in argv[:-1]:
        try:
            return int(argv[argv.index("--process-id") + 1])
        except ValueError:
            return 0
    return int(os.environ.get("JAX_PROCESS_ID", 0) or 0)


def main(argv=None) -> int:
    a = quiet_parser_errors(_parser(), _process_id(argv)).parse_args(argv)
    nproc = a.num_processes or 1
    try:   # what the flags alone can check, before JAX starts (CPU: the device count is known)
        if a.cpu_devices and nproc > 1 and (a.coordinator or "").rpartition(":")[0] in ("127.0.0.1", "localhost"):
            check_ranks(nproc)   # every process on this machine: as many as it holds, before any batch arithmetic
        if a.cpu_devices:
            cfg = from_args(a, nproc * a.cpu_devices)
        check_paths(a)   # the folders: --jsonl, --ckpt-dir, --resume
        check_folder(a, "jax")   # the other script's checkpoints, a damaged run.json, a start that would overwrite
        if a.resume:
            check_resume(a)
    except ConfigError as e:
        if not a.process_id:
            print(f"course_lib.train_jax: {e}", file=sys.stderr)
        return 2
    _initialize(a)
    import jax
    pid, nproc = jax.process_index(), jax.process_count()
    try:   # the real device count, still before any model exists
        cfg = from_args(a, jax.device_count())
        if cfg.resume:
            check_resume(cfg)
            check_checkpoint_fits(cfg)
        lock = _take_folder(cfg, pid, nproc)
    except ConfigError as e:
        if pid == 0:
            print(f"course_lib.train_jax: {e}", file=sys.stderr)
        return 2
    watch = None
    if nproc > 1:   # a peer that vanishes: one line and exit PEER_LOST_EXIT, before XLA's abort
        from jax._src.distributed import global_state
        from course_lib.apps.jax_peers import PeerWatch
        watch = PeerWatch(global_state.client, pid, nproc, stale_s=PEER_TIMEOUT_S - 2, ckpt_dir=cfg.ckpt_dir,
                          cleanup=lock.release if lock else None)
    try:
        return _train(cfg, pid, nproc, watch)
    except ConfigError as e:
        if pid == 0:
            print(f"course_lib.train_jax: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception:
        if watch:   # a collective that failed because a peer is gone: the watch says so and exits
            watch.verdict(PEER_TIMEOUT_S)
        raise
    finally:
        if lock:
            lock.release()


def check_checkpoint_fits(cfg) -> None:
    """The newest complete step's array shapes, read from Orbax's own metadata, against this model's (built
    abstractly: no memory), before anything is loaded -- with or without ``run.json``. :class:`ConfigError`."""
    from flax import nnx
    from course_lib import models
    from course_lib.checkpoint import orbax as cj
    saved = cj.saved_shapes(cfg.ckpt_dir)
    if saved is None:
        return
    step, shapes = saved
    abstract = nnx.eval_shape(lambda: models.flax_gpt(cfg.model_config(), seed=cfg.seed))
    want = cj.shapes_of({"model": nnx.state(abstract)})
    diff = [f"{k} saved {list(shapes[k]) if k in shapes else 'absent'} vs now {list(v)}" for k, v in want.items()
            if shapes.get(k) != v] + [f"{k} saved {list(v)} vs now absent" for k, v in shapes.items()
                                      if k.startswith("model.") and k not in want]
    if diff:
        raise ConfigError(f"the checkpoint {os.path.join(cfg.ckpt_dir, str(step))} is of another model (Orbax's metadata, "
                          f"read before loading anything): {len(diff)} array(s) differ, e.g. {'; '.join(diff[:3])}; "
                          "resume with the model flags of the run that wrote it, or point --ckpt-dir at a new directory")


def _take_folder(cfg, pid: int, nproc: int):
    """The checkpoint folder taken for this run before the model is built, through the library
    (:func:`course_lib.checkpoint.orbax.claim_folder`: process 0 takes it, every process learns the
    answer); a refusal is :class:`ConfigError` on every process (one line from process 0). Returns the lock on
    process 0 (None elsewhere, or without --ckpt-dir). The Orbax manager is then made with ``lock=False``."""
    if not cfg.ckpt_dir:
        return None
    from course_lib.checkpoint import orbax as cj, owner
    try:
        lock = cj.claim_folder(cfg.ckpt_dir, command="python -m course_lib.train_jax")
    except (owner.FolderBusy, OSError) as e:
        raise ConfigError(str(e)) from None
    if lock is not None and lock.stale:
        print(f"course_lib.train_jax: {cfg.ckpt_dir} was held by {owner.describe(lock.stale)}, which is no "
              "longer running: taken over", file=sys.stderr, flush=True)
    return lock


def _train(cfg, pid: int, nproc: int, watch) -> int:
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from tqdm.auto import tqdm
    from course_lib import models
    from course_lib.comm import jax_ledger
    from course_lib.checkpoint import orbax as cj
    from course_lib.strategies.fsdp import jax as fsdp_jax
    from course_lib.strategies.hsdp import jax as hsdp_jax
    from course_lib.maths.flops import gpt_flops_per_token
    from course_lib.maths.planner_hw import peak_flops
    from course_lib.maths.schedule import Warmup
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    mcfg = cfg.model_config()
    mesh = hsdp_jax.hsdp_mesh(cfg.replicate, cfg.shard, jax.devices())
    rule = hsdp_jax.hsdp_rule(cfg.shard)
    model = models.flax_gpt(mcfg, seed=cfg.seed)
    fsdp_jax.shard_model(model, mesh, rule)
    warmup = Warmup(cfg.warmup)
    sched = lambda count: cfg.lr * warmup(count, jax.numpy.minimum)   # noqa: E731 (torch's schedule)
    tx = optax.adamw(sched, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)      # torch.optim.AdamW's defaults
    opt = fsdp_jax.sharded_optimizer(model, tx, mesh, rule)
    data_sharding = NamedSharding(mesh, hsdp_jax.batch_spec(mesh))
    task = models.TokenTask(mcfg.vocab_size, mcfg.seq_len, seed=cfg.data_seed)
    per = cfg.batch // nproc

    def batch(s):   # this process's contiguous rows of global batch s (its devices come in mesh order)
        x, y = task.global_batch(s, cfg.batch)
        mine = slice(pid * per, (pid + 1) * per)
        return tuple(jax.make_array_from_process_local_data(data_sharding, v[mine].astype(np.int32)) for v in (x, y))

    mngr, start = None, 0
    if cfg.ckpt_dir:
        mngr = cj.manager(cfg.ckpt_dir, keep=cfg.keep, lock=False)   # main() holds the folder
        latest = mngr.latest_step() if cfg.resume else None
        if cfg.resume and pid == 0:   # saves that never committed (a killed process): passed over, and said so
            for name in cj.incomplete_steps(cfg.ckpt_dir):
                print(f"course_lib.train_jax: ignored {os.path.join(cfg.ckpt_dir, name)}: an unfinished save "
                      "(never committed)", file=sys.stderr, flush=True)
        if latest is not None:
            target = cj.restore_target(cj.train_state(model, opt), mesh, rule)
            try:
                state, meta = cj.restore(mngr, latest, target)
            except Exception as e:  # noqa: BLE001 - a damaged step: one line naming it, not Orbax's tracebacks
                raise ConfigError(f"cannot restore step {latest} from {cfg.ckpt_dir}: {type(e).__name__}: "
                                  f"{(str(e).strip().splitlines() or [''])[0][:300]}; move that step aside to resume "
                                  "from the one before, or point --ckpt-dir at a new directory") from None
            cj.put_state(model, opt, state)
            start = int(meta["data_step"])
        if pid == 0:
            write_run_record(cfg, "jax")
    step_fn, state = make_step(mesh, rule, cfg.bf16, cfg.act_ckpt, model, opt)
    compiled = step_fn.lower(state, *batch(start)).compile(fsdp_jax.compile_options(mesh))
    dev = jax.devices()[0]
    peak = peak_flops(getattr(dev, "device_kind", "")) if dev.platform == "gpu" else None
    tokens, fpt = cfg.batch * cfg.seq_len, gpt_flops_per_token(mcfg)   # MFU as course_lib.train counts it
    log = open(cfg.jsonl, "a") if (cfg.jsonl and pid == 0) else None
    times, step = [], start
    bar = tqdm(total=cfg.steps, initial=start, disable=pid != 0, desc=f"train_jax {jax.device_count()} devices",
               unit="step")
    for s in range(start, cfg.steps):
        if watch:
            watch.where["step"] = s
        x, y = batch(s)
        t0 = time.perf_counter()
        loss, state = compiled(state, x, y)
        loss = float(loss)                                # float(): waits for the step
        dt = time.perf_counter() - t0
        step, times = s + 1, times + [dt]
        flag = np.array([stop["signal"] is not None], np.int32)
        if nproc > 1:
            from jax.experimental import multihost_utils
            flag = multihost_utils.process_allgather(flag)
        stopping = bool(np.any(flag))
        row = {"step": s, "loss": loss, "tokens_per_s": tokens / dt, "step_s": dt, "lr": float(sched(s)),
               "peak_bytes": _peak_memory(), "world_size": jax.device_count()}
        if peak:
            row["mfu"] = fpt * tokens / dt / (peak * jax.device_count())
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        if mngr and (stopping or step == cfg.steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0)):
            sync(model, opt, state)
            cj.save(mngr, step, cj.train_state(model, opt),
                    {"data_step": step, "batch": cfg.batch, "data_seed": cfg.data_seed})
        if stopping:
            break
        if cfg.throttle:
            time.sleep(cfg.throttle)
    bar.close()
    sync(model, opt, state)
    if mngr:
        mngr.wait_until_finished()
        mngr.close()
    if pid == 0:
        led = jax_ledger.from_compiled(compiled, mesh)
        med = statistics.median(times[1:] or times) if times else float("nan")
        summary = {"summary": True, "start": start, "end": step, "world_size": jax.device_count(),
                   "processes": nproc, "replicate": cfg.replicate, "shard": cfg.shard, "tokens_per_s": tokens / med,
                   "median_step_s": med, "peak_bytes": _peak_memory(),
                   "mfu": fpt * tokens / med / (peak * jax.device_count()) if peak else None,
                   "stopped_by_signal": stop["signal"], "collectives_per_step": len(led), "device": dev.platform,
                   **_compiled_facts(compiled)}
        print(f"collective ledger (one compiled step, from its HLO):\n{led.table()}", flush=True)
        print(json.dumps(summary), flush=True)
        if log:
            log.write(json.dumps(summary) + "\n")
            log.close()
    if nproc > 1:
        watch.stop()   # this process's exit is no fault: the others' watches must not take it for one
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
