"""Lab 07's exercise checks (checkpointing): the app state of an exact resume, loading a sharded checkpoint
at another world size, and an Orbax restore target with shardings.

The torch checks run the learner's code on real gloo ranks and compare, bit for bit, what was saved with
what came back, piece by piece, so that the feedback names the piece that did not travel -- and then
continue the run, since some mistakes (fresh param groups, a stale LR) only show in the steps after a load.

Longer than ~300 lines: three exercise checks, each with its rank-side harness and the diagnoses of its
classic mistakes.
"""
from __future__ import annotations

import tempfile

from course_lib import checks
from course_lib.models import GPTConfig
from course_lib.checks.registry import exercise

__all__ = ["CKPT_CONFIG", "HINTS", "TESTS", "check_app_state", "check_load_resharded", "check_restore_target"]

#: The lab's GPT: the labs' awkward sizes, plus dropout so that the RNG state matters to a resume.
CKPT_CONFIG = GPTConfig(seq_len=31, d_ff=199, dropout=0.1)

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
    "AppState": "on 2 gloo ranks with dropout: 3 steps, dcp.save with your class, then everything rebuilt "
                "(other weights, empty optimizer, step 0, another seed) and dcp.load with your class; the "
                "weights, Adam's state, the LR schedule, the data position and each rank's RNG must come back "
                "bit for bit, and the next 2 losses equal never stopping",
    "load_resharded": "a {'model', 'optim'} checkpoint saved by FSDP2 + AdamW at 4 ranks, loaded with your "
                      "function into a fresh model and optimizer at 2 ranks: every weight and Adam tensor "
                      "bit-identical to what was saved, the param groups (LR after warm-up, betas, eps, weight "
                      "decay) restored, and 2 more steps give the losses of the run that never stopped",
    "restore_target": "a small state saved on 8 devices, restored with your targets onto 4 and onto 1: abstract "
                      "arrays, same shapes and dtypes, NamedShardings on the new mesh with the FSDP rule's "
                      "specs, values bit-identical",
}


# -- exercise 1: the app state ------------------------------------------------------------------------
def _app_state_on_rank(cls, cfg, root, before: int = 3, after: int = 2):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from course_lib.strategies.checkpoint import torch as ck
    r = dist.get_rank()
    torch.manual_seed(1000 + r)                                   # each rank its own dropout stream
    model, opt, sched, data = ck.resumable_run(cfg, seed=0)
    for _ in range(before):
        ck.train_step(model, opt, sched, data)
    dcp.save({"app": cls(model, opt, sched, data)}, checkpoint_id=root)
    saved = {"state": ck.full_state(model, opt), "sched": sched.last_epoch, "data": data.step,
             "rng": torch.get_rng_state()}
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, saved["rng"])
    straight = [ck.train_step(model, opt, sched, data) for _ in range(after)]
    # a fresh process would start from other weights, an empty optimizer, step 0 and another seed
    torch.manual_seed(7)
    model, opt, sched, data = ck.resumable_run(cfg, seed=1)
    dcp.load({"app": cls(model, opt, sched, data)}, checkpoint_id=root)
    got = ck.full_state(model, opt)
    rng = torch.get_rng_state()
    out = {"model": all(torch.equal(got[k], v) for k, v in saved["state"].items() if k.startswith("model.")),
           "optim": all(k in got and torch.equal(got[k], v) for k, v in saved["state"].items()
                        if k.startswith("optim.")),
           "sched": (saved["sched"], sched.last_epoch), "data": (saved["data"], data.step),
           "rng": torch.equal(rng, saved["rng"]),
           "rng_of": [j for j, other in enumerate(rngs) if j != r and torch.equal(rng, other)]}
    out["resumed"] = [ck.train_step(model, opt, sched, data) for _ in range(after)]
    out["straight"] = straight
    return out


@exercise("07", 'AppState', cell='class AppState:', hints=HINTS['AppState'], tests=TESTS['AppState'],
          mistakes={'optimizer not restored': "optimizer state (Adam's m, v, step) not restored", 'schedule not restored': 'the schedule is not restored', 'data restarts': 'the data stream restarts from the beginning', 'RNG not restored': 'RNG state not restored'})
