"""The grader's guard inside a submission's kernel: the second line, which reports tampering.

Verdicts are not decided here: in a graded kernel each check runs only its run half and writes plain data to the
outbox, and the grader's judge decides outside the box (:mod:`course_lib.checks.judge`). What this module records
(each check's printed outcome, and what no lab asks a learner to do) names tampering for the report's flags.

The grading kernel starts as ``python -c "...guard import main; main(...)" --lab NN --channel FIFO -f CONN``. Before the
kernel exists, so before any line of the submission runs, :func:`boot`:

1. opens the **channel**, a pipe the grader reads outside the sandbox, and removes its path: what is written to it
   is the grader's at once, and nothing the notebook does later takes it back;
2. installs a Python **audit hook** (PEP 578; it cannot be removed) that writes a ``flag`` record when the
   notebook's own code (a cell, or a string it compiles) does what no lab asks for: writes a file of the library or
   the Python installation, replaces an attribute of a class or function of the library, torch, NumPy or JAX,
   compiles code under the library's file names, builds code objects, walks the garbage collector, calls ctypes,
   adds its own audit hook, or opens ``/proc/*/mem`` or another process's descriptors;
3. imports the checks' core and registers an **observer**: each check's outcome (✅/❌/⏳) is written to the channel
   as it is decided, if and only if it was decided inside that exercise's own check function, as the library ships
   it (its code object, kept when the lab's check module was imported). A ✅ printed by the notebook, or produced by
   entering ``checks.check(...)`` by hand, is no verdict;
4. watches imports: each module of ``course_lib`` (and torch, NumPy, JAX, builtins) is **fingerprinted** when it
   has been executed -- the identity of every function, class and method in it.

At the end the grader asks for :func:`finish` with a fresh nonce: the fingerprints are compared, every change
("``course_lib.checks.lab02.check_storage_bytes`` replaced", "``sys.modules['torch']`` replaced") is reported, and
the record echoes the nonce. A submission that disabled the guard sends no such record, and is flagged for that.

What this does not do: the notebook runs in this process, so code written to defeat this module in particular
(reading its state, writing its own records to the channel) can still forge a record -- which now decides no
verdict: it can only hide a flag. The sandbox (:mod:`.sandbox`) is what no notebook can get out of; this is what makes cheating visible.

Longer than ~300 lines: the hook, the fingerprints and the observer share one state and one idea of "the
notebook's own code"; split, each part would import the others' private names.
"""
from __future__ import annotations

import json
import os
import re
import sys
import types

__all__ = ["boot", "finish", "record"]

#: Names of modules whose functions and classes are fingerprinted (a prefix matches submodules of course_lib).
WATCHED = ("course_lib", "torch", "torch.testing", "torch.distributed", "numpy", "jax", "jax.numpy", "math",
           "operator", "builtins")
#: Audit events that no lab's own code raises (see the module docstring).
_SUSPECT_EVENTS = {"object.__setattr__", "object.__delattr__", "compile", "code.__new__", "gc.get_objects",
                   "gc.get_referrers", "gc.get_referents", "sys.addaudithook", "open"}
_CELL_FILE = re.compile(r"/ipykernel_\d+/\d+\.py$|^<ipython-input-|^<string>$|^<stdin>$")
_INDIRECTION = ("unittest/mock.py", "contextlib.py", "functools.py")      # calls made on the caller's behalf

_state: dict = {"fd": None, "lab": "", "roots": (), "codes": {}, "prints": {}, "busy": False, "sent": 0}


def record(kind: str, **payload) -> None:
    """Write one JSON line to the grader's channel (atomic up to the pipe's 4 KiB)."""
    fd = _state["fd"]
    if fd is None:
        return
    for key, value in payload.items():
        if isinstance(value, str) and len(value) > 1500:
            payload[key] = value[:1500] + "…"
    try:
        os.write(fd, (json.dumps({"kind": kind, **payload}, ensure_ascii=False) + "\n").encode())
        _state["sent"] += 1
    except OSError:
        pass


# --------------------------------------------------------------------------------------------- who is calling
def _is_cell(filename: str) -> bool:
    return bool(_CELL_FILE.search(filename))


def _notebook_caller(depth: int = 2):
    """The frame of the notebook's code that caused the current event, or None when library code did.

    The immediate caller decides (an ``import torch`` in a cell runs torch's own code, which may set attributes of
    torch's classes: not the notebook's doing); calls that act for their caller (``mock.patch``) are looked through.
    """
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if _is_cell(name):
            return frame
        if not name.endswith(_INDIRECTION):
            return None
        frame = frame.f_back
    return None


