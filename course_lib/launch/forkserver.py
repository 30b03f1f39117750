"""The fork servers the ranks come from: what each imports, when each starts, which one a call needs.

Ranks are forked from a *fork server*, never from the notebook kernel, whose JAX/CUDA threads would make ``fork``
unsafe; a warm server also makes a start fast: the frameworks are imported once, not once per rank. Two servers,
so that **a rank never imports a framework after the fork** (four ranks importing JAX at once on 2 cores stalled
Lab 05 for 45 s) and a torch call never waits for JAX: the **torch** server preloads ``PRELOAD["full"]`` (torch,
FSDP2/DDP, DTensor, dynamo, the course's models), the **jax** server that and ``PRELOAD["jax"]``.

When each starts. In a script: at the first call that needs it. In a Jupyter kernel (:func:`start_early`), one at
``import course_lib``, in the background -- the jax server if that cell imports JAX (every lab's first cell does),
else the torch server -- and the jax server the moment the kernel imports JAX later (an import hook,
:class:`_JaxImportHook`), replacing the torch server if no rank came from it yet. While no torch server was
started a torch call runs on the jax server's ranks (they have torch). If the cell that imports course_lib also
calls ``run``, its server preloads torch alone (``PRELOAD["minimal"]``): that call has ranks as soon as the cell's
own ``import torch`` is done; after the cell it is replaced by a full one (:func:`after_first_cell`; one with
ranks stays, they die with it, until the kernel shuts down).

Which server a call needs (:func:`needs`): ``"jax"`` when the pickled call -- the function by value, its globals,
closures, arguments, and the names its code uses, which include every module it imports -- names a module of
:data:`JAX_FAMILY` (what unpickling it on a rank would import), when a function it sends by reference (defined in
an importable module) imports or reads one in its own code (the functions that one calls are not followed), or
when a ``%%ranks`` cell imports one (:func:`source_needs`); else ``"torch"``. A JAX call on ranks forked from the
torch server restarts them from the jax server (``%%ranks`` says so).

Each server is CPython's own :class:`multiprocessing.forkserver.ForkServer` (its private fields are read here only),
one instance per kind; a :class:`RankProcess`'s ``Popen`` asks the server chosen in :meth:`Server.start_process`.
"""
from __future__ import annotations

import importlib.abc
import io
import os
import pickletools
import signal
import sys
import threading
import time
from multiprocessing import forkserver as _mp_forkserver
from multiprocessing import popen_forkserver, reduction, spawn, util
from multiprocessing.context import ForkServerProcess, set_spawning_popen

#: What a fork server imports once for every rank (:mod:`.preload`, the garbage collector paused and frozen).
#: "full" (the default) adds FSDP2/DDP, DTensor, dynamo (which the first optimizer or DDP imports) and the
#: course's models: 4 ranks importing them on 2 cores cost 4-7 s per lab, once in the server under 1 s.
#: "minimal": a kernel's early server's torch (:func:`start_early`). "jax": the jax server's, besides the torch list.
#: ``COURSE_LIB_PRELOAD=auto``: the torch list is "minimal" plus what of "full" the notebook imported (at the start).
PRELOAD = {
    "minimal": ["torch", "torch.distributed", "cloudpickle", "course_lib.comm.torch_ledger"],
    "full": ["torch", "torch.distributed", "cloudpickle", "course_lib.comm.torch_ledger", "torch.distributed.fsdp",
             "torch.distributed.tensor", "torch.nn.parallel", "torch._dynamo", "torch.optim", "course_lib.models"],
    "jax": ["jax", "jax.numpy"],
}
#: Top-level modules that make a call need the jax server: a rank that unpickles a reference to one imports it.
JAX_FAMILY = frozenset({"jax", "jaxlib", "flax", "optax", "orbax", "chex"})
PRELOAD_ENV = "COURSE_LIB_PRELOAD_MODULES"   # a server's module list, as its environment hands it over (.preload)


def preload_modules(mode: str | None = None) -> list:
    """The torch server's modules for ``COURSE_LIB_PRELOAD`` (auto, minimal, full; default full)."""
    mode = mode or os.environ.get("COURSE_LIB_PRELOAD", "full")
    if mode == "auto":
        return PRELOAD["minimal"] + [m for m in PRELOAD["full"] if m not in PRELOAD["minimal"] and m in sys.modules]
    if mode not in ("minimal", "full"):
        raise ValueError(f"COURSE_LIB_PRELOAD={mode!r} must be one of ['auto', 'full', 'minimal']")
    return list(PRELOAD[mode])


