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
    "AppState": "on 2 gloo ranks with dropout: your class built after step 1, 2 more steps, dcp.save, then "
                "everything rebuilt (other weights, empty optimizer, step 0, another seed) and dcp.load with your "
                "class; the weights, Adam's state and param groups, the LR schedule, the data position and each "
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


# -- a crash in the learner's code: which call raised, on which rank, and the likely cause ----------------
#: frames of decorators and dispatch between the learner's call and the function it called
_WRAPPERS = {"wrapper", "inner", "inner_func", "_fn", "decorate_context", "_wrapped_call_impl", "_call_impl",
             "__call__", "<lambda>"}
#: how a module's functions are usually called in the lab (dcp.load, set_state_dict, torch.set_rng_state...)
_SHORT = {"torch.distributed.checkpoint.state_dict_loader": "dcp",
          "torch.distributed.checkpoint.state_dict_saver": "dcp",
          "torch.distributed.checkpoint.state_dict": "", "torch.random": "torch", "torch.serialization": "torch",
          "torch.optim.optimizer": "optimizer", "torch.nn.modules.module": "model",
          "course_lib.strategies.fsdp.jax": "fsdp_jax"}


def _learner_files(answer) -> set[str]:
    """The source files of the learner's function or class (a notebook cell's, as compiled)."""
    objs = [answer] if not isinstance(answer, type) else [
        v for c in answer.__mro__ if c is not object for v in vars(c).values()]
    return {o.__code__.co_filename for o in objs if hasattr(o, "__code__")}


def _call_name(frame) -> str:
    """``dcp.load``, ``set_state_dict``, ``torch.set_rng_state``...: the library function a frame is in."""
    path = frame.filename.replace("\\", "/")
    mod = path.split("site-packages/")[-1] if "site-packages/" in path else path.split("/course_lib/")[-1]
    mod = mod.removesuffix(".py").replace("/", ".")
    if "course_lib" in path and not mod.startswith("course_lib"):
        mod = "course_lib." + mod
    short = _SHORT.get(mod, mod.rsplit(".", 1)[-1])
    return f"{short}.{frame.name}" if short else frame.name


def _crash_info(exc: BaseException, files: set[str], during: str) -> dict:
    """What the learner's crash was, as plain data (it travels back from a rank): the exception (DCP's
    CheckpointException unwrapped to the rank's own failure), the learner's frame and the call it made there."""
    import traceback
    inner, frames = exc, list(traceback.extract_tb(exc.__traceback__))
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        try:
            import torch.distributed as dist
            me = dist.get_rank() if dist.is_initialized() else 0
        except Exception:  # noqa: BLE001
            me = 0
        pair = failures.get(me) or next(iter(failures.values()))
        if isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], BaseException):
            inner, frames = pair[0], frames + list(pair[1] or [])
    mine = [i for i, f in enumerate(frames) if f.filename in files]
    at = frames[mine[-1]] if mine else None
    below = [f for f in frames[mine[-1] + 1:] if f.name not in _WRAPPERS] if mine else []
    lines = []
    for s in str(inner).strip().splitlines():          # the message, never a traceback that it quotes
        if s.lstrip().startswith("Traceback"):
            break
        lines += [s.strip()] if s.strip() else []
    return {"type": type(inner).__name__, "wrapped": type(exc).__name__ if inner is not exc else "",
            "msg": " ".join(lines[:2])[:300], "func": at.name if at else "", "line": at.lineno if at else 0,
            "file": at.filename if at else "", "code": (at.line or "").strip() if at else "",
            "call": _call_name(below[0]) if below else "", "during": during,
            "traceback": "".join(traceback.format_exception(exc)) + (
                "".join(traceback.format_exception(inner)) if inner is not exc else "")}


