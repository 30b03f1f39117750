"""Comparing a learner's value with the reference: tolerances, element-wise closeness, likely mistakes.

Close means, element by element, ``|got - expected| <= atol + rtol * |expected|`` (numpy.isclose);
NaN equals NaN only where both have it. A **detector** is ``f(got, expected) -> str | None`` (numpy
arrays of one shape) naming a likely mistake; labs pass them as ``hint=``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from course_lib.checks.core import CheckFailed, Detector, current

__all__ = [
    "TOLERANCES", "assert_close", "parity_check",
    "summed_not_averaged", "averaged_twice", "skipped_collective", "wrong_shard_offset", "not_updated",
    "shares_memory", "untiled_collective",
]

#: The one place tolerances live. Every lab's final parity check uses one of these kinds.
TOLERANCES: dict[str, dict[str, float]] = {
    # Same fp32 maths, only the order of additions differs (ring reduction vs one big sum):
    # rounding differs in the last bits, ~1e-7 relative per op, a few steps of training.
    "fp32": {"rtol": 1e-5, "atol": 1e-6},
    # torch vs JAX/XLA: different kernels (matmul blocking, fused ops, erf vs tanh tricks) in fp32.
    "cross_framework": {"rtol": 1e-4, "atol": 1e-5},
    # bf16 keeps 8 significand bits: one rounding is up to 2**-9 ~ 2e-3 relative, and ops compound.
    "bf16": {"rtol": 2e-2, "atol": 1e-2},
    # Integers, byte counts, bit-identical checkpoint round trips.
    "exact": {"rtol": 0.0, "atol": 0.0},
}

# ------------------------------------------------------------------------------------ conversion
def _to_numpy(x: Any, path: str) -> tuple[np.ndarray, str]:
    """(float64-safe array, original dtype name) for a numpy/torch/jax array or a scalar."""
    mod = type(x).__module__
    if mod.startswith("torch"):
        if type(x).__name__ == "DTensor":
            raise CheckFailed(f"❌ {path}: got a DTensor (a sharded view). Compare `x.to_local()` with "
                              "your shard, or call `x.full_tensor()` on every rank first")
        t = x.detach().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        if t.is_floating_point() and t.element_size() < 4:   # bf16/fp16 have no numpy twin
            t = t.float()
        return t.numpy(), dtype
    arr = np.asarray(x)
    dtype = str(arr.dtype)
    if arr.dtype.kind not in "biufc":        # bfloat16 (ml_dtypes) and other extension types
        arr = arr.astype(np.float32)
    return arr, dtype


def _is_leaf_list(x) -> bool:
    return all(isinstance(v, (int, float, bool, np.number)) for v in x)


def _fmt(v) -> str:
    return f"{v:.6g}" if isinstance(v, (float, np.floating)) else str(v)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4, atol=1e-7, equal_nan=True))


# ----------------------------------------------------------------------------------- detectors
def summed_not_averaged(n: int) -> Detector:
    """got ≈ n × expected: the reduction summed where it should have averaged."""
    def detect(got, exp):
        if np.any(exp != 0) and _same(got, n * exp):
            return f"got is {n}× expected → you summed instead of averaging (forgot ÷{n})"
    return detect


def averaged_twice(n: int) -> Detector:
    """got ≈ expected / n: divided by the world size twice (e.g. ReduceOp.AVG and then ÷N)."""
    def detect(got, exp):
        if np.any(exp != 0) and _same(got, exp / n):
            return (f"got is expected ÷{n} → you averaged twice (the collective already averaged: "
                    "ReduceOp.AVG / pmean, then ÷N again)")
    return detect


def skipped_collective(local_values: Sequence[Any]) -> Detector:
    """got equals one rank's local (pre-collective) value: the collective was skipped or unused."""
    locals_ = [_to_numpy(v, "local")[0] for v in local_values]

    def detect(got, exp):
        for r, loc in enumerate(locals_):
            if _same(got, loc.astype(got.dtype, copy=False)) and not _same(loc, exp):
                return (f"got equals rank {r}'s local value → the collective was skipped, or its result "
                        "unused (torch collectives work in place on the tensor you pass)")
    return detect


