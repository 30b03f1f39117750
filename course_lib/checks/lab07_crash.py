"""Lab 07's crash reports: a crash in the learner's code (a class that DCP calls, a function on a rank, a restore
target Orbax reads) captured by the run half as plain data -- the exception (DCP's CheckpointException unwrapped to
the rank's own failure), the learner's line and the library call it made there -- and written out by the judge half
as one ❌ line with the likely cause read from the message. Used by :mod:`~course_lib.checks.lab07`,
:mod:`~course_lib.checks.lab07_judge` and :mod:`~course_lib.checks.lab07_orbax`.
"""
from __future__ import annotations

import re

from course_lib.checks.judge import Guarded
from course_lib.runtime.errors import rank_failures

__all__ = ["answer_of", "attempt", "crash_info", "crash_message", "filled", "learner_files", "raise_stub"]


# -- run half: a crash as plain data (it travels back from a rank) -------------------------------------
#: frames of decorators and dispatch between the learner's call and the function it called
_WRAPPERS = {"wrapper", "inner", "inner_func", "_fn", "decorate_context", "_wrapped_call_impl", "_call_impl",
             "__call__", "<lambda>"}
#: how a module's functions are usually called in the lab (dcp.load, set_state_dict, torch.set_rng_state...)
_SHORT = {"torch.distributed.checkpoint.state_dict_loader": "dcp",
          "torch.distributed.checkpoint.state_dict_saver": "dcp",
          "torch.distributed.checkpoint.state_dict": "", "torch.random": "torch", "torch.serialization": "torch",
          "torch.optim.optimizer": "optimizer", "torch.nn.modules.module": "model",
          "course_lib.strategies.fsdp.jax": "fsdp_jax"}


def learner_files(answer) -> set[str]:
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


def crash_info(exc: BaseException, files: set[str], during: str) -> dict:
    """What the learner's crash was, as plain data (it travels back from a rank): the exception (DCP's
    CheckpointException unwrapped to the rank's own failure), the learner's frame and the call it made there."""
    import traceback
    inner, frames = exc, list(traceback.extract_tb(exc.__traceback__))
    failures = rank_failures(exc)
    if failures:
        try:
            import torch.distributed as dist
            me = dist.get_rank() if dist.is_initialized() else 0
        except Exception:  # noqa: BLE001
            me = 0
        inner, stack = failures.get(me) or next(iter(failures.values()))
        frames = frames + stack
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


def raise_stub(e: BaseException) -> None:
    """Re-raise a stub's NotImplementedError that DCP wrapped in its CheckpointException (the ⏳ path)."""
    for inner, _ in rank_failures(e).values():
        if isinstance(inner, NotImplementedError):
            raise inner


def answer_of(obj) -> tuple:
    """(the learner's function or class, the references blocked while it runs, the exercise) from guard()'s value:
    a class's methods run later, called by DCP, so the run half blocks the references around all of it."""
    return (obj.fn, obj.references, obj.exercise) if isinstance(obj, Guarded) else (obj, (), "")


def attempt(files: set[str], during: str, f, *a, **kw) -> tuple:
    """``(f(*a, **kw), None)``, or ``(None, {"error": ...})`` when the learner's code raised under it."""
    try:
        return f(*a, **kw), None
    except (NotImplementedError, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise_stub(e)
        return None, {"error": crash_info(e, files, during)}


def filled(results) -> list[dict]:
    """The ranks' results, each crash's line of code read here when the rank could not (a notebook cell)."""
    import linecache
    out = list(results)
    for o in out:
        info = o.get("error") if isinstance(o, dict) else None
        if isinstance(info, dict) and not info.get("code") and info.get("file"):
            info["code"] = linecache.getline(info["file"], info["line"]).strip()
    return out


# -- judge half: a crash as the ❌ text ----------------------------------------------------------------
def _likely_cause(info: dict) -> str:
    """The likely mistake behind a crash, read from what the error says (not from which exercise it is): what only
    DCP's context tells (a local shard's shape, the call that was made), then :func:`core.likely_cause`."""
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


def crash_message(info: dict, rank: int | None = None) -> str:
    """``your code raised X on rank r in f, line n (`code`), calling g, during ...`` + the likely cause."""
    from course_lib.checks import core
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("type", "msg", "during")):
        return f"{core.CRASH_PHRASE} an error that could not be reported{f' on rank {rank}' if rank is not None else ''}"
    info = {"wrapped": "", "func": "", "line": 0, "code": "", "call": "", "traceback": "", **info}
    where = f" in {info['func']}, line {info['line']}" if info["func"] else ""
    where += f" (`{str(info['code'])[:100]}`)" if info["code"] else ""
    where += f", calling {info['call']}()" if info["call"] else ""
    wrapped = f" (inside DCP's {info['wrapped']})" if info["wrapped"] else ""
    core.keep_error(str(info["traceback"]))          # checks.last_error() shows it, folded away from the ❌ line
    on = f" on rank {rank}" if rank is not None else ""
    return (f"{core.CRASH_PHRASE} {info['type']}{wrapped}{on}{where}, during {info['during']}: {info['msg']}\n"
            f"   likely cause: {_likely_cause(info)}\n   (full traceback: checks.last_error())")