def _likely_cause(info: dict) -> str:
    """The likely mistake behind a crash, read from what the error says (not from which exercise it is): what only
    DCP's context tells (a local shard's shape, the call that was made), then :func:`core.likely_cause`."""
    import re
    t, m, call = info["type"], info["msg"], info["call"]
    sizes = re.search(r"saved torch\.Size\(\[([\d, ]*)\]\) and current: torch\.Size\(\[([\d, ]*)\]\)", m)
    if sizes:
        saved, now = ([int(x) for x in g.split(",") if x.strip()] for g in sizes.groups())
        if len(saved) == len(now) and any(a < b for a, b in zip(now, saved)) and all(
                a <= b for a, b in zip(now, saved)):
            return (f"a template tensor of shape {now} where the checkpoint holds {saved}: a local shard (one rank's "
                    "rows, a plain tensor) that has lost its global shape; DCP reads each rank's slice into a "
                    "sharded tensor that knows the whole shape: keep the state dict's tensors as they come")
    if "setStorage" in m or "out of bounds for storage" in m:      # here: DCP reading into a template
        return ("a template tensor is smaller than the slice DCP reads into it: a local shard or a plain tensor "
                "where the checkpoint holds a sharded one; build the template from this mesh's model")
    from course_lib.checks.core import likely_cause
    by_message = likely_cause("", m)           # what the message says, whatever the exception's type
    if by_message:
        return by_message
    if t == "TypeError" and call:
        return f"{call}() was given an argument of a type it cannot use: check each argument against what it expects"
    return likely_cause(t, m) or "see the message; the full traceback says where"


def _crash_message(info: dict, rank: int | None = None) -> str:
    """``your code raised X on rank r in f, line n (`code`), calling g, during ...`` + the likely cause."""
    import linecache
    from course_lib.checks import core
    code = info["code"] or (linecache.getline(info["file"], info["line"]).strip() if info["file"] else "")
    where = f" in {info['func']}, line {info['line']}" if info["func"] else ""
    where += f" (`{code[:100]}`)" if code else ""
    where += f", calling {info['call']}()" if info["call"] else ""
    wrapped = f" (inside DCP's {info['wrapped']})" if info["wrapped"] else ""
    core.keep_error(info["traceback"])               # checks.last_error() shows it, folded away from the ❌ line
    on = f" on rank {rank}" if rank is not None else ""
    return (f"{core.CRASH_PHRASE} {info['type']}{wrapped}{on}{where}, during {info['during']}: {info['msg']}\n"
            f"   likely cause: {_likely_cause(info)}\n   (full traceback: checks.last_error())")


def _raise_stub(e: BaseException) -> None:
    """Re-raise a stub's NotImplementedError that DCP wrapped in its CheckpointException (the ⏳ path)."""
    for pair in (getattr(e, "failures", None) or {}).values():
        if isinstance(pair, tuple) and pair and isinstance(pair[0], NotImplementedError):
            raise pair[0]


HYPER = ("lr", "betas", "eps", "weight_decay")   #: what a param group carries besides its tensors


# -- exercise 1: the app state ------------------------------------------------------------------------
def _hyper(opt) -> list[dict]:
    """A param group's hyper-parameters (what the next step reads besides the tensors)."""
    return [{k: tuple(g[k]) if isinstance(g[k], list) else g[k] for k in HYPER} for g in opt.param_groups]


def _positional(sd) -> bool:
    """True if a (nested) state dict holds an optimizer state dict keyed by position (optimizer.state_dict())."""
    if not isinstance(sd, dict):
        return False
    groups = sd.get("param_groups")
    if isinstance(groups, list) and any(isinstance(p, int) for g in groups if isinstance(g, dict)
                                        for p in g.get("params", ())):
        return True
    return any(_positional(v) for v in sd.values())


