"""Distributed checkpoints in torch (DCP): what must travel for an exact resume, and save / load / reshard.

Vocabulary, used the same way in :mod:`~course_lib.checkpoint.manager`,
:mod:`~course_lib.checkpoint.orbax` and Lab 07:

* **sharded checkpoint** -- a directory that ``torch.distributed.checkpoint`` (DCP) wrote: one file per
  rank (``__<rank>_0.distcp``: that rank's shards, nothing gathered) and one ``.metadata`` file (which
  byte range of which file holds which slice of which tensor). DCP writes ``.metadata`` *last*, through a
  temporary name and a rename, so a directory without it is an unfinished save.
* **app state** -- everything a bit-exact resume needs: model, optimizer (Adam's ``m``, ``v``, step),
  LR schedule, data position, and each rank's RNG. :class:`AppState` bundles them as a DCP ``Stateful``.
* **reshard on load** -- DCP's load is *in place* into a state dict whose tensors are already laid out
  for the current mesh (``get_state_dict``); the metadata says where each requested slice lives, so a
  checkpoint written at 4 ranks loads at 2, at 1, or into HSDP, bit for bit.
* **consolidate** -- turn the sharded directory into one ``torch.save`` file (deployment), and back.

As in "Train Your Large Model on Multiple GPUs with Fully Sharded Data Parallelism": every rank calls
``dcp.save`` / ``dcp.load`` (they are collective), and ``dcp_to_torch_save`` makes one model file after
training. Importing this module imports neither torch.distributed nor JAX.
"""
from __future__ import annotations

import os
from pathlib import Path

from course_lib.checkpoint.resumable import ResumableBatches, resumable_run, train_step  # noqa: F401 (re-exported)

__all__ = ["AppState", "ResumableBatches", "resumable_run", "train_step", "load_model_and_optimizer", "CheckpointMismatch", "save", "load", "read_metadata", "files_on_disk",
           "check_compatible", "consolidate", "to_dcp", "full_state", "state_bytes"]


class CheckpointMismatch(ValueError):
    """The checkpoint does not fit the state it is loaded into: names every missing key and wrong shape."""


# -- what must travel ----------------------------------------------------------------------------------
class AppState:
    """A DCP ``Stateful``: model + optimizer (+ LR schedule, data position, this rank's RNG).

    ``dcp.save({"app": AppState(...)}, checkpoint_id=path)`` calls :meth:`state_dict` on every rank;
    ``dcp.load`` calls it for a template, fills it in place, then calls :meth:`load_state_dict`.
    ``get_state_dict`` / ``set_state_dict`` key the optimizer state by parameter *name* (a plain
    ``optimizer.state_dict()`` keys it by position, and cannot be resharded). The RNG state differs per
    rank, so it is keyed ``rng.rank<r>`` (one key for all ranks would keep rank 0's only). ``rng=False``
    leaves it out: needed to load at a world size with ranks the checkpoint never had. ``None`` for
    ``optimizer``, ``scheduler`` or ``data`` leaves that piece out (Lab 07 measures what each costs).
    """

    def __init__(self, model, optimizer, scheduler=None, data=None, *, rank: int | None = None, rng: bool = True):
        self.model, self.optimizer, self.scheduler, self.data, self.rng = model, optimizer, scheduler, data, rng
        if rank is None:
            import torch.distributed as dist
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank = rank

    def state_dict(self) -> dict:
        import torch
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
        if self.optimizer is None:     # a model alone (optimizer=None: what forgetting it does to a resume)
            sd = {"model": get_model_state_dict(self.model)}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            sd = {"model": model_sd, "optim": optim_sd}
        if self.scheduler is not None:
            sd["sched"] = self.scheduler.state_dict()
        if self.data is not None:
            sd["data"] = self.data.state_dict()
        if self.rng:
            sd["rng"] = {f"rank{self.rank}": torch.get_rng_state()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                sd["cuda_rng"] = {f"rank{self.rank}": torch.cuda.get_rng_state()}
        return sd

    def load_state_dict(self, sd: dict) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
        if self.optimizer is None:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sd["sched"])
        if self.data is not None:
            self.data.load_state_dict(sd["data"])
        if self.rng:
            torch.set_rng_state(sd["rng"][f"rank{self.rank}"])
            if "cuda_rng" in sd:
                torch.cuda.set_rng_state(sd["cuda_rng"][f"rank{self.rank}"])


# -- save, load, inspect -------------------------------------------------------------------------------
def _single_process():
    """True when no process group is up: DCP then reads and writes in this one process."""
    import torch.distributed as dist
    return not dist.is_initialized()


def save(state: dict, path, *, group=None):
    """``dcp.save(state, checkpoint_id=path)`` on every rank of ``group`` (or in one process without a
    process group); returns DCP's ``Metadata``."""
    import torch.distributed.checkpoint as dcp
    with quiet_single_process():
        return dcp.save(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=_single_process())


def load(state: dict, path, *, group=None, strict: bool = True) -> None:
    """Fill ``state`` in place from the checkpoint at ``path`` (any world size, any mesh), after
    :func:`check_compatible` so that a wrong model fails with every mismatch named."""
    import torch.distributed.checkpoint as dcp
    check_compatible(state, path, strict=strict)
    with quiet_single_process():
        dcp.load(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=_single_process())


def quiet_single_process():
    """A context that hides DCP's "assuming the intent is to save/load in a single process" warning."""
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")
            yield
    return ctx()