def _under(path, roots) -> bool:
    try:
        p = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return any(p == r or p.startswith(r + os.sep) for r in roots)


def _writes(mode, flags) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC))


def _owner(obj) -> str:
    return str(getattr(obj, "__module__", "") or "")


def _watched_name(name: str) -> bool:
    return name.startswith("course_lib") or name in WATCHED


def _hook(event: str, args) -> None:
    if event not in _SUSPECT_EVENTS and not event.startswith("ctypes.") or _state["busy"]:
        return
    _state["busy"] = True
    try:
        why = _suspect(event, args)
        if why:
            frame = _notebook_caller(3) if event != "open" else None
            where = f" (line {frame.f_lineno} of a cell)" if frame is not None else ""
            record("flag", rule=why[0], detail=why[1] + where)
    except Exception:       # the hook must never break the notebook
        pass
    finally:
        _state["busy"] = False


def _suspect(event: str, args) -> tuple[str, str] | None:
    if event == "open":
        path, mode, flags = (list(args) + [None, None, None])[:3]
        if isinstance(path, int) or path is None:
            return None
        text = os.fsdecode(path)
        if _writes(mode, flags) and _under(text, _state["roots"]):
            return "library files", f"opened {text} for writing"
        if re.match(r"/proc/(self|\d+)/(mem|fd/|environ)", text) and _notebook_caller(4) is not None:
            return "introspection", f"opened {text}"
        return None
    if _notebook_caller(4) is None:
        return None
    if event in ("object.__setattr__", "object.__delattr__"):
        obj, name = args[0], args[1]
        if isinstance(obj, (type, types.FunctionType)) and _watched_name(_owner(obj)):
            return "library internals", f"{event.split('.')[-1].strip('_')} {_owner(obj)}.{getattr(obj, '__qualname__', obj)}.{name}"
        return None
    if event == "compile":
        filename = args[1] if len(args) > 1 else ""
        if isinstance(filename, (str, bytes)) and _under(filename, _state["roots"]):
            return "library internals", f"compiled code under the library's file name {os.fsdecode(filename)}"
        return None
    if event == "code.__new__":
        return "library internals", "built a code object by hand"
    if event.startswith("gc.") or event.startswith("ctypes."):
        return "introspection", f"called {event}"
    if event == "sys.addaudithook":
        return "introspection", "added an audit hook of its own"
    return None


# --------------------------------------------------------------------------------------------- fingerprints
#: The builtins a check relies on (the kernel itself replaces ``input`` and friends on every request).
_BUILTINS = ("print", "isinstance", "issubclass", "len", "sum", "abs", "min", "max", "round", "sorted", "all", "any",
             "getattr", "setattr", "hasattr", "repr", "str", "int", "float", "bool", "type", "id", "range", "zip",
             "map", "__import__", "open", "iter", "next", "exec", "eval", "compile", "format")


def _fingerprint(module) -> dict[str, tuple]:
    """name -> identities of what a module defines: functions (with their code and defaults), classes (with their
    attributes), submodules. Plain data (numbers, dicts, caches) may change as a lab runs and is not compared.
    Only ``type()`` is asked of each value: ``isinstance`` would read ``__class__``, which some deprecated objects
    (``torch.distributed.reduce_op``) answer with a warning."""
    out = {}
    items = list(vars(module).items())
    if module.__name__ == "builtins":
        items = [(k, v) for k, v in items if k in _BUILTINS]
    for name, value in items:
        kind = type(value)
        if kind is types.FunctionType:
            out[name] = (id(value), id(value.__code__), id(value.__defaults__), id(value.__kwdefaults__))
        elif issubclass(kind, type) and _owner(value) == module.__name__:
            out[name] = _fingerprint_class(value)
        elif issubclass(kind, type) or kind in (types.ModuleType, types.BuiltinFunctionType):
            out[name] = (id(value),)
    return out


def _remember(module) -> None:
    name = module.__name__
    _state["prints"][name] = (id(module), _fingerprint(module))
    if name.startswith("course_lib.checks.lab"):
        from course_lib.checks import registry            # the exercises this module just declared
        for (lab, ex_name), ex in list(registry._REGISTRY.items()):
            if lab == _state["lab"]:
                _state["codes"].setdefault(ex_name, ex.check.__code__)
    if name == "torch":
        _state["prints"]["torch.Tensor"] = (id(module.Tensor), {"Tensor": _fingerprint_class(module.Tensor)})


def _fingerprint_class(cls) -> tuple:
    return (id(cls),) + tuple(sorted((k, id(v)) for k, v in vars(cls).items()
                                     if type(v) in (types.FunctionType, classmethod, staticmethod, property)))