def _app_state_on_rank(cls, cfg, root, before: int = 3, after: int = 2):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from course_lib.strategies.checkpoint import torch as ck
    r = dist.get_rank()
    files = _learner_files(cls)

    def attempt(during, f, *a, **kw):
        try:
            return f(*a, **kw), None
        except (NotImplementedError, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            _raise_stub(e)
            return None, {"error": _crash_info(e, files, during)}

    torch.manual_seed(1000 + r)                                   # each rank its own dropout stream
    model, opt, sched, data = ck.resumable_run(cfg, seed=0)
    ck.train_step(model, opt, sched, data)
    # built once, as a training loop builds it; saved 2 steps later: its state_dict() must read the live state
    app, err = attempt(f"{cls.__name__}(model, optimizer, scheduler, data)", cls, model, opt, sched, data)
    if err:
        return err
    built = {"state": ck.full_state(model, opt), "sched": sched.last_epoch, "data": data.step,
             "rng": torch.get_rng_state(), "hyper": _hyper(opt)}
    for _ in range(before - 1):
        ck.train_step(model, opt, sched, data)
    _, err = attempt("dcp.save, which calls your state_dict()", dcp.save, {"app": app}, checkpoint_id=root)
    if err:
        return err
    positional = _positional(attempt("state_dict()", app.state_dict)[0])
    saved = {"state": ck.full_state(model, opt), "sched": sched.last_epoch, "data": data.step,
             "rng": torch.get_rng_state(), "hyper": _hyper(opt)}
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, saved["rng"])
    straight = [ck.train_step(model, opt, sched, data) for _ in range(after)]
    # a fresh process would start from other weights, an empty optimizer, step 0 and another seed
    torch.manual_seed(7)
    model, opt, sched, data = ck.resumable_run(cfg, seed=1)
    app, err = attempt(f"{cls.__name__}(model, optimizer, scheduler, data)", cls, model, opt, sched, data)
    if err:
        return err
    _, err = attempt("dcp.load, which calls your state_dict() for a template, then your load_state_dict()",
                     dcp.load, {"app": app}, checkpoint_id=root)
    if err:
        return err
    got = ck.full_state(model, opt)
    rng = torch.get_rng_state()
    model_keys = [k for k in saved["state"] if k.startswith("model.")]
    optim_keys = [k for k in saved["state"] if k.startswith("optim.")]
    out = {"model": all(torch.equal(got[k], saved["state"][k]) for k in model_keys),
           "optim": all(k in got and torch.equal(got[k], saved["state"][k]) for k in optim_keys),
           "hyper": (saved["hyper"], _hyper(opt)),
           "sched": (saved["sched"], sched.last_epoch), "data": (saved["data"], data.step),
           "rng": torch.equal(rng, saved["rng"]), "positional": positional,
           "rng_of": [j for j, other in enumerate(rngs) if j != r and torch.equal(rng, other)],
           # which pieces came back as they were when the AppState was built, not as they were at dcp.save
           "stale": [piece for piece, now, then in (
               ("weights", all(torch.equal(got[k], built["state"][k]) for k in model_keys), None),
               ("LR schedule", sched.last_epoch, built["sched"]), ("data position", data.step, built["data"]),
               ("RNG", torch.equal(rng, built["rng"]), None), ("param groups", _hyper(opt), built["hyper"]))
               if (now is True if then is None else now == then)]}
    out["resumed"] = [ck.train_step(model, opt, sched, data) for _ in range(after)]
    out["straight"] = straight
    return out


