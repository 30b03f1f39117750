"""Lab 07's exercise checks (checkpointing): the app state of an exact resume, loading a sharded checkpoint
at another world size, and an Orbax restore target with shardings.

Each check is split in two (:mod:`course_lib.checks.judge`). The *run half*, here, saves, loads and resumes with
the learner's code and returns plain facts: on gloo ranks, each rank's weights and Adam tensors after the load
(gathered whole, by name), its param groups, schedule step, data position and RNG state, the losses of the steps
after the resume, the keys the checkpoint holds and the bytes each rank read; for the Orbax target, each leaf's
kind, shape, dtype and sharding (its spec, its mesh) and the restored values. The AppState's load runs in fresh
rank processes, as a resume after a crash does: nothing its save left in memory survives. The *judge half*,
:mod:`~course_lib.checks.lab07_judge`, computes the reference (the run that never stopped, on library-only ranks)
and names the piece that did not travel -- continuing the run matters, since some mistakes (fresh param groups, a
stale LR) only show in the steps after a load. ``restore_target``'s two halves are in
:mod:`~course_lib.checks.lab07_orbax`; a crash in the learner's code is recorded as plain data (which call raised,
on which rank) and written out by :mod:`~course_lib.checks.lab07_crash`.
"""
from __future__ import annotations

import tempfile

from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard, unavailable
from course_lib.checks.lab07_crash import answer_of, attempt, crash_info, filled, learner_files, raise_stub
from course_lib.checks.lab07_judge import (CKPT_CONFIG, LOAD_CONFIG, SAVE_STEPS, continue_run, hyper_of,
                                           judge_app_state, judge_load_resharded, reference_checkpoint)
from course_lib.checks.lab07_orbax import judge_restore_target, run_restore_target
from course_lib.checks.registry import exercise

__all__ = ["CKPT_CONFIG", "HINTS", "TESTS", "check_app_state", "check_load_resharded", "check_restore_target"]

#: Layered hints, general to specific (``checks.hint(name, level)``); the last level is near-code.
HINTS = {
    "AppState": [
        "A resume is exact only if every piece of state that the next step reads comes back: the weights, "
        "Adam's moments and step count, the LR schedule's position, where the data stream is, and the RNG.",
        "state_dict() returns one nested dict; load_state_dict() puts each entry back. Use DCP's "
        "get_state_dict / set_state_dict for model + optimizer (names, not positions, so it reshards). "
        "The RNG differs per rank: key it by rank.",
        "get_state_dict(model, optimizer) -> (msd, osd); scheduler.state_dict(); data.state_dict(); "
        "{f'rank{dist.get_rank()}': torch.get_rng_state()}; and back: set_state_dict(model, optimizer, "
        "model_state_dict=..., optim_state_dict=...), scheduler.load_state_dict, data.load_state_dict, "
        "torch.set_rng_state.",
    ],
    "load_resharded": [
        "DCP loads in place: you hand it a state dict already laid out for the current mesh, and it reads "
        "each rank's slices from whichever files hold them. The template must have the saved names.",
        "Build the template with get_state_dict(model, optimizer) under the same top-level keys the save "
        "used, let dcp.load fill it, then hand it back to the model and optimizer.",
        "sd = dict(zip(('model', 'optim'), get_state_dict(model, optimizer))); dcp.load(sd, checkpoint_id=path); "
        "set_state_dict(model, optimizer, model_state_dict=sd['model'], optim_state_dict=sd['optim'])",
    ],
    "restore_target": [
        "Orbax restores each array where its target says: give every array a sharding on the NEW mesh, "
        "chosen by the same rule that placed it when it was saved.",
        "Map over the state: for each array build an abstract array (shape, dtype, sharding) -- no memory "
        "allocated; the sharding is a NamedSharding on `mesh` with the FSDP rule's PartitionSpec.",
        "jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, "
        "fsdp_jax.fsdp_spec(x.shape, mesh.size))), state)",
    ],
}



#: What each check verifies, said in its ⏳ line.
TESTS = {
    "AppState": "on 2 gloo ranks with dropout: your class built after step 1, 2 more steps, dcp.save, then "
                "in fresh rank processes everything rebuilt (other weights, an optimizer with no Adam state yet, "
                "step 0, another seed) and dcp.load with your class; the weights, Adam's state and param groups, the LR schedule, the data position and each "
                "rank's RNG must come back bit for bit, and the next 2 losses equal never stopping",
    "load_resharded": "a {'model', 'optim'} checkpoint saved by FSDP2 + AdamW at 4 ranks, loaded with your "
                      "function into a fresh model and optimizer at 2 ranks: every weight and Adam tensor "
                      "bit-identical to what was saved, the param groups (LR after warm-up, betas, eps, weight "
                      "decay) restored, each rank reading only the saved chunks it needs (not the whole "
                      "checkpoint), and 2 more steps give the losses of the run that never stopped",
    "restore_target": "a small state saved on 8 devices, restored with your targets onto 4 and onto 1: abstract "
                      "arrays, same shapes and dtypes, NamedShardings on the new mesh with the FSDP rule's "
                      "specs, values bit-identical",
}