def check_app_state(cls, world_size: int = 2, name: str = "AppState") -> bool:
    """``cls(model, optimizer, scheduler, data)`` is a DCP Stateful after which a resume is bit-exact."""
    from course_lib.launch import run
    with checks.check(name, tests=TESTS["AppState"]) as c, tempfile.TemporaryDirectory() as root:
        out = run(_app_state_on_rank, cls, CKPT_CONFIG, root, world_size=world_size)
        for r, o in enumerate(out):
            if not o["model"]:
                raise AssertionError(f"rank {r}: model weights after load differ from the saved ones → the model "
                                     "is not in state_dict(), or load_state_dict() does not put it back")
            if not o["optim"]:
                raise AssertionError(f"rank {r}: optimizer state (Adam's m, v, step) not restored → after a resume "
                                     "Adam restarts from zero moments: a jump in the loss. A fresh optimizer has "
                                     "no state yet, so optimizer.state_dict() gives DCP nothing to load into; "
                                     "use get_state_dict / set_state_dict")
            if o["sched"][0] != o["sched"][1]:
                raise AssertionError(f"rank {r}: LR schedule at step {o['sched'][1]} after load, saved at "
                                     f"{o['sched'][0]} → the schedule is not restored: warm-up starts again")
            if o["data"][0] != o["data"][1]:
                raise AssertionError(f"rank {r}: data position {o['data'][1]} after load, saved at {o['data'][0]} → "
                                     "the data stream restarts from the beginning: batches seen twice, others never")
            if not o["rng"]:
                if o["rng_of"]:
                    raise AssertionError(f"rank {r} got rank {o['rng_of'][0]}'s RNG state → every rank saved it "
                                         "under the same key and DCP kept one copy; the RNG differs per rank: "
                                         "key it by rank")
                raise AssertionError(f"rank {r}: RNG state not restored → dropout draws other masks after a "
                                     "resume than it would have without the interruption")
        checks.assert_close("losses after resume vs never stopping", [o["resumed"] for o in out],
                            [o["straight"] for o in out], rtol=0, atol=0)
        c.ok(f"model, optimizer, LR schedule, data position and per-rank RNG restored on {world_size} ranks; "
             f"the next {len(out[0]['resumed'])} losses bit-identical")
    return bool(c.passed)


# -- exercise 2: load at another world size -----------------------------------------------------------
HYPER = ("lr", "betas", "eps", "weight_decay")   #: what a param group carries besides its tensors


def _continue(model, opt, data, steps: int) -> list[float]:
    """``steps`` more steps with no scheduler (the LR stays what the param groups hold): global mean losses."""
    import torch
    import torch.distributed as dist
    from course_lib.strategies.checkpoint import torch as ck
    local = torch.tensor([ck.train_step(model, opt, None, data) for _ in range(steps)], dtype=torch.float64)
    dist.all_reduce(local)
    return (local / dist.get_world_size()).tolist()


def _save_on_rank(cfg, path, steps: int = 2, after: int = 2):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from course_lib.strategies.checkpoint import torch as ck
    model, opt, sched, data = ck.resumable_run(cfg, seed=0)
    for _ in range(steps):
        ck.train_step(model, opt, sched, data)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    state = ck.full_state(model, opt)
    hyper = [{k: g[k] for k in HYPER} for g in opt.param_groups]
    return {"state": state, "hyper": hyper, "straight": _continue(model, opt, data, after), "step": data.step - after}


def _load_on_rank(fn, cfg, path, step: int, after: int = 2):
    import torch
    from course_lib.strategies.checkpoint import torch as ck
    model, opt, _, data = ck.resumable_run(cfg, seed=1)
    init = ck.full_state(model)
    try:
        fn(model, opt, path)
    except NotImplementedError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"}
    got = ck.full_state(model, opt)
    hyper = [{k: g[k] for k in HYPER} for g in opt.param_groups]
    data.step = step                      # the data position is not this exercise's: set it as saved
    return {"state": got, "init": all(torch.equal(init[k], got[k]) for k in init), "hyper": hyper,
            "resumed": _continue(model, opt, data, after)}


@exercise("07", 'load_resharded', cell='def load_resharded(', hints=HINTS['load_resharded'], tests=TESTS['load_resharded'],
          mistakes={'optimizer not restored': 'optimizer state not restored', 'checkpoint never read': 'the checkpoint was never read into them',
                    'hyper-parameters not restored': "the optimizer's hyper-parameters were not restored"})
