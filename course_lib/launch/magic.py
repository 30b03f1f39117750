"""``%%ranks``: a notebook cell whose code runs on every rank of the warm pool, each rank keeping its variables.

Loaded by ``import course_lib`` in a Jupyter kernel (or ``%load_ext course_lib``)::

    %%ranks                       # -n 4 ranks (default); --wait 40, --timeout S, --push cfg,shard: see %%ranks --help
    import torch, torch.distributed as dist
    model = torch.nn.Linear(4, 4)             # lives on each rank until the ranks restart
    dist.get_rank()                           # the last expression: one value per rank (a list, as run() returns)

The cell runs through the same pool, hang report and clean-up as :func:`course_lib.run`. Limits: computing has
none; a cell ends as a hang when a rank has waited in a collective for ``--wait`` s (default 40, under the process
group's 45 s timeout) while no rank made progress -- the collective, the missing rank and each rank's line named
(:class:`~course_lib.launch.results.LaunchTimeout`). ``--timeout S`` adds a wall limit on the whole cell (and
lets a collective wait as long). A raise names the rank and shows the rank's own frames, from the cell's line on
(``sys.last_value.traceback_text``: the whole traceback, launcher frames included; ``.stacks`` after a hang).

The ranks and their variables are kept when a rank raised and every other rank finished the cell. When ranks must
restart -- a hang, a rank that died, a raise inside a collective or one the others still wait for, Ctrl-C, a
``--timeout`` above the running ranks' process-group timeout, a third world size (two stay warm) -- the cell says
so, and the start of the next ``%%ranks`` cell says it again: their variables are gone.

Output: each rank's lines show as they come, ``[rank r] ...``, once they are 1 s old; when the cell ends the grouped
view replaces them, ranks that printed the same lines shown once (``[ranks 0–3] ...``; :mod:`.cell_output` says
why this way). ``_ranks`` in the notebook is the cell's :class:`~course_lib.launch.results.RunResult`
(values, ``.ledger``, ``.seconds``), or its error after a failure. Notebook variables are not on the ranks:
``--push a,b`` copies them (by value, cloudpickle) into every rank's namespace before the cell runs.
"""
from __future__ import annotations

import argparse
import ast
import linecache
import os
import shlex
import sys

from course_lib.launch.cell_output import CellOutput

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


class _Parser(argparse.ArgumentParser):
    """argparse that neither exits nor prints its own error: ``--help`` prints the usage once, errors raise."""

    def error(self, message):
        raise _BadOptions(message)

    def exit(self, status=0, message=None):
        raise _HelpShown()


class _BadOptions(Exception):
    pass


class _HelpShown(Exception):
    pass


DEFAULT_WAIT_S = 40.0   #: --wait's default: the pool's 45 s process-group timeout less pool.STALL_MARGIN_S

_PARSER = _Parser(prog="%%ranks", description="Run the cell's code on every rank; each rank keeps its variables.")
_PARSER.add_argument("-n", "--world-size", type=int, default=4, help="number of ranks (default 4)")
_PARSER.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                     help=f"end the cell as a hang when a rank waits in a collective this long while no rank makes "
                          f"progress (default {DEFAULT_WAIT_S:g}; computing has no limit)")
_PARSER.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                     help="a wall limit on the whole cell (default: none)")
_PARSER.add_argument("-p", "--push", default="", metavar="NAME,NAME",
                     help="copy these notebook variables into every rank's namespace first")
_SEEN: dict = {}   # world size -> the pool the latest %%ranks -n N cell ran on (its variables live there)
_AGAIN: list = []  # pools a %%ranks cell stopped to start others (said then, and again at the next cell's start)
_COUNTER = [0]