# -- exercise 1: the app state ------------------------------------------------------------------------
def _app_save_on_rank(cls, cfg, root, before: int = 3) -> dict:
    """Run half, on one rank: 1 step, the learner's AppState built (as a training loop builds it once), ``before``
    - 1 more steps, then dcp.save with it (its state_dict() must read the live state)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from course_lib.checkpoint import dcp as ck
    cls, refs, ex = answer_of(cls)
    files = learner_files(cls)
    with unavailable(refs, ex):
        torch.manual_seed(1000 + dist.get_rank())                # each rank its own dropout stream
        model, opt, sched, data = ck.resumable_run(cfg, seed=0)
        ck.train_step(model, opt, sched, data)
        app, err = attempt(files, f"{cls.__name__}(model, optimizer, scheduler, data)", cls, model, opt, sched, data)
        if err:
            return err
        for _ in range(before - 1):
            ck.train_step(model, opt, sched, data)
        _, err = attempt(files, "dcp.save, which calls your state_dict()", dcp.save, {"app": app}, checkpoint_id=root)
        return err or {}


def _app_load_on_rank(cls, cfg, root, after: int = 2) -> dict:
    """Run half, on one rank of a fresh process: everything rebuilt as a restarted job would (other weights, an
    empty optimizer, step 0, another seed), dcp.load with the learner's AppState; what came back, then ``after``
    more steps' losses."""
    import torch
    import torch.distributed.checkpoint as dcp
    from course_lib.checkpoint import dcp as ck
    cls, refs, ex = answer_of(cls)
    files = learner_files(cls)
    with unavailable(refs, ex):
        torch.manual_seed(7)
        model, opt, sched, data = ck.resumable_run(cfg, seed=1)
        app, err = attempt(files, f"{cls.__name__}(model, optimizer, scheduler, data)", cls, model, opt, sched, data)
        if err:
            return err
        _, err = attempt(files, "dcp.load, which calls your state_dict() for a template, then your load_state_dict()",
                          dcp.load, {"app": app}, checkpoint_id=root)
        if err:
            return err
        out = {"state": ck.full_state(model, opt), "hyper": hyper_of(opt), "sched": sched.last_epoch,
               "data": data.step, "rng": torch.get_rng_state()}
        out["resumed"] = [ck.train_step(model, opt, sched, data) for _ in range(after)]
    return _plain.plain(out)


def run_app_state(cls, world_size: int = 2) -> dict:
    """Run half: save with the learner's AppState on ``world_size`` ranks, then load and continue in fresh ranks."""
    from course_lib.launch import run
    from course_lib.checkpoint import dcp as ck
    with tempfile.TemporaryDirectory() as root:
        save = filled(run(_app_save_on_rank, cls, CKPT_CONFIG, root, world_size=world_size))
        if any("error" in o for o in save):
            return {"save": save}
        keys = sorted(ck.read_metadata(root).state_dict_metadata)
        # fresh rank processes, as a resume after a crash: nothing the save left in memory (a class attribute, a
        # cache, an optimizer's state) is there; the optimizer has no Adam state yet
        load = filled(run(_app_load_on_rank, cls, CKPT_CONFIG, root, world_size=world_size, fresh=True))
    return {"save": save, "keys": keys, "load": load}


@exercise("07", 'AppState', cell='class AppState:', hints=HINTS['AppState'], tests=TESTS['AppState'],
          mistakes={'captured once': 'state captured once and stale later', 'keyed by position': 'keyed by position',
                    'optimizer not restored': "optimizer state (Adam's m, v, step) not restored",
                    'hyper-parameters not restored': "the optimizer's hyper-parameters were not restored",
                    'schedule not restored': 'the schedule is not restored',
                    'data restarts': 'the data stream restarts from the beginning',
                    'data off by': 'the data position is off by', 'one RNG key': 'saved it under the same key',
                    'RNG not restored': 'RNG state not restored',
                    'template keys': 'keys or shapes that differ from the saved ones'},
          guards=("restore",), judge=judge_app_state,
          references=("course_lib.checkpoint.dcp.AppState.state_dict",
                      "course_lib.checkpoint.dcp.AppState.load_state_dict"))
def check_app_state(cls, world_size: int = 2, name: str = "AppState") -> bool:
    """``cls(model, optimizer, scheduler, data)`` is a DCP Stateful after which a resume is bit-exact: built once,
    saved 2 steps later, loaded into fresh objects in fresh processes, then the run continues and is compared with
    never stopping."""
    cls = _guard(cls, "07", "AppState")
    return decide(name, lab="07", tests=TESTS["AppState"], run=lambda: run_app_state(cls, world_size),
                  judge=judge_app_state, params={"world_size": world_size})