def wrong_shard_offset(world_size: int, axis: int = 0) -> Detector:
    """got holds the right shards in the wrong places: shifted, permuted, or all the same one."""
    def detect(got, exp):
        if got.ndim == 0 or got.shape[axis] % world_size:
            return None
        g, e = np.split(got, world_size, axis), np.split(exp, world_size, axis)
        if all(_same(gi, e[0]) for gi in g) and not _same(e[0], e[1]):
            return "every shard holds shard 0 → the offset ignores the rank (use rank * shard_size)"
        for k in range(1, world_size):
            if all(_same(g[i], e[(i + k) % world_size]) for i in range(world_size)):
                k = k if k <= world_size // 2 else k - world_size
                return (f"got is shifted by {abs(k)} shard(s): shard r holds expected's shard r{k:+d} "
                        f"(mod {world_size}) → wrong rank offset (shard r starts at r * shard_size)")
        where = [next((j for j in range(world_size) if _same(gi, e[j])), None) for gi in g]
        if None not in where and where != list(range(world_size)):
            return f"got's shards come in the order {where} → wrong rank offset or gather order"
    return detect


def not_updated(before: Any) -> Detector:
    """got equals the value before the step: the update was never applied."""
    ref = _to_numpy(before, "before")[0]

    def detect(got, exp):
        if _same(got, ref.astype(got.dtype, copy=False)) and not _same(ref, exp):
            return "got equals the value before the step → the update was not applied (step()/grads?)"
    return detect


def _generic(got, exp):
    """Detectors that always run after the lab's own."""
    if not np.all(np.isfinite(got)) and np.all(np.isfinite(exp)):
        return "got has NaN/inf → a division by zero, an uninitialised buffer, or a diverging step"
    if not np.any(got) and np.any(exp):
        return "got is all zeros → the output buffer was never filled (result not copied back?)"
    if np.any(exp) and _same(got, -exp):
        return "got is -expected → a sign flip (e.g. p += lr * grad instead of p -= lr * grad)"
    if got.ndim == 2 and got.shape[0] == got.shape[1] and _same(got, exp.T) and not _same(exp, exp.T):
        return "got is the transpose of expected → rows and columns swapped"
    nz = exp != 0
    # One constant ratio is evidence of a scale factor only over several elements: any single wrong number
    # has "a ratio" to the right one, and calling that a scale factor would name a cause nothing showed.
    if nz.sum() >= 2 and np.all(np.isfinite(got)):
        ratio = got[nz] / exp[nz]
        if np.allclose(ratio, ratio.flat[0], rtol=1e-4) and not np.isclose(ratio.flat[0], 1) \
                and _same(got[~nz], np.zeros_like(got[~nz])):
            return f"got is {_fmt(float(ratio.flat[0]))}× expected everywhere → a wrong scale factor"
    return None


def _shape_hint(got: np.ndarray, exp: np.ndarray) -> str:
    if got.size and exp.size % got.size == 0 and got.size < exp.size:
        k = exp.size // got.size
        return (f"got has 1/{k} of the elements → looks like one rank's shard; all-gather it first "
                "(or compare with the matching slice of expected)")
    if got.size > exp.size and _same(got.ravel()[: exp.size], exp.ravel()):
        return f"got has {got.size - exp.size} extra trailing element(s) → strip the padding: x[:numel]"
    if got.shape == exp.shape[::-1]:
        return "the shape is reversed → transposed?"
    if got.size == exp.size:
        return "same number of elements, different shape → a missing reshape/view"
    return ""


# ------------------------------------------------------------------- how a value was made, not what it is
def shares_memory(a: Any, b: Any) -> bool:
    """True if torch tensors ``a`` and ``b`` overlap in memory (a view of the other, or both views of one storage
    whose byte ranges meet): a later in-place write to one changes the other."""
    import torch
    if not all(isinstance(t, torch.Tensor) and t.numel() for t in (a, b)) or a.device != b.device \
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    span = lambda t: [(t.storage_offset() + sum(f(0, (n - 1) * s) for n, s in zip(t.shape, t.stride()))  # noqa: E731
                       + (k == 1)) * t.element_size() - k for k, f in ((0, min), (1, max))]   # [first, last] byte
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 <= b1 and b0 <= a1


