"""Distributed checkpoints in JAX with Orbax: save sharded state, restore it onto another mesh.

The words are :mod:`~course_lib.checkpoint.dcp`'s. What differs from torch DCP:

* **async by default** -- ``CheckpointManager.save`` returns once the arrays are copied to host memory;
  the files are written in the background. ``wait_until_finished()`` before reading the directory (or
  exiting). Orbax writes step ``s`` into ``s.orbax-checkpoint-tmp`` and renames it to ``s`` when every
  host finished (plus ``commit_success.txt``): the same write-then-commit as
  :mod:`~course_lib.checkpoint.manager`.
* **the restore target decides the layout** -- a ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` per
  array. With a ``NamedSharding`` on the new mesh Orbax reads each device's slice straight into place
  (8 devices -> 4 -> 1). Without a sharding it falls back to the layout saved in the checkpoint: the old
  mesh, which may not exist here. ``nnx.eval_shape`` gives shapes and dtypes but *drops* shardings
  (flax#5110), so the targets are built explicitly (:func:`restore_target`).
* **RNG** -- JAX has no hidden generator state: a key is a value. Derive per-step keys with
  ``jax.random.fold_in(key, step)`` and the step number is all the RNG state a resume needs.
* **one writer per folder** -- Orbax's manager prunes every step beyond ``max_to_keep``, whoever wrote it, so
  the manager made here takes the folder's owner lock before its first save
  (:mod:`~course_lib.checkpoint.owner`, :func:`claim_folder`: process 0 takes it, every process raises
  the same :class:`~course_lib.checkpoint.owner.FolderBusy` naming the owner) and releases it on
  ``close()``. Restoring never locks, nor writes.

Importing this module imports neither JAX nor Orbax.
"""
from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

from course_lib.strategies.fsdp.jax import fsdp_spec

__all__ = ["manager", "claim_folder", "save", "restore", "restore_target", "train_state", "put_state", "same_arrays",
           "incomplete_steps", "saved_shapes", "shapes_of"]


def manager(directory, keep: int = 2, *, enable_async: bool = True, lock: bool = True, command: str | None = None):
    """An ``ocp.CheckpointManager`` on ``directory`` keeping the newest ``keep`` steps (async saves:
    call ``.wait_until_finished()`` before reading the files; ``.close()`` when done).

    Its first ``save`` takes the folder (:func:`claim_folder`; ``lock=False``: the caller already holds it or
    arbitrates writers itself); ``close()`` releases it. ``.owner``: process 0's lock once taken."""
    import orbax.checkpoint as ocp
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be an int >= 1")
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=enable_async)
    mngr = _manager_class()(Path(directory).absolute(), options=options)
    mngr.course_lock = lock
    mngr.course_command = command
    return mngr


@functools.cache
def _manager_class():
    """``ocp.CheckpointManager`` plus the folder's owner lock: taken before the first save, released by close()."""
    import orbax.checkpoint as ocp

    class Manager(ocp.CheckpointManager):
        owner = None
        course_lock, course_command = True, None

        def save(self, step, *args, **kwargs):
            if self.course_lock:
                self.owner = claim_folder(os.fspath(self.directory), command=self.course_command)
                self.course_lock = False   # held from now on (None on the other processes)
            return super().save(step, *args, **kwargs)

        def close(self):
            try:
                super().close()
            finally:
                if self.owner is not None:
                    self.owner.release()
                    self.owner = None
    return Manager


_claims = itertools.count()   # every process claims in the same order (saves are collective): one key per claim


def claim_folder(directory, *, command: str | None = None, run_id: str | None = None):
    """Take ``directory`` for this run (:func:`~course_lib.checkpoint.owner.take`) on process 0 and
    tell the others through ``jax.distributed``'s key-value store: a folder held by another live writer is
    :class:`~course_lib.checkpoint.owner.FolderBusy` on *every* process (none is left waiting in a
    collective), naming the owner; a folder that cannot be written, ``OSError`` on every process. Returns the
    lock on process 0 (its ``.stale``: a dead owner taken over), None on the others. Collective."""
    import sys
    import jax
    from course_lib.checkpoint import owner
    command = command or " ".join([Path(sys.executable).name] + sys.argv)[:300]
    lock, said = None, "ok"
    if jax.process_index() == 0:
        try:
            lock = owner.take(directory, command=command, run_id=run_id)
        except owner.FolderBusy as e:
            said = "busy:" + str(e)
        except OSError as e:
            said = f"oserror:cannot write checkpoints to {directory}: {e.strerror or e}"
    if jax.process_count() > 1:
        from jax._src.distributed import global_state
        key = f"course_lib/ckpt_owner/{next(_claims)}"
        if jax.process_index() == 0:
            global_state.client.key_value_set(key, said)
        else:
            said = global_state.client.blocking_key_value_get(key, 300_000)
    kind, _, msg = said.partition(":")
    if kind == "busy":
        raise owner.FolderBusy(msg)
    if kind == "oserror":
        raise OSError(msg)
    return lock


