"""What :func:`course_lib.run` checks before any rank starts, and ``run`` under ``torchrun``.

The checks: a world size this machine can run (:func:`check_world_size`), a script the ranks can re-import
(:func:`check_main_file`), a call that pickles -- by value, with ``cloudpickle``: functions defined in a notebook live
in ``__main__`` and cannot be pickled by reference -- else the piece that cannot travel named (:func:`pickle_call`).
Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) ``run`` calls ``fn`` on this rank and all-gathers the
results (:func:`run_under_torchrun`), so notebook code also runs as a multi-node script.
"""
from __future__ import annotations

import os
import sys
import time

import cloudpickle

from course_lib.launch.rank import to_cpu
from course_lib.launch.results import RunResult


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def check_main_file() -> None:
    """A script's ranks re-import it by its path (multiprocessing's rule): a program read from stdin has none."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.exists(main_file) and not under_torchrun():
        raise RuntimeError(f"run() cannot start ranks from a program read from {main_file!r}: every rank re-imports "
                           "the main script from its file. Save the code to a file (the run() call under "
                           "`if __name__ == \"__main__\":`) and run `python file.py`, or run it in a notebook")


def check_world_size(world_size, name: str = "world_size") -> None:
    """A world size this machine can run, or a ValueError naming the limit (``name``: how the caller spells it)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{name}={world_size!r} must be a positive int (2-8 ranks suit this machine)")
    limit = max_world_size()
    if world_size > limit and not under_torchrun():
        raise ValueError(f"{name}={world_size} is more than this machine can run: at most {limit} ranks "
                         f"({os.cpu_count()} cores; each rank is a process of ~150 MB, and gloo connects every rank "
                         "to every other). Use 2-8 ranks; COURSE_LIB_MAX_WORLD_SIZE raises the limit")


def max_world_size() -> int:
    """Most ranks this machine runs: each rank is a process of ~150 MB that gloo connects to every other."""
    env = os.environ.get("COURSE_LIB_MAX_WORLD_SIZE")
    if env:
        return int(env)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return max(2, min(64, int(avail // (150 << 20))))


def pickle_call(fn, args, kwargs) -> bytes:
    """Pickle the call by value; if that fails, name the piece that cannot travel to the ranks."""
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        pieces = [("the function " + getattr(fn, "__name__", repr(fn)), fn)]
        pieces += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
        pieces += [(f"keyword argument {k}= ({type(v).__name__})", v) for k, v in kwargs.items()]
        for what, obj in pieces:
            try:
                cloudpickle.dumps(obj)
            except Exception as inner:
                raise TypeError(f"run() cannot send {what} to the ranks: {type(inner).__name__}: {inner}. "
                                "Pass plain data (tensors, numbers, configs) and build the rest inside fn") from None
        raise TypeError(f"run() cannot pickle the call: {exc}") from None


def run_under_torchrun(fn, args, kwargs) -> RunResult:
    import torch.distributed as dist
    from course_lib.comm import torch_ledger
    if not dist.is_initialized():
        dist.init_process_group(torch_ledger.register(with_cuda=want_cuda()))
    torch_ledger.recorder().reset()
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    values = [None] * dist.get_world_size()
    with torch_ledger.paused():
        dist.all_gather_object(values, to_cpu(value))
    out = RunResult(values)
    out.seconds = time.perf_counter() - t0
    out.ledger = torch_ledger.recorder().ledger()
    out.backend = "torchrun"
    return out


def want_cuda() -> bool:
    import torch
    return torch.cuda.is_available()