def _app_state_verdict(r: int, o: dict) -> str | None:
    """The ❌ text for rank ``r``'s outcome, the cause derived from which pieces differ and how; None if all match."""
    wrong = {"weights": not o["model"], "Adam's state": not o["optim"], "param groups": o["hyper"][0] != o["hyper"][1],
             "LR schedule": o["sched"][0] != o["sched"][1], "data position": o["data"][0] != o["data"][1],
             "RNG": not o["rng"]}
    stale = [p for p in o["stale"] if wrong.get(p)]
    if stale:
        said = " and ".join([", ".join(stale[:-1]), stale[-1]] if len(stale) > 1 else stale)
        return (f"rank {r}: the {said} came back as they were when your AppState was built (1 step in), "
                f"not as they were at dcp.save (step {o['sched'][0]}) → state captured once and stale later: "
                "state_dict() must read the live objects every time DCP calls it (a state dict taken in "
                "__init__ is a snapshot)")
    if wrong["weights"]:
        return (f"rank {r}: model weights after load differ from the saved ones → the model is not in state_dict(), "
                "or load_state_dict() does not put it back")
    if wrong["Adam's state"] and o["positional"]:
        return (f"rank {r}: optimizer state (Adam's m, v, step) not restored → your state_dict() holds the optimizer's "
                "state keyed by position (0, 1, 2…, optimizer.state_dict()): a fresh optimizer has no entries yet, "
                "so DCP has nothing to load into, and positions mean nothing at another world size. Key it by "
                "parameter name (DCP's get_state_dict / set_state_dict)")
    if wrong["Adam's state"]:
        return (f"rank {r}: optimizer state (Adam's m, v, step) not restored → after a resume Adam restarts from zero "
                "moments: a jump in the loss. Put the optimizer in state_dict() and hand it back in "
                "load_state_dict() (get_state_dict / set_state_dict)")
    if wrong["param groups"]:
        (want, got), = [(w, g) for w, g in zip(*o["hyper"]) if w != g][:1]
        diff = ", ".join(f"{k}={got[k]} where the saved optimizer had {want[k]}" for k in HYPER if got[k] != want[k])
        return (f"rank {r}: after the load the optimizer has {diff} → the optimizer's hyper-parameters were not "
                "restored: Adam's tensors came back, but the param groups stay the fresh optimizer's (DCP fills "
                "tensors in place; the param groups travel only when load_state_dict() hands the loaded optimizer "
                "state back to the optimizer)")
    if wrong["LR schedule"]:
        return (f"rank {r}: LR schedule at step {o['sched'][1]} after load, saved at {o['sched'][0]} → the schedule "
                "is not restored: warm-up starts again")
    if wrong["data position"] and o["data"][1] != 0:
        (saved, got) = o["data"]
        return (f"rank {r}: data position {got} after load, saved at {saved} → the data position is off by "
                f"{got - saved:+d}: the saved position already names the next batch to read (batches "
                f"{'skipped' if got > saved else 'seen twice'}); put back exactly what was saved")
    if wrong["data position"]:
        return (f"rank {r}: data position {o['data'][1]} after load, saved at {o['data'][0]} → the data stream "
                "restarts from the beginning: batches seen twice, others never")
    if wrong["RNG"] and o["rng_of"]:
        return (f"rank {r} got rank {o['rng_of'][0]}'s RNG state → every rank saved it under the same key and DCP "
                "kept one copy; the RNG differs per rank: key it by rank")
    if wrong["RNG"]:
        return (f"rank {r}: RNG state not restored → dropout draws other masks after a resume than it would have "
                "without the interruption")
    return None


@exercise("07", 'AppState', cell='class AppState:', hints=HINTS['AppState'], tests=TESTS['AppState'],
          mistakes={'captured once': 'state captured once and stale later', 'keyed by position': 'keyed by position',
                    'optimizer not restored': "optimizer state (Adam's m, v, step) not restored",
                    'hyper-parameters not restored': "the optimizer's hyper-parameters were not restored",
                    'schedule not restored': 'the schedule is not restored',
                    'data restarts': 'the data stream restarts from the beginning',
                    'data off by': 'the data position is off by', 'one RNG key': 'saved it under the same key',
                    'RNG not restored': 'RNG state not restored',
                    'template keys': 'keys or shapes that differ from the saved ones'},
          guards=("restore",))