def ranks(line: str, cell: str):
    """The ``%%ranks [-n N] [--wait S] [--timeout S] [--push a,b]`` cell magic (see the module docstring)."""
    __tracebackhide__ = True   # noqa: F841 - IPython: show the ranks' error, not this frame
    from course_lib.launch import pool, preflight
    from course_lib.launch.results import MAGIC_SPELLING, RankError
    notes = _restarts_since()   # first, whatever this cell does: ranks restarted since the last %%ranks cell
    for note in notes:
        print(note, file=sys.stderr)
    try:
        opts = _PARSER.parse_args(shlex.split(line))
        preflight.check_world_size(opts.world_size, "-n")
        for name in ("wait", "timeout"):
            if getattr(opts, name) is not None and getattr(opts, name) <= 0:
                raise _BadOptions(f"--{name} {getattr(opts, name):g} must be > 0 seconds")
    except _HelpShown:
        return None
    except (_BadOptions, ValueError) as exc:
        from IPython.core.error import UsageError
        raise UsageError(f"%%ranks {line}: {exc}\n{_PARSER.format_usage().strip()}  (%%ranks --help for more)") from None
    pushed = _pushed(opts.push)
    filename = _cell_filename()
    _remember(cell, filename)     # the notebook's hang report reads the cell's lines from here
    # --timeout S alone: a collective may wait as long as the cell may last (less the margin: see pool.STALL_MARGIN_S)
    wait = opts.wait if opts.wait is not None else max(DEFAULT_WAIT_S, (opts.timeout or 0.0) - pool.STALL_MARGIN_S)
    out = CellOutput(notes)

    def notify(text, stopped):
        if _SEEN.get(stopped.world_size) is not stopped:
            return                  # no %%ranks cell's variables on those ranks (a run() call started them)
        note = f"({text})"
        print(note, file=sys.stderr)
        out.notes.append(note)
        _AGAIN.append(stopped)      # said again at the start of the next %%ranks cell
    out.attach()
    pool.LAST_POOL[0] = None
    try:
        result = pool.launch(exec_cell, (cell, filename, pushed), {}, world_size=opts.world_size,
                             timeout=opts.timeout, stall_s=wait, spelling=MAGIC_SPELLING, notify=notify,
                             pg_floor_s=pool.DEFAULT_TIMEOUT_S, source=cell)
    except KeyboardInterrupt:
        _SEEN[opts.world_size] = pool.LAST_POOL[0]
        # the ranks are stopped already; a traceback without the launcher's frames: IPython formats it faster
        err = KeyboardInterrupt("the ranks were stopped and restarted: the variables of earlier %%ranks cells are "
                                "gone")
        _briefly(err)
        _publish(err)
        raise err from None
    except RankError as err:
        used = pool.LAST_POOL[0]
        _SEEN[opts.world_size] = used
        if err.exc_type not in ("LaunchTimeout", "RankDied"):   # those say what became of the ranks already
            err.args = (f"{err}\n\n{_after_error(err, used)}",)
        _briefly(err)
        _publish(err)
        raise
    finally:
        out.finish()
    _SEEN[opts.world_size] = pool.LAST_POOL[0]
    values = [v for _, v in result]
    res = pool.RunResult(values)
    res.ledger, res.seconds, res.backend = result.ledger, result.seconds, result.backend
    _publish(res)
    return res if any(v is not None for v in values) else None


def _cell_filename() -> str:
    """``Cell In[7]``: the notebook's own number for this cell, as IPython names its cells in tracebacks."""
    from IPython import get_ipython
    # IPython registers each cell's number as it compiles it (its tracebacks' "Cell In[n]"): the latest is this cell.
    # (Not execution_count: IPython 9 has already counted on to the next cell when the cell runs, 8 had not.)
    numbers = list(getattr(getattr(get_ipython(), "compile", None), "_filename_map", {}).values())
    if numbers and isinstance(numbers[-1], int):
        return f"Cell In[{numbers[-1]}]"
    _COUNTER[0] += 1
    return f"<ranks cell {_COUNTER[0]}>"


def _alive(p) -> bool:
    from course_lib.launch import pool
    return p is not None and pool._POOLS.get((p.world_size, p.backend)) is p and p.alive()


def _restarts_since() -> list:
    """A line for each world size whose ranks were restarted since the last %%ranks cell that used them (said once)."""
    gone = [p for n, p in sorted(_SEEN.items()) if p is not None and not _alive(p)]
    gone += [p for p in _AGAIN if p not in gone]
    _AGAIN.clear()
    for p in gone:
        if _SEEN.get(p.world_size) is p:
            _SEEN[p.world_size] = None
    return [f"(the {p.world_size} ranks were restarted {p.ended or '(their processes ended)'}: the variables of earlier "
            f"%%ranks -n {p.world_size} cells are gone; rerun the cells that define them)" for p in gone]


def _after_error(err, used) -> str:
    """What became of the ranks after a raise: kept (every other rank finished the cell), or restarted, and why."""
    from course_lib.launch.results import ranks_text
    if _alive(used):
        failed = sorted({err.rank, *err.others})
        done = [r for r in range(used.world_size) if r not in failed]
        did = f"{ranks_text(done)} finished the cell; " if done else ""
        return (f"The ranks are kept, with their variables: {did}{ranks_text(failed)} stopped at the error (what "
                "ran before it is there).")
    why = getattr(used, "ended", None) or ""
    return f"The ranks were restarted {why}: the variables of earlier %%ranks cells are gone.".replace("  ", " ")


def _briefly(err) -> None:
    """IPython shows this error as its text alone: no launcher frames above the ranks' own (``_render_traceback_``,
    the hook ipyparallel uses for engines' errors). The exception keeps its frames for ``%debug``."""
    name = type(err).__name__
    err._render_traceback_ = lambda: [f"\x1b[0;31m{name}\x1b[0m: {err}"]


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


def load_ipython_extension(ipython) -> None:
    """``%load_ext course_lib``: register ``%%ranks`` (``import course_lib`` in a kernel does it too)."""
    ipython.register_magic_function(ranks, magic_kind="cell", magic_name="ranks")
    ipython.register_magic_function(ranks_help, magic_kind="line", magic_name="ranks")


def ranks_help(line: str = "") -> None:
    """``%ranks`` (one %): print ``%%ranks``'s options (IPython refuses ``%%ranks --help`` alone: its body is empty,
    and then points here)."""
    _PARSER.print_help()


def in_notebook_setup() -> None:
    """``import course_lib`` in IPython: register ``%%ranks``, and in a kernel start the fork server early."""
    if "IPython" not in sys.modules:
        return
    from IPython import get_ipython
    shell = get_ipython()
    if shell is None:
        return
    load_ipython_extension(shell)
    from course_lib.launch import forkserver, kernel_exit, pool
    if forkserver.start_early():
        kernel_exit.install(pool.shutdown)   # the ranks, then the servers, stop when the kernel shuts down