def modules_for(kind: str) -> list:
    """What a server of ``kind`` ("torch" or "jax") started now preloads."""
    if kind not in ("torch", "jax"):
        raise ValueError(f"kind={kind!r} must be 'torch' or 'jax'")
    return preload_modules() + (PRELOAD["jax"] if kind == "jax" else [])


def needs(blob: bytes, source: str | None = None) -> str:
    """``"jax"`` if the pickled call ``blob`` names a module of :data:`JAX_FAMILY`, uses a function sent by reference
    whose code does (:func:`_uses_jax`), or the ``%%ranks`` cell ``source`` imports one; else ``"torch"``. Every
    string in the pickle is looked at: module and function references, and the names (``co_names``: the modules
    it imports, the globals it reads) of every code object cloudpickle sends by value."""
    strings = {arg for _, arg, _ in pickletools.genops(blob) if isinstance(arg, str)}
    if any(_is_jax(s) for s in strings):
        return "jax"
    for name in strings & set(sys.modules):   # a function sent by reference: the rank imports its module
        module = sys.modules[name]
        if any(_uses_jax(getattr(module, attr, None)) for attr in strings if attr.isidentifier()):
            return "jax"
    return source_needs(source) if source else "torch"


def _is_jax(name) -> bool:
    return isinstance(name, str) and name.split(".", 1)[0] in JAX_FAMILY


def _uses_jax(fn) -> bool:
    """A function whose code (nested functions included) imports a JAX module or reads a global that is one, or
    an object of one. One level: the functions it calls are not followed."""
    import types
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    glob = getattr(fn, "__globals__", {})
    return any(_is_jax(n) or _is_jax(getattr(glob.get(n), "__name__" if isinstance(glob.get(n), types.ModuleType)
                                             else "__module__", None)) for n in names)


def source_needs(source: str) -> str:
    """``"jax"`` if the cell ``source`` imports a module of :data:`JAX_FAMILY`, else ``"torch"``."""
    return "jax" if any(_is_jax(n) for n in _cell_names(source, imports=True)) else "torch"


def _cell_names(source: str, imports: bool) -> set:
    """The modules a cell imports (``imports``), else the names of the functions it calls."""
    import ast
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()   # the rank, or the kernel, reports it
    out = set()
    for node in ast.walk(tree):
        if imports and isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        elif not imports and isinstance(node, ast.Call):
            out.add(getattr(node.func, "attr", getattr(node.func, "id", None)))
    return out


_STARTING = threading.local()   # the ForkServer that RankProcess.start() asks (set by Server.start_process)


