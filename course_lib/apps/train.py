"""``python -m course_lib.train``: the course GPT trained with FSDP2 or HSDP, resumable, under torchrun.

The same file runs on a laptop, on one GPU, and on a cluster::

    python -m course_lib.train --steps 20                                   # one process (world size 1)
    torchrun --standalone --nproc-per-node 4 -m course_lib.train --shard 4  # FSDP over 4 ranks
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29400 \\
        -m course_lib.train --replicate 2 --shard 8 --bf16 --ckpt-dir ck --ckpt-every 100 --resume

Flags (see ``--help``): model size (``--d-model --n-layers --n-heads --d-ff --vocab-size --seq-len``), the
mesh (``--replicate R --shard F``, R*F must equal WORLD_SIZE; R=1 is FSDP), ``--bf16`` (bf16 compute, fp32
master weights and gradient reduction: FSDP2's ``MixedPrecisionPolicy``), ``--act-ckpt`` (recompute each
block in backward), ``--compile`` (``torch.compile`` per block), and DCP checkpoints (``--ckpt-dir``,
``--ckpt-every K``, ``--keep``, ``--resume``). Every configuration error is raised before the model is built
(:mod:`course_lib.apps.train_config`). A checkpoint holds model, optimizer, LR schedule, data
position (global batches, so it means the same at any world size) and each rank's RNG: ``--resume`` at the
same world size continues bit for bit; at another world size DCP reshards on load (RNG left out: the new
ranks never had one). SIGTERM (what SLURM and torchrun send before a kill) saves a checkpoint at the end of
the current step, then exits. Rank 0 shows a tqdm bar, appends JSON lines to ``--jsonl`` (step, loss, tokens/s,
MFU on a GPU, peak memory) and prints the run's collective ledger at the end. One trainer per ``--ckpt-dir``:
the library's ``Checkpointer`` takes the folder's owner lock right after the process group starts, before the
model is built (``python -m course_lib.torchrun`` takes it before any rank starts, and the ranks recognise their
run's id); a second trainer is refused naming the first (:mod:`~course_lib.checkpoint.owner`). Exit
status: 0 done, 1 a checkpoint could not be written (one agreed line), 2 refused before training (flags, folder,
resume), a signal's 128 + n under ``course_lib.torchrun``.

The step keeps the host out of the GPU's way (a fast GPU otherwise waits for Python:
:mod:`course_lib.maths.planner_host`): at world size 1 the model is not wrapped by ``fully_shard`` (nothing to
shard; ``--bf16`` is ``torch.autocast`` there); each batch is built before the step that uses it (pinned, copied
``non_blocking`` on a GPU); the loss is :func:`~course_lib.models.torch_gpt.fused_loss_fn` (fp32 one chunk at a
time); nothing waits for the device inside a step at world size 1 -- on a GPU, steps are timed with CUDA events and
losses read every ``LOG_EVERY_CUDA`` steps (and before a save). With several ranks every step still ends in one
small all-reduce all ranks wait for: they must agree to stop after the same step.

As in "Train Your Large Model on Multiple GPUs with Fully Sharded Data Parallelism": shard each block, then
the root; save and load with DCP on every rank.

Longer than ~300 lines: the capstone reads top to bottom as one script (process group, model, checkpointing,
the loop, and what each signal and fault does to it); apart, a learner would chase it across files.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import resource
import signal
import socket
import statistics
import sys
import time

from course_lib.runtime.imports import import_quickly
from course_lib.maths.flops import gpt_flops_per_token
from course_lib.maths.planner_hw import peak_flops
from course_lib.maths.schedule import Warmup
from course_lib.apps.train_config import (ConfigError, add_arguments, check_folder, check_paths, check_ranks,
                                          check_resume, from_args, quiet_parser_errors, wait_for_rank_0,
                                          write_run_record)

LOCK_ENV = "COURSE_LIB_CKPT_LOCK"   #: set by ``python -m course_lib.torchrun`` when it holds the folder: its run id

#: on a GPU, steps run between two reads of the device (losses, timings): reading waits for the GPU to finish
LOG_EVERY_CUDA = 10


def _die_with_the_agent() -> None:
    """Under torchrun (Linux): when the agent dies without telling its workers -- SIGKILL, the OOM killer --
    the kernel SIGKILLs this worker too (``PR_SET_PDEATHSIG``). torchrun starts each worker in a session of its
    own, so without this an orphaned rank trains on, or waits in a collective, holding its device, and a
    ``--resume`` would race it for the checkpoint folder. A requested stop is unaffected: SIGTERM to the agent
    is forwarded to the workers, which save and exit before the agent does."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:   # the agent died before the line above: the kernel will not send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def _init_process_group():
    """torchrun's env:// rendezvous (or a one-rank group on a free port when run plainly), through the
    ledger backend so every collective -- FSDP2's included -- is recorded. Returns (rank, world, device)."""
    import torch
    import torch.distributed as dist
    from course_lib.comm import torch_ledger
    if "RANK" not in os.environ:   # plain `python -m course_lib.train`: a group of one, same code path
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group(torch_ledger.register(with_cuda=cuda), timeout=datetime.timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size(), device


def build(cfg, device):
    """Model (meta -> sharded -> materialised, ``torch_init_`` so any world size starts identical), AdamW,
    warm-up schedule, data position."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.utils.checkpoint import checkpoint
    from course_lib.models import TokenTask, TorchGPT, torch_init_
    from course_lib.strategies.fsdp.torch import shard_gpt
    from course_lib.strategies.hsdp.torch import hsdp_mesh, shard_gpt_hsdp
    from course_lib.checkpoint.resumable import ResumableBatches
    mcfg = cfg.model_config()
    with torch.device("meta"):
        model = TorchGPT(mcfg)
    if cfg.act_ckpt:   # the forward, not the module, is wrapped: parameter names (checkpoint keys) stay the same
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if cfg.bf16 else {}
    if cfg.replicate > 1:
        shard_gpt_hsdp(model, hsdp_mesh(cfg.replicate, cfg.shard, device.type), **kw)
    elif cfg.world_size > 1:
        shard_gpt(model, init_device_mesh(device.type, (cfg.world_size,), mesh_dim_names=("shard",)), **kw)
    # world size 1: no fully_shard. With nothing to shard it still runs its hooks around every block and copies and
    # casts every parameter in forward and again in backward: L12 in bf16 made 2,293 dispatches per step (1,245 of
    # them kernels), plain under autocast 1,523 (645): tests/test_train_dispatches.py. On a fast GPU the host issuing
    # them is the bottleneck. --bf16 is then torch.autocast (train_step): bf16 matmuls, fp32 weights and gradients.
    model.to_empty(device=device)
    torch_init_(model, mcfg, cfg.seed)
    if cfg.compile:
        for block in model.blocks:
            block.compile()
    # fused, on GPUs and CPUs: one kernel call per step for all the DTensor shards (on CPU torch would pick one call
    # per parameter, each a DTensor dispatch; foreach is as quick once warm, but each new rank process first works
    # out the sharding of its 7 calls: 0.36 s more in a rank's first step, measured on 4 CPU ranks)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, Warmup(cfg.warmup))
    data = ResumableBatches(TokenTask(mcfg.vocab_size, mcfg.seq_len, seed=cfg.data_seed), cfg.batch)
    return model, opt, sched, data


def train_step(model, opt, sched, batch, autocast: bool = False):
    """One step on ``batch`` = (x, y) on the model's device: forward (under bf16 ``torch.autocast`` when asked: world
    size 1 has no FSDP2 policy to cast), the fused loss, backward, AdamW, the schedule. Returns the loss as a
    tensor: nothing here waits for the device (``.item()`` would)."""
    import torch
    from course_lib.models import fused_loss_fn
    x, y = batch
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)                    # [B, T, V]; bf16 under autocast or FSDP2's bf16 policy
    loss = fused_loss_fn(logits, y)          # fp32 maths, one chunk of fp32 logits at a time
    del logits
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss


def _resume(ckpt, model, opt, sched, data, rank: int, world: int) -> int:
    """Load the newest complete checkpoint (0 if none); RNG only when this rank saved one at this world size."""
    from course_lib.checkpoint.dcp import AppState, read_metadata
    from course_lib.checkpoint.manager import step_dir
    step = ckpt.latest()
    if step is None:
        return 0
    keys = read_metadata(step_dir(ckpt.root, step)).state_dict_metadata
    ranks = {k.split(".rank")[1] for k in keys if k.startswith("app.rng.rank")}
    same_world = ranks == {str(r) for r in range(world)}
    ckpt.load({"app": AppState(model, opt, sched, data, rank=rank, rng=same_world)}, step)
    return step


def _peak_memory(device) -> int:
    import torch
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux: KiB


def check_checkpoint_fits(cfg) -> None:
    """The newest readable step's tensor shapes (DCP's own ``.metadata``) against this model's, built on the meta
    device (no memory, no process group), before anything is loaded: ``run.json`` may be missing (copied by
    hand, an older course) or say one thing while the checkpoint holds another. A step whose ``.metadata`` is
    unreadable is passed over here, as the manager passes over it at load (naming it)."""
    from pathlib import Path
    root = Path(cfg.ckpt_dir)
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()
                    and (p / ".metadata").is_file()), reverse=True)
    import torch
    from course_lib.models import TorchGPT
    from course_lib.checkpoint.dcp import read_metadata
    for step in steps:
        try:
            meta = read_metadata(step).state_dict_metadata
        except Exception:  # noqa: BLE001 - truncated or foreign .metadata: the manager names it and loads an older one
            continue
        break
    else:
        return
    with torch.device("meta"):
        want = {f"app.model.{k}": tuple(v.shape) for k, v in TorchGPT(cfg.model_config()).state_dict().items()}
    saved = {k: tuple(md.size) for k, md in meta.items() if k.startswith("app.model.") and hasattr(md, "size")}
    diff = [f"{k} saved {list(saved.get(k, ())) or 'absent'} vs now {list(v)}" for k, v in want.items()
            if saved.get(k) != v] + [f"{k} saved {list(v)} vs now absent" for k, v in saved.items() if k not in want]
    if diff:
        raise ConfigError(f"the checkpoint {step} is of another model (its .metadata, read before loading "
                          f"anything): {len(diff)} tensor(s) differ, e.g. {'; '.join(diff[:3])}; resume with the "
                          "model flags of the run that wrote it, or point --ckpt-dir at a new directory to start afresh")


def preflight(args, world: int, local_ranks: int | None = None):
    """Every check that needs no process group, in every worker alike (so all exit 2 together, rank 0 says
    why in one line) or once in ``python -m course_lib.torchrun`` before any worker starts: ranks on this
    machine (before any batch arithmetic), flags, folders, the checkpoint folder's kind and run record, the
    checkpoint to resume. Returns the config; raises :class:`ConfigError`."""
    from course_lib.runtime.devices import gpu_count
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if local_ranks is None else local_ranks
    check_ranks(local, None, gpu_count())
    cfg = from_args(args, world)
    check_paths(cfg)
    check_folder(cfg, "torch")
    if cfg.resume:
        check_resume(cfg)
        check_checkpoint_fits(cfg)
    return cfg


def parser(rank: int = 0) -> argparse.ArgumentParser:
    p = add_arguments(argparse.ArgumentParser(prog="python -m course_lib.train", description=__doc__.split("\n")[0]))
    return quiet_parser_errors(p, rank)


def main(argv=None) -> int:
    _die_with_the_agent()
    world_env, rank_env = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    args = parser(rank_env).parse_args(argv)
    from course_lib.checkpoint.owner import FolderBusy   # imports no torch
    try:   # before any process group, model or data: every rank fails alike, rank 0 says why
        cfg = preflight(args, world_env)
    except ConfigError as e:
        if rank_env == 0:
            print(f"course_lib.train: {e}", file=sys.stderr, flush=True)
        wait_for_rank_0(rank_env)
        return 2
    from course_lib.checkpoint.manager import CheckpointWriteError   # imports no torch
    from course_lib.launch.forkserver import PRELOAD
    import_quickly(PRELOAD["full"])   # what a rank needs, the collector paused: ~0.5 s less start-up per rank
    opened = []   # the Checkpointer, once made: its folder is released on every way out of here
    try:
        return _train(cfg, os.environ.get(LOCK_ENV), opened)
    except (CheckpointWriteError, ConfigError, FolderBusy) as e:   # the folder's lock or probe, a failed save, a
        if rank_env == 0:                                             # resume refused: one line
            print(f"course_lib.train: {e}", file=sys.stderr, flush=True)
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        return 1 if isinstance(e, CheckpointWriteError) else 2
    finally:
        for ckpt in opened:
            if ckpt.owner is not None:
                ckpt.owner.release()


def _train(cfg, run_id: str | None = None, opened: list | None = None) -> int:
    import torch
    import torch.distributed as dist
    from tqdm.auto import tqdm
    from course_lib.comm import torch_ledger
    from course_lib.checkpoint.dcp import AppState
    from course_lib.checkpoint.manager import Checkpointer, CheckpointCorrupt, CheckpointMismatch

    rank, world, device = _init_process_group()
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    # the folder's lock and write probe before the model is built: a second trainer is refused in seconds
    ckpt = Checkpointer(cfg.ckpt_dir, keep=cfg.keep, probe=True, run_id=run_id, command="python -m course_lib.train",
                        on_save_error="raise" if cfg.save_errors == "stop" else "warn") if cfg.ckpt_dir else None
    if ckpt and opened is not None:
        opened.append(ckpt)
    if ckpt and ckpt.taken_over:
        from course_lib.checkpoint.owner import describe
        print(f"course_lib.train: {cfg.ckpt_dir} was held by {describe(ckpt.taken_over)}, which is no longer "
              "running: taken over", file=sys.stderr, flush=True)
    model, opt, sched, data = build(cfg, device)
    try:
        start = _resume(ckpt, model, opt, sched, data, rank, world) if (ckpt and cfg.resume) else 0
    except (CheckpointCorrupt, CheckpointMismatch, FileNotFoundError, ValueError) as e:
        raise ConfigError(f"cannot resume from {cfg.ckpt_dir}: {str(e).splitlines()[0]}") from None
    if ckpt and cfg.resume and rank == 0:
        for line in ckpt.ignored():   # damaged or unfinished steps that were passed over, and why
            print(f"course_lib.train: {line}", file=sys.stderr, flush=True)
        if start == 0:
            print(f"course_lib.train: no checkpoint in {cfg.ckpt_dir} yet: starting at step 0", file=sys.stderr,
                  flush=True)
    if ckpt and rank == 0:
        write_run_record(cfg, "torch")
    log = open(cfg.jsonl, "a") if (cfg.jsonl and rank == 0) else None
    tokens, fpt = cfg.batch * cfg.seq_len, gpt_flops_per_token(cfg.model_config())   # MFU: course_lib.maths.flops
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch_ledger.recorder().reset()
    times, step, pending = [], start, []   # pending: steps run but not yet logged (read at the log interval)
    bar = tqdm(total=cfg.steps, initial=start, disable=rank != 0, desc=f"train {world} ranks", unit="step")

    def next_batch():   # this rank's next batch, on its device: built before the step that uses it, not timed
        x, y = data.next(rank, world)
        return tuple(t.pin_memory().to(device, non_blocking=True) for t in (x, y)) if cuda else (x, y)

    def flush():   # log what ran: on a GPU the one wait for the device every LOG_EVERY_CUDA steps
        nonlocal times
        if not pending:
            return
        losses = torch.stack([p["loss"] for p in pending]).tolist()
        for i, (p, loss) in enumerate(zip(pending, losses)):
            if cuda:   # device time from this step's start to the next one's (the last: to its own end)
                nxt = pending[i + 1]["t0"] if i + 1 < len(pending) else p["t1"]
                nxt.synchronize()
                p["dt"] = p["t0"].elapsed_time(nxt) / 1e3
            dt = p["dt"]
            times = times + [dt]
            row = {"step": p["step"], "loss": loss / world, "tokens_per_s": tokens / dt, "step_s": dt,
                   "lr": p["lr"], "peak_bytes": _peak_memory(device), "world_size": world}
            if peak:
                row["mfu"] = fpt * tokens / dt / (peak * world)
            if log:
                log.write(json.dumps(row) + "\n")
        if log:
            log.flush()
        bar.update(len(pending))
        bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
        pending.clear()

    batch = next_batch() if start < cfg.steps else None
    for s in range(start, cfg.steps):
        torch_ledger.set_step(s)
        t0 = torch.cuda.Event(enable_timing=True) if cuda else None
        if cuda:
            t0.record()
        tic = time.perf_counter()
        lr = sched.get_last_lr()[0]          # the rate this step uses (sched.step() below moves to the next)
        loss = train_step(model, opt, sched, batch, autocast=cfg.bf16 and world == 1)
        if world > 1:   # every rank must stop after the same step: agree on it (a wait for the device each step)
            t = torch.stack([loss.detach().float(), loss.detach().new_full((), float(stop["signal"] is not None))])
            with torch_ledger.paused():   # bookkeeping, not training traffic: kept out of the ledger
                dist.all_reduce(t)
            loss_sum, stopping = t[0], t[1].item() > 0
        else:           # one process: the flag is this process's own, no collective, no wait
            loss_sum, stopping = loss.detach().float(), stop["signal"] is not None
        step = s + 1
        p = {"step": s, "loss": loss_sum, "lr": lr, "dt": time.perf_counter() - tic, "t0": t0}
        if cuda:
            p["t1"] = torch.cuda.Event(enable_timing=True)
            p["t1"].record()
        pending.append(p)
        save = ckpt and (stopping or step == cfg.steps or (cfg.ckpt_every and step % cfg.ckpt_every == 0))
        if not cuda or save or stopping or step == cfg.steps or len(pending) >= LOG_EVERY_CUDA:
            flush()
        if save:
            with torch_ledger.paused():
                ckpt.save(step, {"app": AppState(model, opt, sched, data, rank=rank)})
        if stopping:
            break
        if step < cfg.steps:
            batch = next_batch()             # after the save: the checkpoint's data position is the next step's
        if cfg.throttle:
            time.sleep(cfg.throttle)
    flush()
    bar.close()
    ledger = torch_ledger.recorder().ledger()
    if rank == 0:
        steady = times[1:] or times
        med = statistics.median(steady) if steady else float("nan")
        summary = {"summary": True, "start": start, "end": step, "world_size": world, "replicate": cfg.replicate,
                   "shard": cfg.shard, "tokens_per_s": tokens / med, "median_step_s": med,
                   "peak_bytes": _peak_memory(device), "mfu": fpt * tokens / med / (peak * world) if peak else None,
                   "stopped_by_signal": stop["signal"], "collectives_rank0": len(ledger.filter(rank=0)),
                   "collective_bytes_rank0": ledger.filter(rank=0).total_bytes(), "device": str(device)}
        print(f"collective ledger (rank 0, steps {start}..{step - 1}):\n{ledger.filter(rank=0).table()}", flush=True)
        print(json.dumps(summary), flush=True)
        if log:
            log.write(json.dumps(summary) + "\n")
            log.close()
    if ckpt:
        ckpt.close()   # the folder is free again
    dist.destroy_process_group()
    return 0


def run_and_exit(argv=None) -> None:
    """``main``, then leave with ``os._exit`` once the output is flushed: gloo's threads sometimes abort a process
    at interpreter exit ("terminate called without an active exception", SIGABRT after a run that finished
    well; seen once in a full suite run), as in the notebook launcher's ranks. Everything ``main`` opened is
    closed by then, and a save is complete before it returns."""
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
