"""``%%ranks``: a notebook cell whose code runs on every rank of the warm pool, each rank keeping its variables.

Loaded by ``import course_lib`` in a Jupyter kernel (or ``%load_ext course_lib``)::

    %%ranks                       # -n 4 ranks (default), --timeout 45 s (default), --push cfg,shard
    import torch, torch.distributed as dist
    model = torch.nn.Linear(4, 4)             # lives on each rank until the ranks restart
    dist.get_rank()                           # the last expression: one value per rank (a list, as run() returns)

The cell is :func:`course_lib.run` of :func:`exec_cell` -- the same pool, timeouts, hang report and clean-up:
a raise or exit names the rank and the cell's line, a hang ends at the timeout naming the collective, the missing
rank and each rank's line (:class:`~course_lib.launch.results.LaunchTimeout`), Ctrl-C kills the ranks. Output is
grouped by rank when the cell ends, lines that every rank printed alike shown once (``[ranks 0–3] ...``). The
:class:`~course_lib.launch.results.RunResult` (values, ``.ledger``, ``.seconds``) is ``_ranks`` in the notebook.
Notebook variables are not on the ranks: ``--push a,b`` copies them (by value, cloudpickle) into every rank's
namespace before the cell runs. A fault, an interrupt or ``run(..., fresh=True)`` starts new ranks: their variables are gone, and the next cell says so.
"""
from __future__ import annotations

import argparse
import ast
import linecache
import os
import shlex
import sys

_NAMESPACE: dict = {"__name__": "__ranks__"}   # rank side: every %%ranks cell's variables, for the rank's life


def namespace() -> dict:
    """Rank side: the variables of this rank's ``%%ranks`` cells (a ``run(fn)`` may read them)."""
    return _NAMESPACE


def _remember(source: str, filename: str) -> None:
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def exec_cell(source: str, filename: str, pushed: dict | None = None):
    """Rank side: run a cell's code in this rank's namespace (``pushed``: notebook variables copied in first);
    returns (pid, value of its last expression or None)."""
    _NAMESPACE.update(pushed or {})
    _remember(source, filename)   # tracebacks on the rank show the cell's lines
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), _NAMESPACE)
    value = None
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), _NAMESPACE)
        try:
            import cloudpickle
            cloudpickle.dumps(value)
        except Exception:  # noqa: BLE001 - a model, a process group: the notebook shows its repr
            value = _Repr(repr(value))
    return os.getpid(), value


class _Repr:
    """A rank's value that cannot travel to the notebook, shown there by its repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text


_PARSER = argparse.ArgumentParser(prog="%%ranks", add_help=False)
_PARSER.add_argument("-n", "--world-size", type=int, default=4)
_PARSER.add_argument("--timeout", type=float, default=None)
_PARSER.add_argument("-p", "--push", default="")
_LAST_PIDS: dict = {}   # world size -> the rank pids whose namespaces the last cell used
_COUNTER = [0]


def ranks(line: str, cell: str):
    """The ``%%ranks [-n N] [--timeout S]`` cell magic (see the module docstring)."""
    __tracebackhide__ = True   # noqa: F841 - IPython: show the ranks' error, not this frame
    from course_lib.launch import pool
    try:
        opts = _PARSER.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"%%ranks {line!r}: usage: %%ranks [-n WORLD_SIZE] [--timeout SECONDS] "
                         "[--push NAME,NAME]") from None
    pushed = _pushed(opts.push)
    _COUNTER[0] += 1
    filename = f"<ranks cell {_COUNTER[0]}>"
    _remember(cell, filename)     # the notebook's hang report reads the cell's lines from here
    kwargs = {"world_size": opts.world_size}
    if opts.timeout is not None:
        kwargs["timeout"] = opts.timeout
    sink: dict = {}
    pool.OUTPUT_SINKS.append(sink)
    try:
        result = pool.run(exec_cell, cell, filename, pushed, **kwargs)
    except KeyboardInterrupt:
        # the ranks are stopped already; a traceback without the launcher's frames: IPython formats it faster
        raise KeyboardInterrupt("the ranks were stopped; the next %%ranks cell starts new ones") from None
    finally:
        pool.OUTPUT_SINKS.remove(sink)
        _print_grouped(sink)
    pids = [pid for pid, _ in result]
    before = _LAST_PIDS.get(opts.world_size)
    if before is not None and before != pids:
        print("(new rank processes: variables from earlier %%ranks cells are gone on every rank)", file=sys.stderr)
    _LAST_PIDS[opts.world_size] = pids
    values = [v for _, v in result]
    out = pool.RunResult(values)
    out.ledger, out.seconds, out.backend = result.ledger, result.seconds, result.backend
    _publish(out)
    return out if any(v is not None for v in values) else None


def _pushed(names: str) -> dict:
    """``--push cfg,shard``: those notebook variables, by value (a missing one named, with the fix)."""
    if not names:
        return {}
    from IPython import get_ipython
    user_ns = get_ipython().user_ns
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    missing = [n for n in wanted if n not in user_ns]
    if missing:
        raise NameError(f"%%ranks --push {names}: {', '.join(missing)} not defined in the notebook; run the cell that "
                        "defines it first")
    return {n: user_ns[n] for n in wanted}


def _publish(result) -> None:
    from IPython import get_ipython
    shell = get_ipython()
    if shell is not None:
        shell.user_ns["_ranks"] = result


def _print_grouped(sink: dict) -> None:
    """Each rank's output, ranks that printed the same text shown once: ``[ranks 0–3] line``."""
    from course_lib.launch.pool import ranks_text
    for stream, target in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        texts = {r: "".join(parts) for (r, s), parts in sorted(sink.items()) if s == stream}
        groups: dict = {}
        for r, text in texts.items():
            groups.setdefault(text, []).append(r)
        for text, rs in sorted(groups.items(), key=lambda kv: kv[1][0]):
            label = ranks_text(rs)
            for line in text.rstrip("\n").split("\n") if text else []:
                target.write(f"[{label}] {line}\n")
        target.flush()


def load_ipython_extension(ipython) -> None:
    """``%load_ext course_lib``: register ``%%ranks`` (``import course_lib`` in a kernel does it too)."""
    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")


def in_notebook_setup() -> None:
    """``import course_lib`` in IPython: register ``%%ranks``, and in a kernel start the fork server early."""
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None:
        return
    load_ipython_extension(shell)
    from course_lib.launch import pool
    pool.start_early()