class _Popen(popen_forkserver.Popen):
    """CPython's forkserver ``Popen``, asking the chosen server instead of the module's single one."""

    def _launch(self, process_obj):
        server = _STARTING.server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)   # as CPython: the rank's sentinel of its parent
        self.finalizer = util.Finalize(self, util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = _mp_forkserver.read_signed(self.sentinel)


class RankProcess(ForkServerProcess):
    """A rank: a forkserver process started through :meth:`Server.start_process`."""
    _Popen = staticmethod(_Popen)


class Server:
    """One fork server of ``kind`` preloading ``modules``; ``used`` once a rank came from it."""

    def __init__(self, kind: str, modules: list):
        self.kind, self.modules, self.used, self.asked = kind, list(modules), False, None
        self._fs = _mp_forkserver.ForkServer()
        self._fs.set_forkserver_preload(["course_lib.launch.preload"])   # imports $PRELOAD_ENV, collector paused

    pid = property(lambda self: self._fs._forkserver_pid)

    def ensure_running(self) -> "Server":
        """Start it now if it is not running (cheap if it is): its imports then overlap the caller's."""
        if self.asked is None:
            self.asked = time.time()
        os.environ[PRELOAD_ENV] = ",".join(self.modules)   # read by a server started now (launch.preload), only
        # SIGINT blocked in a server from its start (as CPython starts its resource tracker): a kernel's interrupt
        # goes to its process group, and killed a server still starting, before it ignores SIGINT itself.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        try:
            self._fs.ensure_running()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.environ.pop(PRELOAD_ENV, None)
        return self

    def start_process(self, proc: RankProcess) -> None:
        """Fork ``proc`` from this server (waits for its imports on a cold start)."""
        self.used = True
        self.ensure_running()
        _STARTING.server = self._fs
        try:
            proc.start()
        finally:
            _STARTING.server = None

    def stop(self) -> None:
        """Stop it and reap it; one no rank came from is killed (it may still be importing). Its ranks die with it."""
        if self.pid is not None and not self.used:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass
        self._fs._stop()   # CPython's own: close its "alive" pipe, wait for it (nothing if it never started)


_SERVERS: dict = {}   # kind -> the server new pools of that kind come from
_RETIRED: list = []   # servers replaced while ranks they forked may live (they die with their server): stopped last


def server_for(kind: str) -> Server:
    """The running server for a call that needs ``kind``, started now if there is none (or it died). A torch call
    goes to the jax server while no torch server was started (its ranks have torch too)."""
    if kind == "torch" and "torch" not in _SERVERS and "jax" in _SERVERS:
        kind = "jax"
    server = _SERVERS.get(kind)
    if server is None:
        server = _SERVERS[kind] = Server(kind, modules_for(kind))
    return server.ensure_running()


def _retire(kind: str) -> None:
    """No new pool comes from the server of ``kind``: stopped now if no rank came from it, else at shutdown."""
    _RETIRED.append(_SERVERS.pop(kind))
    if not _RETIRED[-1].used:
        _RETIRED[-1].stop()


def stop_all() -> None:
    """Stop every server this process started (a kernel shutting down, after its ranks)."""
    for server in list(_SERVERS.values()) + _RETIRED:
        server.stop()
    _SERVERS.clear()
    _RETIRED.clear()


class _JaxImportHook(importlib.abc.MetaPathFinder):
    """Starts the jax server when the kernel starts importing JAX, then leaves ``sys.meta_path``; finds nothing."""

    def find_spec(self, name, path=None, target=None):
        if name == "jax":
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _JaxImportHook)]
            try:
                if "torch" in _SERVERS and not _SERVERS["torch"].used:   # one server while no rank came: this one
                    _retire("torch")
                server_for("jax")
            except Exception:  # noqa: BLE001 - never break the learner's import: the first JAX call starts it
                pass
        return None


def start_early() -> bool:
    """In a Jupyter kernel (``import course_lib``): start one server now: the torch server, or the jax server when
    the running cell imports JAX (or the kernel has); with torch alone (``PRELOAD["minimal"]``) if that cell calls
    ``run``, replaced after the cell (:func:`after_first_cell`). The jax server starts the moment the kernel imports
    JAX later (instead of the torch server while no rank came from it). Elsewhere (a script, a rank, the fork
    server) it does nothing. ``COURSE_LIB_EAGER=0`` turns it off."""
    import multiprocessing as mp
    if "IPython" not in sys.modules or os.environ.get("COURSE_LIB_EAGER", "1") == "0":
        return False
    from IPython import get_ipython
    shell = get_ipython()
    if getattr(shell, "kernel", None) is None or mp.current_process().name != "MainProcess":
        return False
    cell = (shell.user_ns.get("_ih") or [""])[-1]   # the running cell (IPython stores it before running it)
    kind = "jax" if "jax" in sys.modules or source_needs(cell) == "jax" else "torch"
    if not _SERVERS and "run" in _cell_names(cell, imports=False):   # ranks wanted in this very cell: torch alone
        _SERVERS[kind] = Server(kind, PRELOAD["minimal"] + (PRELOAD["jax"] if kind == "jax" else []))
    server_for(kind)
    if kind == "torch" and not any(isinstance(f, _JaxImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _JaxImportHook())

    def after_cell(*_):
        shell.events.unregister("post_run_cell", after_cell)
        after_first_cell()
    shell.events.register("post_run_cell", after_cell)
    return True


def after_first_cell() -> None:
    """Replace each server that preloads less than it should now (an early one: ``PRELOAD["minimal"]``)."""
    for kind, server in list(_SERVERS.items()):
        if not set(modules_for(kind)) <= set(server.modules):
            _retire(kind)
            _SERVERS[kind] = Server(kind, modules_for(kind)).ensure_running()


def release_in_rank() -> None:
    """In a rank: close its copy of the fork server's "alive" pipe. Held, the server would outlive the notebook, and
    the rank's PDEATHSIG (tied to the server) never fire: a rank stuck in C++ holding the GIL (a FileStore opening a
    removed directory) outlived an interrupted script by minutes. Ranks never fork through that server."""
    server = _mp_forkserver._forkserver   # in the server's children, CPython's _serve_one set these
    if server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None
        server._forkserver_address = None