def load_model_and_optimizer(model, optimizer, path, *, group=None) -> None:
    """Load a ``{"model": ..., "optim": ...}`` DCP checkpoint into ``model`` + ``optimizer`` built for the
    current mesh (any world size, FSDP2, HSDP or a plain module)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    state = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
    load(state, path, group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def read_metadata(path):
    """DCP's ``Metadata`` of the checkpoint at ``path`` (raises ``FileNotFoundError`` naming ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader
    meta = Path(path) / ".metadata"
    if not meta.is_file():
        raise FileNotFoundError(f"{meta} does not exist: the checkpoint at {path} is incomplete (DCP writes "
                                ".metadata last, after every rank's file) or the path is wrong")
    return FileSystemReader(os.fspath(path)).read_metadata()


def files_on_disk(path) -> dict[str, int]:
    """File name -> bytes, for every file of the checkpoint directory ``path`` (sorted by name)."""
    return {f.name: f.stat().st_size for f in sorted(Path(path).iterdir()) if f.is_file()}


def _flat_template(state: dict) -> dict:
    """The flattened state DCP would request: Stateful objects asked for their state_dict, keys dotted."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict") else v)
             for k, v in state.items()}
    return flatten_state_dict(plain)[0]


def check_compatible(state: dict, path, *, strict: bool = True) -> None:
    """Raise :class:`CheckpointMismatch` naming every key ``state`` asks for that the checkpoint lacks,
    every shape that differs, and (``strict``) every model/optimizer key the checkpoint has that
    ``state`` does not ask for (a checkpoint of another model). RNG and scalars are compared by key only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    saved = read_metadata(path).state_dict_metadata
    want = _flat_template(state)
    missing = sorted(k for k in want if k not in saved)
    shapes = [f"{k}: checkpoint {list(saved[k].size)}, now {list(v.shape)}" for k, v in want.items()
              if k in saved and isinstance(saved[k], TensorStorageMetadata) and hasattr(v, "shape")
              and tuple(saved[k].size) != tuple(v.shape)]
    dtypes = [f"{k}: checkpoint {saved[k].properties.dtype}, now {v.dtype}" for k, v in want.items()
              if k in saved and isinstance(saved[k], TensorStorageMetadata) and hasattr(v, "dtype")
              and tuple(saved[k].size) == tuple(getattr(v, "shape", ())) and saved[k].properties.dtype != v.dtype]
    prefixes = {".".join(k.split(".")[:2]) + "." for k in want if ".rng." not in f".{k}"}  # app.model., app.optim.
    extra = sorted(k for k, md in saved.items() if k not in want and isinstance(md, TensorStorageMetadata)
                   and k.startswith(tuple(prefixes))) if strict else []  # tensors only: groups' extra keys are fine
    if missing or shapes or extra or dtypes:
        parts = [f"{len(shapes)} shape mismatch(es): " + "; ".join(shapes[:4]) + (" ..." if len(shapes) > 4 else "")] \
            if shapes else []
        parts += [f"{len(dtypes)} dtype mismatch(es): " + "; ".join(dtypes[:4]) + (" ..." if len(dtypes) > 4 else "")] \
            if dtypes else []
        parts += [f"missing from the checkpoint: {missing[:8]}" + (f" and {len(missing) - 8} more" if len(missing) > 8
                                                                   else "")] if missing else []
        parts += [f"in the checkpoint but not in this model: {extra[:8]}" + (
            f" and {len(extra) - 8} more" if len(extra) > 8 else "")] if extra else []
        rng_only = not shapes and not extra and not dtypes and all("rng." in k for k in missing)
        fix = ("the RNG state is per rank and this world size has ranks the checkpoint never had: load "
               "without it (AppState(..., rng=False)) and seed the new ranks" if rng_only else
               "build the model from the config it was saved with")
        raise CheckpointMismatch(f"checkpoint {path} does not fit the state being loaded: " + " | ".join(parts)
                                 + f". Fix: {fix}")


def consolidate(dcp_dir, out_file) -> dict[str, int]:
    """One ``torch.save`` file from a sharded checkpoint, in ONE process (no process group): every tensor
    whole, keys as saved (``app.model.tok_emb.weight``). Returns ``files_on_disk`` of the result's folder."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(os.fspath(dcp_dir), os.fspath(out_file))
    return {Path(out_file).name: Path(out_file).stat().st_size}


def to_dcp(torch_file, dcp_dir) -> None:
    """The way back: a ``torch.save`` file -> a DCP directory (written by one process, loadable at any N)."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp
    torch_save_to_dcp(os.fspath(torch_file), os.fspath(dcp_dir))


# -- comparing states ----------------------------------------------------------------------------------
def full_state(model, optimizer=None) -> dict:
    """Every tensor of model (+ optimizer) state gathered whole, by name, on every rank (collective when
    sharded): ``model.<fqn>``, ``optim.<fqn>.exp_avg`` ... -- comparable across world sizes and meshes."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    opts = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        msd, osd = get_model_state_dict(model, options=opts), {}
    else:
        msd, osd = get_state_dict(model, optimizer, options=opts)
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for name, st in osd.get("state", {}).items():
        for k, v in st.items():
            out[f"optim.{name}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def state_bytes(state: dict) -> int:
    """Tensor payload bytes of a (nested) state dict, local shards only: what this rank holds."""
    import torch
    from torch.distributed.tensor import DTensor
    total = 0
    for v in (state.values() if isinstance(state, dict) else state):
        if isinstance(v, dict):
            total += state_bytes(v)
        elif isinstance(v, torch.Tensor):
            t = v.to_local() if isinstance(v, DTensor) else v
            total += t.numel() * t.element_size()
    return total