def check_load_resharded(fn, save_world_size: int = 4, load_world_size: int = 2, name: str = "load_resharded") -> bool:
    """``fn(model, optimizer, path)`` loads a ``{"model", "optim"}`` DCP checkpoint saved at another world size
    into an FSDP2 model + AdamW: weights and optimizer state bit-identical."""
    import torch
    from course_lib.launch import run
    cfg = GPTConfig(seq_len=31, d_ff=199)
    with checks.check(name, tests=TESTS["load_resharded"]) as c, tempfile.TemporaryDirectory() as path:
        ran = run(_save_on_rank, cfg, path, world_size=save_world_size)[0]
        saved = ran["state"]
        out = run(_load_on_rank, fn, cfg, path, ran["step"], world_size=load_world_size)
        for r, o in enumerate(out):
            if "error" in o:
                err = o["error"]
                if any(w in err for w in ("Missing key", "Size mismatch", "KeyError")):
                    why = ("the template's keys or shapes differ from the saved ones: build it with get_state_dict "
                           "under the saved top-level keys ('model', 'optim')")
                elif any(w in err.lower() for w in ("distcp", "zip", "pickle", "dict-like")):
                    why = ("a .distcp file is one rank's slices in DCP's layout, not a torch.save of the model: "
                           "read the directory with dcp.load")
                else:
                    why = "see the error; the template must come from get_state_dict on this mesh"
                raise AssertionError(f"rank {r} raised {err}\n   likely mistake: {why}")
            got = o["state"]
            if o["init"]:
                raise AssertionError(f"rank {r}: the weights are still the fresh model's → the checkpoint was never "
                                     "read into them (dcp.load fills the template in place, before set_state_dict)")
            wrong = [k for k, v in saved.items() if k.startswith("model.") and not torch.equal(got[k], v)]
            if wrong:
                raise AssertionError(f"rank {r}: {len(wrong)} weight(s) differ from the saved ones, e.g. {wrong[0]}")
            optim = [k for k, v in saved.items() if k.startswith("optim.")]
            bad = [k for k in optim if k not in got or not torch.equal(got[k], saved[k])]
            if bad:
                example = next((k for k in bad if k.endswith("exp_avg")), bad[0])
                raise AssertionError(f"rank {r}: optimizer state not restored ({len(bad)} of {len(optim)} tensors, "
                                     f"e.g. {example}) → load it too: a resumed Adam with fresh moments is not "
                                     "the optimizer that was saved")
            for i, (g, want) in enumerate(zip(o["hyper"], ran["hyper"])):
                diff = {k: (g[k], want[k]) for k in HYPER if g[k] != want[k]}
                if diff:
                    raise AssertionError(
                        f"rank {r}: param group {i} after the load has " + ", ".join(
                            f"{k}={a} where the saved optimizer had {b}" for k, (a, b) in diff.items())
                        + " → the optimizer's hyper-parameters were not restored: the param groups stay the fresh "
                        "optimizer's (set_state_dict puts back the saved param groups with the state; the warm-up "
                        "had already raised the LR)")
        checks.assert_close(f"the {len(ran['straight'])} losses after the load vs never stopping",
                            [o["resumed"] for o in out], [ran["straight"]] * len(out), **checks.TOLERANCES["fp32"])
        c.ok(f"saved at {save_world_size} ranks, loaded at {load_world_size}: {len(saved)} tensors (weights, Adam "
             f"m, v, step) bit-identical, the param groups restored, and the next {len(ran['straight'])} losses "
             "equal never stopping")
    return bool(c.passed)


# -- exercise 3: an Orbax restore target with shardings ----------------------------------------------
def _norm(spec) -> tuple:
    t = tuple(spec)
    return t[:max([i + 1 for i, a in enumerate(t) if a is not None], default=0)]


@exercise("07", 'restore_target', cell='def restore_target(', hints=HINTS['restore_target'], tests=TESTS['restore_target'],
          mistakes={'no sharding in the target': 'has no sharding', 'saved sharding': "that is the saved array's own sharding", 'whole array': 'the whole array (N× the memory)'})