class _Watch:
    """A meta-path finder that finds nothing itself: it lets the next finder find a watched module and
    fingerprints the module right after it has been executed."""

    def find_spec(self, name, path=None, target=None):
        if not _watched_name(name):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            original = loader.exec_module

            def exec_module(module, _original=original):
                _original(module)
                _remember(module)
            try:
                loader.exec_module = exec_module
            except (AttributeError, TypeError):
                pass
        return spec


def _foreign(module, attr: str) -> bool:
    """Whether ``module.attr`` now holds something defined outside the module's own package.

    torch rebinds a few of its own functions when a submodule is first imported (``torch._dynamo`` wraps
    ``torch.manual_seed``): a change made by the package itself is its own business. In course_lib every change counts."""
    if module.__name__.startswith("course_lib"):
        return True
    value = getattr(module, attr, None)
    home = str(getattr(value, "__module__", "") or "")
    return home.split(".")[0] != module.__name__.split(".")[0]


def _changes() -> list[str]:
    found = []
    for name, (module_id, prints) in _state["prints"].items():
        if name == "torch.Tensor":
            torch = sys.modules.get("torch")
            if torch is not None and _fingerprint_class(torch.Tensor) != prints["Tensor"]:
                now = dict(_fingerprint_class(torch.Tensor)[1:])
                for attr, ident in prints["Tensor"][1:]:
                    if now.get(attr) != ident and _foreign(types.SimpleNamespace(__name__="torch", **{
                            attr: getattr(torch.Tensor, attr, None)}), attr):
                        found.append(f"torch.Tensor.{attr} replaced")
            continue
        module = sys.modules.get(name)
        if module is None:
            continue
        if id(module) != module_id:
            found.append(f"sys.modules[{name!r}] replaced")
            continue
        now = _fingerprint(module)
        for attr, ident in prints.items():
            if attr not in now:
                found.append(f"{name}.{attr} deleted")
            elif now[attr] != ident and _foreign(module, attr):
                found.append(f"{name}.{attr} replaced")
    if not _observer_in_place():
        found.append("course_lib.checks.core.OBSERVERS: the grader's observer removed")
    return found


# --------------------------------------------------------------------------------------------- verdicts
def _observer(chk, state: str, text: str) -> None:
    code = _state["codes"].get(chk.name)
    if code is None:
        return                  # not an exercise of this lab (a parity check, a demo): nothing to grade
    frame, inside = sys._getframe(2), False       # 0: here, 1: check._notify, 2: check.__exit__/_wrong ...
    while frame is not None:
        if frame.f_code is code:
            inside = True
            break
        frame = frame.f_back
    if inside:
        record("check", name=chk.name, state=state, text=text)
    else:
        record("flag", rule="forged check", detail=f"a {state!r} outcome for {chk.name!r} was produced outside its "
                                                   f"check function")


def _observer_in_place() -> bool:
    from course_lib.checks import core
    return any(o is _observer for o in core.OBSERVERS)


def boot(lab: str, channel: str) -> None:
    """Everything before the kernel starts (see the module docstring)."""
    fd = os.open(channel, os.O_WRONLY)
    os.unlink(channel)
    _state.update(fd=fd, lab=lab)
    import course_lib
    lib = os.path.dirname(os.path.realpath(course_lib.__file__))
    _state["roots"] = tuple({lib, os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)})
    sys.meta_path.insert(0, _Watch())
    sys.addaudithook(_hook)
    for name, module in list(sys.modules.items()):
        if _watched_name(name) and isinstance(module, types.ModuleType):
            _remember(module)
    from course_lib.checks import core
    core.OBSERVERS.append(_observer)
    _remember(core)
    record("boot", lab=lab, pid=os.getpid())


def finish(nonce: str) -> None:
    """The integrity report the grader asks for after the last cell."""
    record("integrity", nonce=nonce, changes=_changes()[:50], records=_state["sent"])


def main(argv: list[str]) -> None:
    opts, rest, i = {}, [], 0
    while i < len(argv):
        if argv[i] in ("--lab", "--channel") and i + 1 < len(argv):
            opts[argv[i]], i = argv[i + 1], i + 2
        else:
            rest, i = rest + [argv[i]], i + 1
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path.pop(0)                                   # as ipykernel_launcher: the notebook's folder is not code
    boot(opts["--lab"], opts["--channel"])
    # In the box the kernel's parent is the PID namespace's init (pid 1), which ipykernel's parent poller reads as
    # "my parent exited": the box ends with the grader anyway (bwrap --die-with-parent).
    os.environ.pop("JPY_PARENT_PID", None)
    from ipykernel import kernelapp
    kernelapp.IPKernelApp.launch_instance(argv=rest)