# -- exercise 2: load at another world size -----------------------------------------------------------
def _load_on_rank(fn, cfg, path, step: int, after: int = 2) -> dict:
    """Run half, on one rank: the learner's load into a fresh model + AdamW, the bytes of the checkpoint this rank
    read, what came back, then ``after`` more steps' global losses."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from course_lib.checkpoint import dcp as ck
    fn, refs, ex = answer_of(fn)
    model, opt, _, data = ck.resumable_run(cfg, seed=1)
    read, total, real = {}, [0], FileSystemReader.read_data

    def counted(self, plan, planner):     # the bytes of the checkpoint this rank reads: the load's cost
        total[0] = sum(info.length for info in self.storage_data.values())
        read.update({repr(item.storage_index): self.storage_data[item.storage_index].length for item in plan.items})
        return real(self, plan, planner)
    FileSystemReader.read_data = counted
    try:
        with unavailable(refs, ex):
            fn(model, opt, path)
    except NotImplementedError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise_stub(e)
        return {"error": crash_info(e, learner_files(fn), f"{fn.__name__}(model, optimizer, path) at "
                                                         f"{dist.get_world_size()} ranks")}
    finally:
        FileSystemReader.read_data = real
    got = ck.full_state(model, opt)
    data.step = step                      # the data position is not this exercise's: set it as saved
    return _plain.plain({"state": got, "hyper": hyper_of(opt), "read": sum(read.values()), "total": total[0],
                         "resumed": continue_run(model, opt, data, after)})


def run_load_resharded(fn, save_world_size: int = 4, load_world_size: int = 2) -> dict:
    """Run half: a fresh copy of the library's checkpoint saved at ``save_world_size`` ranks, loaded with the
    learner's function at ``load_world_size``."""
    import shutil
    from course_lib.launch import run
    with tempfile.TemporaryDirectory() as path:
        shutil.copytree(reference_checkpoint(save_world_size)[0], path, dirs_exist_ok=True)   # only its files
        return {"ranks": filled(run(_load_on_rank, fn, LOAD_CONFIG, path, SAVE_STEPS, world_size=load_world_size))}


@exercise("07", 'load_resharded', cell='def load_resharded(', hints=HINTS['load_resharded'], tests=TESTS['load_resharded'],
          mistakes={'keyed by position': 'keyed by position', 'optimizer not restored': 'optimizer state not restored',
                    'checkpoint never read': 'the checkpoint was never read into them',
                    'hyper-parameters not restored': "the optimizer's hyper-parameters were not restored",
                    'template keys': 'keys or shapes that differ from the saved ones',
                    'not a torch.save file': "one rank's slices in DCP's layout",
                    'full template': 'whole (full) tensors handed to a sharded model', 'local shards': 'a local shard',
                    'whole checkpoint on every rank': 'every rank read the whole checkpoint'},
          guards=("restore", "cost"), judge=judge_load_resharded,
          references=("course_lib.checkpoint.dcp.load_model_and_optimizer",))
def check_load_resharded(fn, save_world_size: int = 4, load_world_size: int = 2, name: str = "load_resharded") -> bool:
    """``fn(model, optimizer, path)`` loads a ``{"model", "optim"}`` DCP checkpoint saved at another world size
    into an FSDP2 model + AdamW: weights and optimizer state bit-identical, the param groups restored, and the
    run continued after the load gives the losses of the run that never stopped."""
    fn = _guard(fn, "07", "load_resharded")
    return decide(name, lab="07", tests=TESTS["load_resharded"],
                  run=lambda: run_load_resharded(fn, save_world_size, load_world_size), judge=judge_load_resharded,
                  params={"save_world_size": save_world_size, "load_world_size": load_world_size})


# -- exercise 3: an Orbax restore target with shardings (both halves: lab07_orbax) -----------------------
@exercise("07", 'restore_target', cell='def restore_target(', hints=HINTS['restore_target'], tests=TESTS['restore_target'],
          mistakes={'no sharding in the target': 'has no sharding', 'saved sharding': "that is the saved array's own sharding",
                    'mesh ignored': 'not on the mesh you were given', 'saved device count': "the saved mesh's size",
                    'device count ignored': 'take it from the mesh',
                    'whole array': 'the whole array (N× the memory)', 'concrete target': 'a concrete target allocates',
                    'shape or dtype': "keep each array's shape and dtype"},
          guards=("argument", "cost"), judge=judge_restore_target,
          references=("course_lib.checkpoint.orbax.restore_target",))
def check_restore_target(fn, devices, name: str = "restore_target") -> bool:
    """``fn(state, mesh)`` returns Orbax restore targets: ShapeDtypeStructs with the FSDP rule's
    NamedSharding on ``mesh``. Saves a small state on 8 devices, restores onto 4 and 1."""
    fn = _guard(fn, "07", "restore_target")
    return decide(name, lab="07", tests=TESTS["restore_target"], run=lambda: run_restore_target(fn, devices),
                  judge=judge_restore_target)