def check_app_state(cls, world_size: int = 2, name: str = "AppState") -> bool:
    """``cls(model, optimizer, scheduler, data)`` is a DCP Stateful after which a resume is bit-exact: built once,
    saved 2 steps later, loaded into fresh objects, then the run continues and is compared with never stopping."""
    from course_lib.launch import run
    with checks.check(name, tests=TESTS["AppState"]) as c, tempfile.TemporaryDirectory() as root:
        out = run(_app_state_on_rank, cls, CKPT_CONFIG, root, world_size=world_size)
        for r, o in enumerate(out):
            if "error" in o:
                raise AssertionError(_crash_message(o["error"], r))
        for r, o in enumerate(out):
            verdict = _app_state_verdict(r, o)
            if verdict:
                raise AssertionError(verdict)
        checks.assert_close("losses after resume vs never stopping", [o["resumed"] for o in out],
                            [o["straight"] for o in out], rtol=0, atol=0)
        c.ok(f"model, optimizer, LR schedule, data position and per-rank RNG restored on {world_size} ranks; "
             f"the next {len(out[0]['resumed'])} losses bit-identical")
    return bool(c.passed)


# -- exercise 2: load at another world size -----------------------------------------------------------
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
    return {"state": state, "hyper": _hyper(opt), "straight": _continue(model, opt, data, after),
            "step": data.step - after}


def _load_on_rank(fn, cfg, path, step: int, after: int = 2):
    import torch
    import torch.distributed as dist
    from course_lib.strategies.checkpoint import torch as ck
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    model, opt, _, data = ck.resumable_run(cfg, seed=1)
    init = ck.full_state(model)
    read, total, real = {}, [0], FileSystemReader.read_data

    def counted(self, plan, planner):     # the bytes of the checkpoint this rank reads: the load's cost
        total[0] = sum(info.length for info in self.storage_data.values())
        read.update({repr(item.storage_index): self.storage_data[item.storage_index].length for item in plan.items})
        return real(self, plan, planner)
    FileSystemReader.read_data = counted
    try:
        fn(model, opt, path)
    except NotImplementedError:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        _raise_stub(e)
        return {"error": _crash_info(e, _learner_files(fn), f"{fn.__name__}(model, optimizer, path) at "
                                                           f"{dist.get_world_size()} ranks")}
    finally:
        FileSystemReader.read_data = real
    got = ck.full_state(model, opt)
    data.step = step                      # the data position is not this exercise's: set it as saved
    return {"state": got, "init": all(torch.equal(init[k], got[k]) for k in init), "hyper": _hyper(opt),
            "read": sum(read.values()), "total": total[0], "resumed": _continue(model, opt, data, after)}


_SAVES: dict = {}    #: save world size -> (its directory, what it saved): the reference run, once per process


def _reference_save(cfg, world_size: int, path: str) -> dict:
    """The reference checkpoint (deterministic: seed 0, 2 steps) copied into ``path``; saved at ``world_size``
    ranks the first time only (a later check reuses it: the answer reads a fresh copy, so it cannot spoil it)."""
    import shutil
    from course_lib.launch import run
    if world_size not in _SAVES:
        keep = tempfile.TemporaryDirectory(prefix="lab07-reference-")   # removed when the process exits
        ran = run(_save_on_rank, cfg, keep.name, world_size=world_size)[0]
        _SAVES[world_size] = (keep, ran)
    keep, ran = _SAVES[world_size]
    shutil.copytree(keep.name, path, dirs_exist_ok=True)
    return ran


@exercise("07", 'load_resharded', cell='def load_resharded(', hints=HINTS['load_resharded'], tests=TESTS['load_resharded'],
          mistakes={'keyed by position': 'keyed by position', 'optimizer not restored': 'optimizer state not restored',
                    'checkpoint never read': 'the checkpoint was never read into them',
                    'hyper-parameters not restored': "the optimizer's hyper-parameters were not restored",
                    'template keys': 'keys or shapes that differ from the saved ones',
                    'not a torch.save file': "one rank's slices in DCP's layout",
                    'full template': 'whole (full) tensors handed to a sharded model', 'local shards': 'a local shard',
                    'whole checkpoint on every rank': 'every rank read the whole checkpoint'},
          guards=("restore", "cost"))
