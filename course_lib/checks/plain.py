"""Plain data: what crosses from a check's *run* half (which executes the learner's code) to its *judge* half.

Vocabulary (used by :mod:`course_lib.checks.judge` and every lab's checks):

* **plain data** -- ``None``, ``bool``, ``int``, ``float``, ``str``, lists, dicts and NumPy arrays of numbers or bools,
  nested, and nothing else: no object of the learner's, no method of theirs is ever called to compare it;
* :func:`plain` turns a learner's value into plain data *without calling its methods*: an ``int`` subclass whose
  ``==`` always says yes becomes the plain ``int`` it really holds (read through ``int.__repr__``), a tensor or JAX
  array becomes a NumPy copy of its numbers, anything else becomes ``{"unplain": "<its type name>"}`` so the judge
  can name it;
* :func:`dumps` / :func:`loads` are the wire format: one ``.npz`` (``numpy.savez``; loaded with
  ``allow_pickle=False``, so no bytes can become code) holding the arrays and a JSON document for the rest.

Every check round-trips its run's data through ``loads(dumps(...))``, in a lab as in grading, so the judge sees
exactly what a grader outside the box would read from the file.
"""
from __future__ import annotations

import io
import json
import math
import sys
from typing import Any

import numpy as np

__all__ = ["plain", "typed", "dumps", "loads", "MAX_BYTES", "UNPLAIN", "type_name"]

#: A run's data larger than this is refused (the grader reads files a box wrote).
MAX_BYTES = 64 * 2**20
#: The key that marks a value :func:`plain` could not convert.
UNPLAIN = "unplain"
_ARRAY = "__array__"          # {"__array__": i}: the i-th array of the .npz
_PAIRS = "__pairs__"          # {"__pairs__": [[k, v], ...]}: a dict whose keys are not all strings
_TUPLE = "__tuple__"          # {"__tuple__": [...]}: a tuple, kept apart from a list (a shape is a tuple)


def type_name(value: Any) -> str:
    """The type's name as a learner would write it (``int``, ``torch.Tensor``, ``MyInt``), never calling the value."""
    t = type(value)
    mod = getattr(t, "__module__", "") or ""
    return t.__qualname__ if mod in ("builtins", "__main__") else f"{mod.split('.')[0]}.{t.__qualname__}"


def _is(value: Any, kind) -> bool:
    """isinstance by the value's real type: a ``__class__`` property that claims another type is not believed."""
    return issubclass(type(value), kind)


def _array(value: Any) -> np.ndarray | None:
    """A NumPy copy of an array-like's numbers (ndarray, NumPy scalar, torch tensor, JAX array), or None."""
    if _is(value, np.ndarray):
        out = np.array(value, copy=True, subok=False)
    elif _is(value, np.generic):
        out = np.array(value)
    else:
        torch, jax = sys.modules.get("torch"), sys.modules.get("jax")   # whichever the kernel imported
        if torch is not None and _is(value, torch.Tensor):
            with torch._C.DisableTorchFunction():          # a tensor subclass's overrides are not consulted
                t = torch.Tensor.detach(value).cpu()
                if t.dtype == torch.bfloat16:
                    t = t.float()
                out = np.array(torch.Tensor.numpy(t), copy=True)
        elif jax is not None and _is(value, jax.Array):
            out = np.array(np.asarray(value), copy=True)
        else:
            return None
    if out.dtype.name == "bfloat16":                    # JAX's ml_dtypes bfloat16: its values, as torch's are sent
        out = out.astype(np.float32)
    if out.dtype == object or out.dtype.kind not in "biufc":
        return None
    return out


def plain(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain data (see the module docstring); never calls a method the value's own class defines."""
    if _depth > 20:
        return {UNPLAIN: "nested more than 20 levels"}
    if value is None or type(value) in (bool, str):
        return value
    if _is(value, bool):                       # bool cannot be subclassed; kept for clarity
        return bool(int.__index__(value))
    if _is(value, int):
        return int(int.__repr__(value))                # the number it really holds, whatever its == says
    if _is(value, float):
        return float(float.__repr__(value))
    if _is(value, str):
        return str.__str__(value)
    if _is(value, (list, tuple)):
        items = [plain(v, _depth + 1) for v in (list.__iter__(value) if _is(value, list)
                                                  else tuple.__iter__(value))]
        return items if _is(value, list) else tuple(items)
    if _is(value, dict):
        return {plain(k, _depth + 1): plain(v, _depth + 1) for k, v in dict.items(value)}
    arr = _array(value)
    if arr is not None:
        return arr
    return {UNPLAIN: type_name(value)}


def typed(value: Any, frameworks: tuple[str, ...] = ("torch.", "jax")) -> dict:
    """``{"type", "dtype", "values"}``: a value as plain data that keeps its element type. For a tensor or array of
    one of ``frameworks`` (a prefix of its type's name) ``dtype`` is the framework's own name ("bfloat16", whose
    numbers travel as float32); otherwise None, and ``values`` is :func:`plain`."""
    kind = type_name(value)
    arr = _array(value) if kind.startswith(frameworks) else None
    if arr is None:
        return {"type": kind, "dtype": None, "values": plain(value)}
    torch = sys.modules.get("torch")
    if torch is not None and _is(value, torch.Tensor):
        dtype = str(torch.Tensor.dtype.__get__(value)).removeprefix("torch.")
    else:
        dtype = str(np.asarray(value).dtype)
    return {"type": kind, "dtype": dtype, "values": arr}


def _encode(value: Any, arrays: list) -> Any:
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {_ARRAY: len(arrays) - 1}
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, arrays) for v in value]}
    if isinstance(value, dict):
        if all(type(k) is str for k in value):
            return {k: _encode(v, arrays) for k, v in value.items()}
        return {_PAIRS: [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    return value


def _decode(value: Any, arrays) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if isinstance(value, dict):
        if set(value) == {_ARRAY}:
            return arrays[f"a{int(value[_ARRAY])}"]
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        if set(value) == {_TUPLE}:
            return tuple(_decode(v, arrays) for v in value[_TUPLE])
        if set(value) == {_PAIRS}:
            return {_key(_decode(k, arrays)): _decode(v, arrays) for k, v in value[_PAIRS]}
        return {k: _decode(v, arrays) for k, v in value.items()}
    return value


def _key(k: Any) -> Any:
    return tuple(_key(x) for x in k) if isinstance(k, (list, tuple)) else k


def dumps(value: Any) -> bytes:
    """``value`` (anything: it is made :func:`plain` first) as bytes of the wire format."""
    arrays: list[np.ndarray] = []
    doc = json.dumps(_encode(plain(value), arrays), allow_nan=False).encode()
    buf = io.BytesIO()
    np.savez(buf, __json__=np.frombuffer(doc, dtype=np.uint8), **{f"a{i}": a for i, a in enumerate(arrays)})
    return buf.getvalue()


def loads(data: bytes) -> Any:
    """The plain data in ``data`` (from :func:`dumps`); raises ``ValueError`` for anything else, never runs code."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{len(data):,} bytes of run data, over the {MAX_BYTES:,} a check may send")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: np.array(z[k]) for k in z.files}
        doc = json.loads(arrays.pop("__json__").tobytes().decode())
    except Exception as exc:
        raise ValueError(f"not a check's run data: {type(exc).__name__}: {exc}") from None
    return _decode(doc, arrays)