def check_restore_target(fn, devices, name: str = "restore_target") -> bool:
    """``fn(state, mesh)`` returns Orbax restore targets: ShapeDtypeStructs with the FSDP rule's
    NamedSharding on ``mesh``. Saves a small state on 8 devices, restores onto 4 and 1."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from course_lib.strategies.checkpoint import jax as cj
    from course_lib.strategies.fsdp.jax import fsdp_spec

    def mesh_of(n):
        return jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,), devices=list(devices)[:n])
    rng = np.random.default_rng(7)
    host = {"w": rng.standard_normal((64, 48)).astype(np.float32),    # sharded: 64 rows over 8, 4, 1
            "emb": rng.standard_normal((67, 40)).astype(np.float32),  # replicated: 67 rows do not divide
            "b": rng.standard_normal((48,)).astype(np.float32), "count": np.int32(5)}
    big = mesh_of(8)
    state = {k: jax.device_put(v, NamedSharding(big, fsdp_spec(v.shape, 8))) for k, v in host.items()}
    with checks.check(name, tests=TESTS["restore_target"]) as c, tempfile.TemporaryDirectory() as d:
        mngr = cj.manager(d)
        cj.save(mngr, 1, state)
        mngr.wait_until_finished()
        try:
            _restore_onto(fn, mngr, state, host, mesh_of)
        finally:
            mngr.close()
        c.ok("restored from 8 devices onto 4 and 1, every array where the FSDP rule puts it, bit-identical")
    return bool(c.passed)


def _restore_onto(fn, mngr, state, host, mesh_of):
    import jax
    from course_lib.strategies.checkpoint import jax as cj
    from course_lib.strategies.fsdp.jax import fsdp_spec
    for n in (4, 1):
        mesh = mesh_of(n)
        target = fn(state, mesh)
        if not isinstance(target, dict) or set(target) != set(state):
            raise AssertionError(f"returned {type(target).__name__} with keys "
                                 f"{sorted(target) if isinstance(target, dict) else '?'}; return the same "
                                 f"pytree as the state: {sorted(state)}")
        for k, x in host.items():
            t = target[k]
            if isinstance(t, jax.Array):
                raise AssertionError(f"target[{k!r}] is a jax.Array → a concrete target allocates the whole "
                                     "state once more before reading it; give abstract arrays "
                                     "(jax.ShapeDtypeStruct)")
            if not isinstance(t, jax.ShapeDtypeStruct):
                raise AssertionError(f"target[{k!r}] is a {type(t).__name__}; give a jax.ShapeDtypeStruct")
            if tuple(t.shape) != x.shape or t.dtype != x.dtype:
                raise AssertionError(f"target[{k!r}] is {t.dtype}{list(t.shape)}, saved {x.dtype}{list(x.shape)} "
                                     "→ Orbax would cast or fail; keep each array's shape and dtype")
            if t.sharding is None:
                raise AssertionError(f"target[{k!r}] has no sharding → Orbax puts it back on the mesh it was "
                                     "saved from (8 devices), not on yours. nnx.eval_shape drops shardings "
                                     "(flax#5110): add sharding=NamedSharding(mesh, spec)")
            if getattr(t.sharding, "mesh", None) is not None and t.sharding.mesh.size != n:
                raise AssertionError(f"target[{k!r}] is sharded over {t.sharding.mesh.size} devices, the target "
                                     f"mesh has {n} → that is the saved array's own sharding; build a "
                                     "NamedSharding on the new mesh")
            want = _norm(fsdp_spec(x.shape, n))
            if _norm(t.sharding.spec) != want:
                kind = "replicated" if not _norm(t.sharding.spec) else f"{t.sharding.spec}"
                raise AssertionError(f"target[{k!r}] {x.shape} is {kind} on {n} devices, the FSDP rule gives "
                                     f"P{want} → each device would hold "
                                     + ("the whole array (N× the memory)" if not _norm(t.sharding.spec)
                                        else "another cut") + "; use fsdp_spec(shape, mesh.size)")
        restored, _ = cj.restore(mngr, 1, target)
        bad = cj.same_arrays(restored, host)
        if bad:
            raise AssertionError(f"restored onto {n} devices, {bad} differ from the saved values")
