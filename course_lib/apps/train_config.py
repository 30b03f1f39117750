"""The training scripts' configuration: one frozen dataclass, every flag checked before any rank trains.

Shared by ``python -m course_lib.train`` (torch) and ``python -m course_lib.train_jax`` (JAX). A cluster
job that dies after queueing for an hour on a typo is the worst kind of failure, so :class:`TrainConfig`
checks everything it can from the flags and the launcher's environment alone (``WORLD_SIZE`` under
torchrun, process count x local devices under ``jax.distributed``), and :func:`check_resume` compares a
checkpoint's recorded configuration with the new one *before* the model is built. Every error names the
values involved and the fix. Importing this module imports neither torch nor JAX.

Longer than ~300 lines: every check a run's inputs get before any rank starts (flags, ranks the machine can hold,
the checkpoint folder's record and framework) lives here, so the two scripts and the launcher ask one module.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TrainConfig", "ConfigError", "add_arguments", "from_args", "check_resume", "check_paths", "check_ranks",
           "check_folder", "rank_limit", "write_run_record", "RUN_RECORD", "MODEL_FIELDS", "quiet_parser_errors",
           "wait_for_rank_0", "FRAMEWORKS"]

RUN_RECORD = "run.json"   #: in the checkpoint directory: the configuration that wrote the checkpoints
MODEL_FIELDS = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")  #: must match to resume
DATA_FIELDS = ("batch", "data_seed")   #: must match too: the data position counts global batches of this size
#: who writes which checkpoints, and how a person resumes them (named when the other script is pointed at them)
FRAMEWORKS = {
    "torch": ("DCP", "course_lib.train",
              "python -m course_lib.torchrun --standalone --nproc-per-node N -m course_lib.train --ckpt-dir {d} --resume"),
    "jax": ("Orbax", "course_lib.train_jax", "python -m course_lib.train_jax --ckpt-dir {d} --resume"),
}
RANKS_PER_CORE = 4          #: CPU ranks beyond this per core only wait for each other (gloo busy-polls)
RANK_BYTES = 400 << 20      #: a CPU rank of the capstone: torch, gloo, the model, its share of the batch (~300 MB RSS)


class ConfigError(ValueError):
    """A configuration that cannot train; the message names every value involved and the fix."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs, validated in ``__post_init__`` against ``world_size`` (ranks or devices)."""

    world_size: int               #: WORLD_SIZE (torch) or jax.device_count() (JAX)
    replicate: int = 1            #: R, copies of every shard (HSDP's outer mesh dim); 1 = plain FSDP
    shard: int = 0                #: F, ranks one copy is cut across; 0 = world_size // replicate
    vocab_size: int = 67
    seq_len: int = 30
    d_model: int = 66
    n_heads: int = 3
    n_layers: int = 3
    d_ff: int = 198
    batch: int = 8                #: GLOBAL batch (rows per step, all ranks together)
    steps: int = 20
    lr: float = 3e-3
    warmup: int = 8
    seed: int = 0                 #: weights
    data_seed: int = 0            #: the token stream
    bf16: bool = False            #: bf16 compute, fp32 master weights and gradient reduction
    act_ckpt: bool = False        #: recompute each block's activations in backward
    compile: bool = False         #: torch.compile each block (torch) -- JAX always compiles
    ckpt_dir: str | None = None   #: where numbered checkpoints go (None: no checkpoints)
    ckpt_every: int = 0           #: save every K steps (0: only at SIGTERM and at the end)
    keep: int = 2                 #: keep the newest K complete checkpoints
    resume: bool = False          #: start from the newest complete checkpoint in ckpt_dir
    save_errors: str = "stop"     #: when a checkpoint save fails (a full disk): "stop" the run, or "continue" ("warn") training
    jsonl: str | None = None      #: JSON-lines log (rank 0 / process 0); not --log: torchrun would take it
    throttle: float = 0.0         #: seconds of sleep per step (tests: leave time to kill a job mid-run)

    def __post_init__(self):
        ints = {k: getattr(self, k) for k in ("world_size", "replicate", "vocab_size", "seq_len", "d_model", "n_heads",
                                               "n_layers", "d_ff", "batch", "steps", "warmup", "keep")}
        bad = [f"{_flag(k)} {v} must be a positive int (default {_default(k)})" for k, v in ints.items()
               if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        bad += [f"{_flag(k)} {getattr(self, k)} must be >= 0 (default {_default(k)})"
                for k in ("shard", "ckpt_every", "seed", "data_seed", "throttle") if getattr(self, k) < 0]
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            bad.append(f"--lr {self.lr} must be a positive learning rate (default {_default('lr')})")
        if bad:
            raise ConfigError("bad configuration, nothing was started: " + "; ".join(bad))
        if self.shard == 0:
            object.__setattr__(self, "shard", self.world_size // self.replicate or 1)
        errors = []
        R, F, N = self.replicate, self.shard, self.world_size
        if R * F != N:
            divs = [f for f in range(1, N + 1) if N % f == 0]
            errors.append(f"replicate({R}) * shard({F}) != WORLD_SIZE({N}): the mesh must cover every rank; pick "
                          f"--shard from the divisors of {N}: {divs} and --replicate {N}//shard "
                          f"(e.g. --replicate 1 --shard {N} for FSDP)")
        if self.batch % N:
            errors.append(f"batch({self.batch}) % WORLD_SIZE({N}) = {self.batch % N}: every rank takes batch/N rows "
                          f"of the global batch; use --batch {max(N, self.batch - self.batch % N)} or "
                          f"{self.batch + N - self.batch % N}")
        if self.d_model % self.n_heads:
            errors.append(f"d_model({self.d_model}) % n_heads({self.n_heads}) = {self.d_model % self.n_heads}: heads "
                          f"split d_model evenly; pick --n-heads from the divisors of {self.d_model}")
        if self.save_errors not in ("stop", "continue", "warn"):
            errors.append(f"--save-errors {self.save_errors!r} must be 'stop' or 'continue' (or its alias 'warn')")
        if (self.resume or self.ckpt_every) and not self.ckpt_dir:
            errors.append(f"resume={self.resume}, ckpt_every={self.ckpt_every} but no --ckpt-dir: say where "
                          "checkpoints live")
        if errors:   # one line, every problem in it: each rank would print a multi-line one interleaved
            raise ConfigError("bad configuration, nothing was started: " + "; ".join(errors))

    def model_config(self):
        from course_lib.models import GPTConfig
        return GPTConfig(**{k: getattr(self, k) for k in MODEL_FIELDS})

    def record(self) -> dict:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "WORLD_SIZE" if name == "world_size" else "--" + name.replace("_", "-")


def _default(name: str):
    return {f.name: f.default for f in dataclasses.fields(TrainConfig)}.get(name)


def check_paths(cfg) -> None:
    """What the flags ask of the filesystem, before any rank starts: the ``--jsonl`` folder exists and is
    writable, the checkpoint folder is writable (or can be created), and ``--resume`` names a folder that
    exists -- a typo must not silently start afresh. ``cfg``: a :class:`TrainConfig` or the parsed flags (its
    ``jsonl``, ``ckpt_dir``, ``resume``). Raises :class:`ConfigError` (one line)."""
    import os
    errors = []
    if cfg.jsonl:
        folder = Path(cfg.jsonl).resolve().parent
        if not folder.is_dir():
            errors.append(f"--jsonl {cfg.jsonl}: the folder {folder} does not exist; create it (mkdir -p {folder}) "
                          "or log elsewhere")
        elif not os.access(folder, os.W_OK):
            errors.append(f"--jsonl {cfg.jsonl}: the folder {folder} is not writable; log elsewhere")
    if cfg.ckpt_dir:
        root = Path(cfg.ckpt_dir)
        if cfg.resume and not root.exists():
            errors.append(f"--resume --ckpt-dir {cfg.ckpt_dir}: no such folder, so nothing to resume; check the path "
                          f"(a typo would silently start afresh), or drop --resume (for a job that always passes "
                          f"--resume, create the folder before its first launch: mkdir -p {cfg.ckpt_dir})")
        elif root.exists() and not root.is_dir():
            errors.append(f"--ckpt-dir {cfg.ckpt_dir} is a file, not a folder; point it at a folder")
        else:
            existing = next(p for p in [root, *root.resolve().parents] if p.exists())
            if not os.access(existing, os.W_OK):
                errors.append(f"--ckpt-dir {cfg.ckpt_dir}: {existing} is not writable (read-only?), so no checkpoint "
                              "could be saved; point --ckpt-dir at a writable folder")
    if errors:
        raise ConfigError("bad configuration, nothing was started: " + "; ".join(errors))


def rank_limit() -> tuple[int, str]:
    """How many CPU ranks this machine holds, and why: ``RANKS_PER_CORE`` per core this process may run on, and
    no more than the available memory holds at ``RANK_BYTES`` each; ``COURSE_LIB_MAX_WORLD_SIZE`` overrides both
    (for people who know what they do)."""
    import os
    override = os.environ.get("COURSE_LIB_MAX_WORLD_SIZE")
    if override:
        return int(override), "COURSE_LIB_MAX_WORLD_SIZE"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        avail = next(int(line.split()[1]) << 10 for line in open("/proc/meminfo") if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    by_cores, by_memory = RANKS_PER_CORE * cores, max(1, avail // RANK_BYTES)
    cores_text = f"{RANKS_PER_CORE} per CPU core x {cores} core(s): more only wait for each other"
    memory_text = f"~{RANK_BYTES >> 20} MB per rank of {avail / 2**30:.1f} GiB available memory"
    if by_memory < by_cores:
        return by_memory, f"memory: {memory_text}; the cores would allow {by_cores}"
    return by_cores, f"cores: {cores_text}; memory would allow {by_memory}"


def check_ranks(local_ranks: int, limit: int | None = None, gpus: int = 0) -> None:
    """More ranks on this machine than it can hold (``--nproc-per-node``): :class:`ConfigError`, one line naming
    the limit and its cause. ``limit``: default :func:`rank_limit`. Checked before any batch arithmetic."""
    if gpus and local_ranks > gpus:
        raise ConfigError(f"bad configuration, nothing was started: --nproc-per-node {local_ranks} but this machine "
                          f"has {gpus} GPU(s): one rank per GPU; use --nproc-per-node {gpus}")
    if gpus:
        return
    limit, why = rank_limit() if limit is None else (limit, "the caller's limit")
    if local_ranks > limit:
        raise ConfigError(f"bad configuration, nothing was started: --nproc-per-node {local_ranks} is more ranks than "
                          f"this machine can run ({limit}: {why}); use --nproc-per-node {limit} or fewer, or more "
                          f"nodes (COURSE_LIB_MAX_WORLD_SIZE={local_ranks} overrides this check)")


def _field_help() -> dict[str, str]:
    """Each field's ``#:`` comment in this file: the flags' help text comes from the one place it is written."""
    src = Path(__file__).read_text()
    return dict(re.findall(r"^    (\w+): [^#\n]*#: (.*)$", src, flags=re.M))


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags both scripts share (``--d-model 66`` ... ``--resume``); ``world_size`` comes from the launcher."""
    helps = _field_help()
    for f in dataclasses.fields(TrainConfig):
        if f.name == "world_size":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            p.add_argument(flag, action="store_true", help=helps.get(f.name, ""))
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(flag, type=kind, default=f.default, help=f"{helps.get(f.name, '')} (default {f.default})")
    return p


#: How long a silent rank waits after a start-up error, under torchrun, before it exits too. torchrun stops every
#: other worker as soon as one exits: a silent rank that exited first had rank 0 stopped before it printed its line
#: (seen on a loaded machine: only torchrun's ChildFailedError, no reason). Rank 0's exit ends the wait at once
#: (torchrun's SIGTERM); on another node it ends after this many seconds.
QUIET_RANK_WAIT_S = 10.0


def wait_for_rank_0(rank: int) -> None:
    """On a rank other than 0 under torchrun: give rank 0 time to print why the run cannot start (see above)."""
    import os
    import time
    if rank != 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(QUIET_RANK_WAIT_S)


def quiet_parser_errors(p: argparse.ArgumentParser, rank: int) -> argparse.ArgumentParser:
    """argparse's own errors (an unknown flag, ``--steps abc``) in one line from rank 0 only, exit status 2 on
    every rank: under torchrun every worker parses the same argv, and N usage blocks say nothing more."""
    def error(message):
        if rank == 0:
            p.exit(2, f"{p.prog}: bad flags, nothing was started: {message} (see --help)\n")
        wait_for_rank_0(rank)
        p.exit(2)
    p.error = error
    return p


def from_args(args: argparse.Namespace, world_size: int) -> TrainConfig:
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "world_size"]
    return TrainConfig(world_size=world_size, **{k: getattr(args, k) for k in names if hasattr(args, k)})


def read_run_record(folder) -> dict | None:
    """``<folder>/run.json`` (None if absent); :class:`ConfigError` in one line when it is damaged or not one."""
    path = Path(folder) / RUN_RECORD
    if not path.is_file():
        return None
    fix = (f"restore it, or delete it to resume anyway (the checkpoint's own shapes are still compared with the "
           "model's)")
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:   # JSONDecodeError, UnicodeDecodeError: truncated or overwritten
        raise ConfigError(f"{path} is damaged ({type(e).__name__}: {str(e).splitlines()[0]}): it records the "
                          f"configuration that wrote the checkpoints; {fix}") from None
    if not isinstance(old, dict) or not all(isinstance(old.get(k), int) for k in MODEL_FIELDS):
        raise ConfigError(f"{path} is not a course_lib run record (no {', '.join(MODEL_FIELDS)}): it records the "
                          f"configuration that wrote the checkpoints; {fix}")
    return old


def folder_framework(folder) -> tuple[str | None, list[int]]:
    """Which script's checkpoints ``folder`` holds -- ``"torch"`` (DCP: ``step_00000012``), ``"jax"`` (Orbax:
    ``12``, ``12.orbax-checkpoint-tmp*``), ``"both"``, or None -- and their committed steps."""
    root = Path(folder)
    if not root.is_dir():
        return None, []
    torch_steps, jax_steps, torch_any, jax_any = [], [], False, False
    for p in root.iterdir():
        if not p.is_dir():
            continue
        name = p.name
        if name.startswith("step_"):
            torch_any = True
            if name[5:].isdigit():
                torch_steps.append(int(name[5:]))
        elif name.isdigit() or ".orbax-checkpoint-tmp" in name:
            jax_any = True
            if name.isdigit():
                jax_steps.append(int(name))
    kind = "both" if torch_any and jax_any else "torch" if torch_any else "jax" if jax_any else None
    return kind, sorted(torch_steps + jax_steps)


def check_folder(cfg, framework: str) -> None:
    """The checkpoint folder fits this script (``framework``: ``"torch"`` or ``"jax"``) and this start, before any
    rank starts: a folder of the other script's checkpoints is named as such, with the command that resumes it;
    a damaged ``run.json`` is one line; a start without ``--resume`` never overwrites or prunes checkpoints that
    are already there. ``cfg``: a :class:`TrainConfig` or the parsed flags."""
    if not cfg.ckpt_dir:
        return
    d = cfg.ckpt_dir
    kind, steps = folder_framework(d)
    record = read_run_record(d)
    recorded = (record or {}).get("framework")
    other = next((f for f in FRAMEWORKS if f != framework), None)
    if kind == "both":
        raise ConfigError(f"--ckpt-dir {d} holds both DCP (step_*) and Orbax (numbered) checkpoint folders: two "
                          "scripts wrote into it; move one set elsewhere, then resume each with its own script")
    if kind == other or (kind is None and recorded == other):
        fmt, script, resume = FRAMEWORKS[other]
        listed = f" (steps {', '.join(map(str, steps))})" if steps else ""
        raise ConfigError(f"--ckpt-dir {d} holds {fmt} checkpoints written by {script}{listed}, not "
                          f"{FRAMEWORKS[framework][0]} checkpoints of {FRAMEWORKS[framework][1]}: resume it with "
                          f"`{resume.format(d=d)}` (same model flags), or point --ckpt-dir at a new folder")
    if steps and not cfg.resume:
        raise ConfigError(f"--ckpt-dir {d} already holds checkpoints (steps {', '.join(map(str, steps))}) and this run "
                          "was not asked to resume: it would overwrite and prune them; continue them with --resume, "
                          "or point --ckpt-dir at a new folder")


def check_resume(cfg: TrainConfig) -> dict | None:
    """The recorded configuration of ``cfg.ckpt_dir`` (None if there is none); raises :class:`ConfigError`
    naming every model or data field that differs -- before the model is built, on every rank alike -- or
    saying that ``run.json`` is damaged."""
    if not cfg.ckpt_dir:
        return None
    old = read_run_record(cfg.ckpt_dir)
    if old is None:
        return None
    diff = {k: (old.get(k), getattr(cfg, k)) for k in MODEL_FIELDS + DATA_FIELDS if old.get(k) != getattr(cfg, k)}
    if diff:
        what = ", ".join(f"{k} saved {a} vs now {b}" for k, (a, b) in diff.items())
        flags = " ".join(f"--{k.replace('_', '-')} {a}" for k, (a, _) in diff.items())
        raise ConfigError(f"the checkpoint in {cfg.ckpt_dir} is from a different model or data stream: {what}; "
                          f"resume with {flags}, or point --ckpt-dir at a new directory to start afresh")
    return old


def write_run_record(cfg: TrainConfig, framework: str | None = None) -> None:
    """Rank 0: record the configuration next to the checkpoints (world size and mesh may change on resume), and
    which script's checkpoints they are (``framework``: ``"torch"`` or ``"jax"``)."""
    root = Path(cfg.ckpt_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / (RUN_RECORD + ".tmp")
    record = cfg.record() if framework is None else {**cfg.record(), "framework": framework}
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(root / RUN_RECORD)