def train_state(model, optimizer) -> dict:
    """The pytree that must travel: ``{"model": nnx.state(model), "opt": nnx.state(optimizer)}``
    (parameters; Adam's ``m``, ``v`` and its step count)."""
    from flax import nnx
    return {"model": nnx.state(model), "opt": nnx.state(optimizer)}


def put_state(model, optimizer, state: dict) -> None:
    """Write a restored :func:`train_state` back into ``model`` and ``optimizer`` (in place)."""
    from flax import nnx
    nnx.update(model, state["model"])
    nnx.update(optimizer, state["opt"])


def save(mngr, step: int, state, meta: dict | None = None) -> bool:
    """Save ``state`` (any pytree of arrays) and ``meta`` (JSON: data position, config...) as ``step``.
    Returns at once (async); the step exists on disk after ``mngr.wait_until_finished()``."""
    import orbax.checkpoint as ocp
    return mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta or {})))


def restore_target(state, mesh, rule=fsdp_spec, **kw):
    """The restore target for ``state`` on ``mesh``: per array, ``ShapeDtypeStruct(shape, dtype,
    sharding=NamedSharding(mesh, rule(shape, mesh.size)))`` -- the reference answer of Lab 07's exercise.
    ``state`` may hold arrays or ShapeDtypeStructs (from ``nnx.eval_shape``, whose shardings are gone)."""
    import jax
    from jax.sharding import NamedSharding
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, rule(tuple(x.shape), mesh.size, **kw))), state)


def restore(mngr, step: int, target) -> tuple:
    """``(state, meta)`` of ``step``, every array laid out as ``target`` says (see :func:`restore_target`)."""
    import jax
    import orbax.checkpoint as ocp
    missing = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(target)[0]
               if getattr(x, "sharding", None) is None]
    if missing:
        raise ValueError(f"restore target has no sharding for {len(missing)} array(s), e.g. {missing[:3]}: Orbax "
                         "would put them back on the mesh they were saved from; build the target with "
                         "jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(new_mesh, spec))")
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                      meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]


def same_arrays(a, b) -> list[str]:
    """Paths of the arrays of two pytrees whose values differ bit for bit (empty: identical)."""
    import jax
    import numpy as np
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    if len(fa) != len(fb):
        return [f"{len(fa)} arrays vs {len(fb)}"]
    return [jax.tree_util.keystr(p) for (p, x), y in zip(fa, fb)
            if np.asarray(x).shape != np.asarray(y).shape or not np.array_equal(np.asarray(x), np.asarray(y))]


def incomplete_steps(directory) -> list[str]:
    """Orbax's unfinished saves under ``directory``: ``<step>.orbax-checkpoint-tmp*`` (never listed as steps)."""
    d = Path(directory)
    return sorted(p.name for p in d.iterdir() if ".orbax-checkpoint-tmp" in p.name) if d.is_dir() else []


def shapes_of(tree) -> dict[str, tuple]:
    """``"model.blocks.0.attn.qkv.kernel.value" -> shape`` for every array (or ShapeDtypeStruct) of a pytree."""
    import jax
    def name(k):   # DictKey.key, SequenceKey.idx, GetAttrKey.name
        return str(next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)), k))
    return {".".join(name(k) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0] if hasattr(x, "shape")}


def saved_shapes(directory) -> tuple[int, dict[str, tuple]] | None:
    """``(step, {name: shape})`` of the newest complete step under ``directory`` whose ``state`` metadata Orbax
    can read (global shapes, from the checkpoint's own ``_METADATA`` and array metadata; no array is read).
    None when there is none."""
    import orbax.checkpoint as ocp
    d = Path(directory)
    steps = sorted((int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True) \
        if d.is_dir() else []
    for step in steps:
        try:
            meta = ocp.StandardCheckpointHandler().metadata(d / str(step) / "state")
        except Exception:  # noqa: BLE001 - damaged metadata: Orbax's restore will name it; try an older step
            continue
        return step, shapes_of(meta)
    return None
