"""``python -m course_lib.apps.slurm preflight torch|jax ...``: the capstone's preflight inside a Slurm batch
script, run once on the job's first node before ``srun`` starts anything.

The batch scripts in ``scripts/slurm/`` call it as their one line of validation::

    python -m course_lib.apps.slurm preflight torch --nproc-per-node 8 --ckpt-dir ck/1234 -- --shard 16 --steps 100

It reads the job's shape from Slurm's environment (``SLURM_JOB_ID``, ``SLURM_JOB_NUM_NODES``, ``SLURM_NTASKS``),
works out the world size the launch will have, and runs the capstone's own checks with it
(:func:`course_lib.apps.train.preflight` for torch; the same flag, mesh and folder checks for JAX), so a bad
job ends in one line naming the values and the fix -- exit status 2, no ``srun``, no step, nothing written --
instead of N ranks failing after the queue wait. What it adds to the capstone's checks, because the script
owns them: ``--ckpt-dir`` and ``--resume`` (the script keys the folder by the job id and resumes on every
start, so a requeued job continues), and for JAX ``--coordinator`` / ``--num-processes`` / ``--process-id``
(``jax.distributed.initialize()`` reads them from Slurm); and the tasks per node each launcher expects: one
``torchrun`` agent per node (it starts the node's ranks), one JAX process per task.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

__all__ = ["SlurmJob", "job_from_env", "preflight", "main"]

#: Flags the batch scripts set themselves; a user passing them would fight the script.
OWNED = {"torch": ("--ckpt-dir", "--resume"),
         "jax": ("--ckpt-dir", "--resume", "--coordinator", "--num-processes", "--process-id")}


class SlurmError(ValueError):
    """A job that cannot run as submitted; the message is one line naming the values and the fix."""


@dataclass(frozen=True)
class SlurmJob:
    """The shape of a Slurm job, from its environment."""

    job_id: str          #: SLURM_JOB_ID: the same across requeues, so it keys the checkpoint folder
    nodes: int           #: SLURM_JOB_NUM_NODES
    tasks: int           #: SLURM_NTASKS (``--ntasks`` or nodes x ``--ntasks-per-node``)
    restarts: int        #: SLURM_RESTART_COUNT: 0 on the first start, +1 per requeue

    def __post_init__(self):
        if self.nodes < 1 or self.tasks < 1:
            raise SlurmError(f"SLURM_JOB_NUM_NODES={self.nodes}, SLURM_NTASKS={self.tasks}: a job has at least one "
                             "node and one task")


def job_from_env(env=None) -> SlurmJob:
    """The job this process runs in (``os.environ`` by default); :class:`SlurmError` outside a job."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        raise SlurmError("not inside a Slurm job (no SLURM_JOB_ID): submit the script with sbatch, e.g. "
                         "sbatch scripts/slurm/train_torch.sbatch --steps 100")
    try:
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        tasks = int(env.get("SLURM_NTASKS") or nodes)
        restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError as e:
        raise SlurmError(f"a Slurm variable is not a number ({e})") from None
    return SlurmJob(env["SLURM_JOB_ID"], nodes, tasks, restarts)


def _refuse_owned(framework: str, train_args: list[str]) -> None:
    owned = [a.split("=")[0] for a in train_args if a.split("=")[0] in OWNED[framework]]
    if owned:
        raise SlurmError(f"{' '.join(owned)}: the batch script sets these itself (checkpoints in $CKPT_ROOT/<job id>, "
                         "--resume on every start" + (", jax.distributed from Slurm's variables" if framework == "jax"
                                                       else "") + "); drop them (set CKPT_ROOT to move the checkpoints)")


def preflight(framework: str, train_args: list[str], ckpt_dir: str, job: SlurmJob, nproc_per_node: int = 1):
    """Every check the launch allows before ``srun``; returns the capstone's config, raises :class:`SlurmError`
    or the capstone's ``ConfigError`` (one line each). ``ckpt_dir``: the folder the script will pass."""
    from course_lib.apps.train_config import check_paths, check_resume, from_args
    _refuse_owned(framework, train_args)
    resume = ["--resume"] if os.path.isdir(ckpt_dir) else []   # a first start: nothing to resume yet
    argv = [*train_args, "--ckpt-dir", ckpt_dir, *resume]
    if framework == "torch":
        from course_lib.apps import train
        if job.tasks != job.nodes:
            raise SlurmError(f"SLURM_NTASKS={job.tasks} on {job.nodes} node(s): the torch script runs one torchrun "
                             "agent per node, which starts that node's ranks; submit with --ntasks-per-node=1 and "
                             "set NPROC_PER_NODE for the ranks")
        if nproc_per_node < 1:
            raise SlurmError(f"NPROC_PER_NODE={nproc_per_node}: each node needs at least one rank")
        args = _parse(train.parser(0), argv)
        return train.preflight(args, job.nodes * nproc_per_node, local_ranks=nproc_per_node)
    from course_lib.apps.train_config import add_arguments
    parser = add_arguments(argparse.ArgumentParser(prog="python -m course_lib.train_jax"))
    parser.add_argument("--cpu-devices", type=int, default=0)   # train_jax's; the other three are the script's
    args = _parse(parser, argv)
    world = job.tasks * (args.cpu_devices or 1)   # JAX under Slurm: one device per process unless --cpu-devices
    cfg = from_args(args, world)
    check_paths(cfg)
    if cfg.resume:
        check_resume(cfg)
    return cfg


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    def error(message):
        raise SlurmError(f"bad flags: {message} (see python -m {parser.prog.split()[-1]} --help)")
    parser.error = error
    return parser.parse_args(argv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m course_lib.apps.slurm", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pf = sub.add_parser("preflight", help="check a capstone job before srun (exit 2 and one line if it cannot run)")
    pf.add_argument("framework", choices=sorted(OWNED))
    pf.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node (torch: torchrun's)")
    pf.add_argument("--ckpt-dir", required=True, help="the checkpoint folder the script passes")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)   # after "--": the capstone's flags, untouched
    a, train_args = p.parse_args(argv[:cut]), argv[cut + 1:]
    from course_lib.apps.train_config import ConfigError
    prog = f"capstone-{a.framework}"
    try:
        job = job_from_env()
        cfg = preflight(a.framework, train_args, a.ckpt_dir, job, a.nproc_per_node)
    except (SlurmError, ConfigError) as e:
        print(f"{prog}: {e}", file=sys.stderr, flush=True)
        return 2
    launch = (f"{job.nodes} node(s) x {a.nproc_per_node} rank(s)" if a.framework == "torch"
              else f"{job.tasks} process(es) on {job.nodes} node(s)")
    print(f"{prog}: job {job.job_id}, start {job.restarts + 1}: {launch}, world size {cfg.world_size}, "
          f"checkpoints in {a.ckpt_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