def untiled_collective(exc: BaseException) -> str | None:
    """The flag a JAX collective was called without, when that is why it raised (JAX's ValueError names sizes)."""
    m = __import__("re").search(r"reduce_scatter operand scatter dimension size (\d+) must match shard count (\d+)", str(exc))
    return None if m is None else (
        f"psum_scatter was called without tiled=True: untiled, it needs the scatter dimension's size ({m[1]}) to "
        f"equal the device count ({m[2]}) and removes that dimension; tiled=True cuts it into {m[2]} blocks and "
        "keeps one (scatter_dimension= says which dimension to cut)")


# ---------------------------------------------------------------------------------- comparison
def _leaves(got, exp, path: str, out: list, problems: list) -> None:
    """Pair up leaves of two pytrees (dicts by key, lists/tuples by index)."""
    if isinstance(exp, Mapping) or isinstance(got, Mapping):
        if not (isinstance(exp, Mapping) and isinstance(got, Mapping)):
            problems.append(f"{path}: got a {type(got).__name__}, expected a {type(exp).__name__}")
            return
        missing, extra = [k for k in exp if k not in got], [k for k in got if k not in exp]
        if missing or extra:
            problems.append(f"{path}: keys differ; missing {missing}, unexpected {extra}")
        for k in exp:
            if k in got:
                _leaves(got[k], exp[k], f"{path}[{k!r}]", out, problems)
    elif isinstance(exp, (list, tuple)) and not _is_leaf_list(exp):
        if not isinstance(got, (list, tuple)) or len(got) != len(exp):
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            problems.append(f"{path}: got {n} item(s), expected {len(exp)}")
            return
        for i, (g, e) in enumerate(zip(got, exp)):
            _leaves(g, e, f"{path}[{i}]", out, problems)
    else:
        out.append((path, got, exp))


def _compare_leaf(path, got, exp, rtol, atol, detectors, check_dtype) -> tuple[str | None, str]:
    """(failure text or None, summary) for one leaf."""
    g, gd = _to_numpy(got, path)
    e, ed = _to_numpy(exp, path)
    if g.shape != e.shape:
        hint = _shape_hint(g, e)
        return (f"{path}: shape mismatch: got {tuple(g.shape)}, expected {tuple(e.shape)}"
                + (f"\n   likely mistake: {hint}" if hint else "")), ""
    if check_dtype and gd != ed:
        return f"{path}: dtype mismatch: got {gd}, expected {ed} (a missing cast back?)", ""
    g64, e64 = g.astype(np.float64), e.astype(np.float64)
    diff = np.abs(g64 - e64)
    both_nan = np.isnan(g64) & np.isnan(e64)
    tol = atol + rtol * np.abs(e64)
    bad = ~((diff <= tol) | both_nan)
    rel = diff / np.maximum(np.abs(e64), np.finfo(np.float64).tiny)
    max_abs = float(np.nanmax(np.where(both_nan, 0, diff), initial=0))
    max_rel = float(np.nanmax(np.where(both_nan, 0, rel), initial=0))
    if not bad.any():
        # Say what was asserted, never the rounding noise itself: its size depends on the BLAS kernel,
        # the thread count and the reduction order, so it differs between machines and runs.
        if rtol == 0 and atol == 0:
            what = f"got {_fmt(g64.flat[0])}, exactly as expected" if g.size == 1 else f"{g.size:,} elements, exactly equal"
        else:
            what = ("matches" if g.size == 1 else f"{g.size:,} elements match") + f" within rtol={rtol:g}, atol={atol:g}"
        return None, what
    excess = np.where(bad, np.nan_to_num(diff - tol, nan=np.inf), -np.inf)
    idx = np.unravel_index(int(np.argmax(excess)), g.shape)
    at = "" if g.ndim == 0 else f" at index {list(map(int, idx))}"
    lines = [f"{path}: {int(bad.sum()):,} of {g.size:,} element(s) differ beyond rtol={rtol:g}, atol={atol:g}",
             f"   worst{at}: expected {_fmt(e64[idx])}, got {_fmt(g64[idx])} "
             f"(abs err {_fmt(diff[idx])}, rel err {_fmt(rel[idx])})",
             f"   max abs err {_fmt(max_abs)}, max rel err {_fmt(max_rel)}; shape {tuple(g.shape)}; "
             f"dtype got {gd}, expected {ed}"]
    low = gd != ed and gd in ("bfloat16", "float16") and bool(np.allclose(g64, e64, rtol=2e-2, atol=1e-2))
    for det in [*detectors, _generic] if not low else []:
        found = det(g64, e64)
        if found:
            lines.append(f"   likely mistake: {found}")
            break
    if low:
        lines.append(f"   likely mistake: got is {gd} where the reference is {ed}, and equal to its rounding → a cast lost precision (astype / dtype=): keep {ed}")  # noqa: E501
    return "\n".join(lines), ""


