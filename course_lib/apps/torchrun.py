"""``python -m course_lib.torchrun``: torchrun itself (same flags, same agent, same rendezvous), with the
capstone's flags checked once before any worker starts and a quiet exit.

    python -m course_lib.torchrun --standalone --nproc-per-node 4 -m course_lib.train --ckpt-dir ck --resume

Plain ``torchrun`` works too; what this adds, on top of ``torch.distributed.run.run``:

* ``-m course_lib.train ...`` flags are validated here, in the launching process, before torchrun starts a
  worker (:func:`course_lib.apps.train.preflight`, with WORLD_SIZE = nodes x nproc-per-node when the node
  count is fixed): one line and exit status 2. (Each worker checks again -- under plain torchrun that is the
  only check -- and only rank 0 prints.)
* A failed worker ends in one line (the rank, its exit status or signal) instead of torchrun's
  ``ChildFailedError`` traceback; the status is the worker's (2 for a configuration error).
* SIGTERM (or SIGINT, SIGHUP) to this process -- the agent -- is forwarded to the workers by torchrun as
  usual (the training script saves a checkpoint and exits); then this process exits 128 + the signal (143
  for SIGTERM), the shell's convention for "stopped by a signal", without torchrun's ``SignalException``
  traceback.
* One trainer per checkpoint folder: on one node, this process takes ``--ckpt-dir``'s lock before any worker
  starts (:mod:`course_lib.checkpoint.owner`; a second trainer is refused in one line naming this one,
  exit status 2) and holds it until the last worker is gone; on several nodes rank 0 takes it.
* SIGKILL of this process (or the OOM killer) cannot be forwarded: each ``course_lib.train`` worker asks the
  kernel to SIGKILL it when its agent dies (``PR_SET_PDEATHSIG``), so no rank is left training alone; the save
  it was in stays a ``.partial`` directory, which ``--resume`` names and passes over.
"""
from __future__ import annotations

import os
import sys

_TRAIN = ("course_lib.train", "course_lib.apps.train")


def _check_train_flags(config, cmd_args) -> tuple[int, str | None]:
    """(exit status, 0 when the flags are good; the checkpoint folder they name)."""
    from course_lib.apps import train
    from course_lib.apps.train_config import ConfigError
    try:
        args = train.parser(0).parse_args(cmd_args)   # argparse's errors: one line, then SystemExit(2)
    except SystemExit as e:
        return int(e.code or 0) or 2, None
    fixed = config.min_nodes == config.max_nodes
    world = config.min_nodes * config.nproc_per_node
    try:
        if fixed:
            train.preflight(args, world, local_ranks=config.nproc_per_node)
        else:   # elastic node count: the world size is known only at rendezvous; the workers check it
            from course_lib.apps.train_config import check_paths, check_ranks
            from course_lib.runtime.devices import gpu_count
            check_ranks(config.nproc_per_node, None, gpu_count())
            check_paths(train.from_args(args, config.nproc_per_node))
    except ConfigError as e:
        print(f"course_lib.train: {e}", file=sys.stderr, flush=True)
        return 2, None
    return 0, args.ckpt_dir


def main(argv=None) -> int:
    from course_lib.runtime.imports import import_quickly
    import_quickly(["torch.distributed.run"])   # the agent's start-up is this import: the collector paused, faster
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import config_from_args, get_args_parser, run
    from course_lib.apps.train import LOCK_ENV
    args = get_args_parser().parse_args(argv)
    lock = None
    if args.module and args.training_script in _TRAIN:
        config, _cmd, _cmd_args = config_from_args(args)
        status, ckpt_dir = _check_train_flags(config, list(args.training_script_args))
        if status:
            return status
        if ckpt_dir and config.max_nodes == 1:   # several nodes: rank 0 takes it
            from course_lib.checkpoint import owner
            try:
                lock = owner.take(ckpt_dir, command="python -m course_lib.torchrun -m course_lib.train")
            except owner.FolderBusy as e:
                print(f"course_lib.train: {e}", file=sys.stderr, flush=True)
                return 2
            if lock.stale:
                print(f"course_lib.train: {ckpt_dir} was held by {owner.describe(lock.stale)}, which "
                      "is no longer running: taken over", file=sys.stderr, flush=True)
            os.environ[LOCK_ENV] = lock.run_id   # the workers' environment: rank 0 knows the folder is held
    try:
        run(args)
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        if code != 2:   # 2: a configuration error, which rank 0 already named in one line
            how = f"was killed by {failure.signal_name()}" if code < 0 else f"exited with status {code}"
            print(f"course_lib.torchrun: rank {rank} {how} (its output is above)", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    except SignalException as e:
        print(f"course_lib.torchrun: stopped by {e.sigval.name}; the workers were told first (a training script "
              "saves a checkpoint on SIGTERM)", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    finally:
        if lock:
            lock.release()
            os.environ.pop(LOCK_ENV, None)


if __name__ == "__main__":
    sys.exit(main())