def check_load_resharded(fn, save_world_size: int = 4, load_world_size: int = 2, name: str = "load_resharded") -> bool:
    """``fn(model, optimizer, path)`` loads a ``{"model", "optim"}`` DCP checkpoint saved at another world size
    into an FSDP2 model + AdamW: weights and optimizer state bit-identical, the param groups restored, and the
    run continued after the load gives the losses of the run that never stopped."""
    import torch
    from course_lib.launch import run
    cfg = GPTConfig(seq_len=31, d_ff=199)
    with checks.check(name, tests=TESTS["load_resharded"]) as c, tempfile.TemporaryDirectory() as path:
        ran = _reference_save(cfg, save_world_size, path)
        saved = ran["state"]
        out = run(_load_on_rank, fn, cfg, path, ran["step"], world_size=load_world_size)
        for r, o in enumerate(out):
            if "error" in o:
                raise AssertionError(_crash_message(o["error"], r))
        for r, o in enumerate(out):
            got = o["state"]
            if o["init"]:
                raise AssertionError(f"rank {r}: the weights are still the fresh model's → the checkpoint was never "
                                     "read into them (dcp.load fills the template in place, before set_state_dict)")
            wrong = [k for k, v in saved.items() if k.startswith("model.") and not torch.equal(got[k], v)]
            if wrong:
                raise AssertionError(f"rank {r}: {len(wrong)} weight(s) differ from the saved ones, e.g. {wrong[0]}")
            optim = [k for k, v in saved.items() if k.startswith("optim.")]
            bad = [k for k in optim if k not in got or not torch.equal(got[k], saved[k])]
            groups_back = o["hyper"] == ran["hyper"]
            if bad:
                example = next((k for k in bad if k.endswith("exp_avg")), bad[0])
                why = ("the param groups came back but none of Adam's tensors: the optimizer was loaded from a state "
                       "dict keyed by position (0, 1, 2…, what optimizer.state_dict() gives: empty in a fresh "
                       "optimizer), while the checkpoint keys Adam's state by parameter name"
                       if groups_back and len(bad) == len(optim) else
                       "load it too: a resumed Adam with fresh moments is not the optimizer that was saved")
                raise AssertionError(f"rank {r}: optimizer state not restored ({len(bad)} of {len(optim)} tensors, "
                                     f"e.g. {example}) → {why}")
            for i, (g, want) in enumerate(zip(o["hyper"], ran["hyper"])):
                diff = {k: (g[k], want[k]) for k in HYPER if g[k] != want[k]}
                if diff:
                    raise AssertionError(
                        f"rank {r}: param group {i} after the load has " + ", ".join(
                            f"{k}={a} where the saved optimizer had {b}" for k, (a, b) in diff.items())
                        + " → the optimizer's hyper-parameters were not restored: the param groups stay the fresh "
                        "optimizer's (Adam's tensors can be filled in place, but the param groups come back only "
                        "when the loaded optimizer state is handed back to the optimizer; the warm-up had "
                        "already raised the LR)")
        # the cost: a template laid out for this mesh reads the saved chunks that hold this rank's slices (about
        # its share, more where the saved chunks straddle two ranks); whole tensors make every rank read it all
        if load_world_size > 1 and all(o["read"] >= 0.95 * o["total"] for o in out):
            o = out[0]
            raise AssertionError(
                f"each rank read {o['read']:,} bytes of the checkpoint's {o['total']:,}, where its share at "
                f"{load_world_size} ranks is about {o['total'] // load_world_size:,} → every rank read the whole "
                f"checkpoint: whole tensors as the template (a full state dict) cost {load_world_size}× the "
                "reading and the memory, and a gather; a template laid out for this mesh reads only this "
                "rank's slices")
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
          mistakes={'no sharding in the target': 'has no sharding', 'saved sharding': "that is the saved array's own sharding",
                    'mesh ignored': 'not on the mesh you were given', 'saved device count': "the saved mesh's size",
                    'device count ignored': 'take it from the mesh',
                    'whole array': 'the whole array (N× the memory)', 'concrete target': 'a concrete target allocates',
                    'shape or dtype': "keep each array's shape and dtype"},
          guards=("argument", "cost"))
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
    host = {"w": rng.standard_normal((64, 48)).astype(np.float32),    # dim 0 cut over 8, 4, 1
            "emb": rng.standard_normal((67, 40)).astype(np.float32),  # 67 rows do not divide: dim 1 cut
            "m": rng.standard_normal((36, 40)).astype(np.float32),    # 36 rows: dim 1 over 8, dim 0 over 4
            "b": rng.standard_normal((48,)).astype(np.float32), "count": np.int32(5)}   # small: replicated
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
    from jax.sharding import NamedSharding
    from course_lib.strategies.checkpoint import jax as cj
    from course_lib.strategies.fsdp.jax import fsdp_spec
    saved_n = len(jax.tree.leaves(state)[0].sharding.device_set)
    passed: list[int] = []                       # the mesh sizes the answer was right for
    for n in (4, 1):
        mesh = mesh_of(n)
        devs = f"{n} device{'s' if n > 1 else ''}"
        try:
            target = fn(state, mesh)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - a crash in the learner's function: named, not a raw traceback
            raise AssertionError(_crash_message(_crash_info(e, _learner_files(fn),
                                                            f"restore_target(state, mesh) for a mesh of {devs}"))) from None
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
                                     f"saved from ({saved_n} devices), not on yours. nnx.eval_shape drops shardings "
                                     "(flax#5110): add sharding=NamedSharding(mesh, spec)")
            if t.sharding is state[k].sharding:
                raise AssertionError(f"target[{k!r}] is sharded over {saved_n} devices, the target mesh has {devs} "
                                     "→ that is the saved array's own sharding; build a NamedSharding on the new mesh")
            if not isinstance(t.sharding, NamedSharding) or t.sharding.mesh != mesh:
                kind = type(t.sharding).__name__
                on = len(t.sharding.device_set)
                raise AssertionError(f"target[{k!r}] has a {kind} over {on} device{'s' if on > 1 else ''}, not on "
                                     f"the mesh you were given ({devs}) → the restore would land wherever that "
                                     "sharding says; build a NamedSharding on the `mesh` argument")
            want = _norm(fsdp_spec(x.shape, n))
            got = _norm(t.sharding.spec)
            if got != want:
                per = x.nbytes // (n if want else 1)
                # a fixed device count: one the answer was right for on an earlier mesh first, then the saved one
                other = next((m for m in (*passed, saved_n, 2, 4, 8) if m != n and got == _norm(fsdp_spec(x.shape, m))),
                             None)
                if other:
                    why = (f"that is the FSDP rule for {other} devices"
                           + (", the saved mesh's size" if other == saved_n and other not in passed else "")
                           + f", not for the {devs} of the mesh you were given"
                           + (f" (right on the {other}-device mesh: a device count fixed in your code?)"
                              if other in passed else "")
                           + "; the rule's cut depends on the number of devices: take it from the mesh")
                elif not got:
                    why = (f"each device would hold the whole array (N× the memory): {x.nbytes:,} bytes instead of "
                           f"{per:,}")
                else:
                    why = "each device would hold another cut"
                raise AssertionError(f"target[{k!r}] {x.shape} is {'replicated' if not got else f'P{got}'} on "
                                     f"{devs}, the FSDP rule gives P{want} → {why}"
                                     + ("" if other else "; cut by the FSDP rule for the mesh you are given"))
        try:
            restored, _ = cj.restore(mngr, 1, target)
        except Exception as e:  # noqa: BLE001 - Orbax raising deep inside: named, with the likely cause
            raise AssertionError(_crash_message(_crash_info(e, _learner_files(fn),
                                                            f"Orbax's restore into your target on {devs}"))) from None
        bad = cj.same_arrays(restored, host)
        if bad:
            raise AssertionError(f"restored onto {devs}, {bad} differ from the saved values")
        passed.append(n)