def assert_close(name: str, got: Any, expected: Any, *, rtol: float, atol: float,
                 rank: int | None = None, hint: str | Detector | Sequence[str | Detector] | None = None,
                 check_dtype: bool = False) -> bool:
    """Raise :class:`CheckFailed` unless ``got`` is close to ``expected``, element by element.

    ``got``/``expected``: numpy, torch or JAX arrays, scalars, or lists/dicts of them (matched by
    index/key). ``rank`` says whose value this is. ``hint``: a string (always shown) and/or
    detectors (shown when they recognise the mistake). Outside a :class:`check` block, prints
    ``✅ name: ...`` on success. Returns True.
    """
    hints = [] if hint is None else [hint] if isinstance(hint, str) or callable(hint) else list(hint)
    detectors = [h for h in hints if callable(h)]
    texts = [h for h in hints if isinstance(h, str)]
    label = name + (f" (rank {rank})" if rank is not None else "")
    leaves, problems = [], []
    _leaves(got, expected, label, leaves, problems)
    summaries = []
    for path, g, e in leaves:
        failure, summary = _compare_leaf(path, g, e, rtol, atol, detectors, check_dtype)
        (problems.append(failure) if failure else summaries.append(summary))
    if problems:
        if len(problems) == 1:
            msg = "❌ " + problems[0]
        else:   # a pytree: the first few in full, then just where
            shown = "\n".join(problems[:3])
            rest = [p.split(": ", 1)[0] for p in problems[3:]]
            msg = (f"❌ {label}: {len(problems)} problem(s)\n{shown}"
                   + (f"\nalso wrong: {', '.join(rest)}" if rest else ""))
        raise CheckFailed(msg + "".join(f"\n   hint: {t}" for t in texts))
    summary = summaries[0] if len(summaries) == 1 else (f"{len(summaries)} leaves, exactly equal" if rtol == 0 and atol == 0
                                                              else f"{len(summaries)} leaves match within rtol={rtol:g}, atol={atol:g}")
    active = current()
    if active is not None:
        active.detail = active.detail or summary
    else:
        print(f"✅ {label}: {summary}")
    return True


def parity_check(name: str, got: Any, reference: Any, kind: str = "fp32", *,
                 rtol: float | None = None, atol: float | None = None, rank: int | None = None,
                 hint: str | Detector | Sequence[str | Detector] | None = None) -> bool:
    """Every lab's last check: ``got`` against a single-device ``reference`` with
    ``TOLERANCES[kind]`` (``rtol``/``atol`` override one of them, with a reason in the lab)."""
    if kind not in TOLERANCES:
        raise ValueError(f"kind={kind!r}; expected one of {sorted(TOLERANCES)}")
    tol = {**TOLERANCES[kind], **{k: v for k, v in (("rtol", rtol), ("atol", atol)) if v is not None}}
    return assert_close(name, got, reference, rank=rank, hint=hint, **tol)
