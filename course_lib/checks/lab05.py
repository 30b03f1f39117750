"""Lab 05's exercise checks: the FSDP sharding rule and the all-gather / psum-scatter pair in JAX.

Each check is split (:mod:`course_lib.checks.judge`): the *run half* calls the learner's function(s) on inputs the
check chooses and returns what came out as plain data -- a PartitionSpec as its entries (tuples of axis names and
None), per-device shapes, the collectives in the traced programs, the gathered weights and gradient shards as
arrays -- and the *judge half* (``judge_fsdp_spec``, ``judge_gather_pair``) rebuilds the inputs, computes the
expected values itself (the reference rule; the single-device gradient) and names the likely mistake. The mesh
reaches the judge as plain parameters: its shape and axis names, by default the lab's ``(8,)`` and ``("fsdp",)``.

Longer than ~300 lines: two exercise checks, each with its run half (the shard_map harness that reads shapes,
collectives and values) and its judge half with the diagnoses of its classic mistakes; and the run / judge helpers
Lab 06's checks share (a PartitionSpec as plain data; cases run in order, a crash worded by the judge in its turn).
"""
from __future__ import annotations

import numpy as np

from course_lib import checks
from course_lib.strategies.fsdp.jax import AXIS, MIN_SIZE, gather_vjp
from course_lib.checks import plain as _plain
from course_lib.checks.compare import untiled_collective
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "check_spec_rule", "check_gather_pair", "judge_fsdp_spec", "judge_gather_pair", "spec_plain",
           "spec_text", "run_cases", "case_result", "crash_record", "raise_crash"]

#: Layered hints, general to specific (``checks.hint(name, level)``); the last level is near-code.
HINTS = {
    "fsdp_spec": [
        "Decide from the shape alone: small arrays are not worth a collective; a large one is cut along one "
        "dimension that the number of devices divides evenly (NamedSharding does not pad).",
        "Below min_size elements (size >= min_size is large): replicate. Otherwise try dim 0 first (what "
        "FSDP2's Shard(0) does); if n does not divide it, the largest other dimension n divides; if none "
        "does, replicate.",
        "if math.prod(shape) < min_size: return P(); for d in [0] + the other dims sorted by size, largest "
        "first: if shape[d] % n == 0: return P(*[None] * d, 'fsdp'); return P()",
    ],
    "gather_pair": [
        "Forward: every device holds one block of the weight and needs all of it. Backward: the transpose "
        "of that — every device holds a gradient of the WHOLE weight (from its own rows of the batch) and "
        "must end with its own block of the sum over devices.",
        "One collective each, over the axis 'fsdp', along dimension `dim`, tiled (concatenate the blocks, "
        "do not stack them). No ÷N in the backward: the loss each device returns is already its local "
        "mean ÷ N, so the sum over devices is the global mean.",
        "forward: jax.lax.all_gather(w_shard, 'fsdp', axis=dim, tiled=True); backward: "
        "jax.lax.psum_scatter(g_full, 'fsdp', scatter_dimension=dim, tiled=True)",
    ],
}

TESTS = {
    "fsdp_spec": "11 shapes, some over 2, 4 and 8 devices: kernels, biases, a size exactly at min_size, "
                 "dimensions 8 does not divide, 3-D (the largest dimension that divides is not the last), a scalar, "
                 "and selective sharding with min_size=32768; the PartitionSpec each one gets",
    "gather_pair": "under jax.shard_map on 8 devices: the forward's per-device shape and values (the full "
                   "weight on every device), the backward's per-device shape (one shard), both along dim 0 and "
                   "dim 1, the gradient shards against the single-device gradient of the same mean loss, and "
                   "the collectives in the program (one all-gather, one reduce-scatter)",
}


# -- exercise checks -----------------------------------------------------------------------------------
def _norm(spec) -> tuple:  # P("fsdp", None) == P("fsdp"): trailing Nones say nothing
    t = tuple(spec)
    return t[:max([i + 1 for i, a in enumerate(t) if a is not None], default=0)]


_SPEC_CASES = [  # (shape, n, min_size, expected tuple, what it tests)
    ((64, 192), 8, MIN_SIZE, (AXIS,), "a kernel: cut dim 0"),
    ((64,), 8, MIN_SIZE, (), "a bias: replicated, below the threshold"),
    ((16, 64), 8, MIN_SIZE, (AXIS,), "exactly MIN_SIZE elements: sharded (size >= min_size)"),
    ((30, 64), 8, MIN_SIZE, (None, AXIS), "dim 0 (30) does not divide by 8: cut dim 1"),
    ((66, 198), 8, MIN_SIZE, (), "no dimension divides by 8: replicate"),
    ((66, 198), 2, MIN_SIZE, (AXIS,), "the same kernel over 2 devices: dim 0 divides"),
    ((12, 40, 96), 8, MIN_SIZE, (None, None, AXIS), "3-D, dim 0 does not divide: the largest that does"),
    ((4096,), 8, MIN_SIZE, (AXIS,), "a big 1-D parameter is sharded too"),
    ((), 8, MIN_SIZE, (), "a scalar"),
    ((64, 512), 8, 32768, (AXIS,), "selective: a 32768-element table passes min_size=32768"),
    ((64, 256), 8, 32768, (), "selective: a 16384-element kernel stays replicated"),
    ((12, 96, 40), 8, MIN_SIZE, (None, AXIS), "3-D: dims 1 and 2 both divide, dim 1 is the larger"),
    ((30, 64), 2, MIN_SIZE, (AXIS,), "the same kernel over 2 devices: dim 0 divides"),
    ((12, 40, 96), 4, MIN_SIZE, (AXIS,), "the same 3-D shape over 4 devices: dim 0 divides"),
]
_SPEC_INPUTS = [(shape, n, min_size) for shape, n, min_size, *_ in _SPEC_CASES]   # what the run half asks


def _spec_mistake(shape, n, min_size, got, want) -> str | None:
    """What differs between ``got`` and ``want`` (normalised tuples), said as the likely mistake."""
    import math

    from course_lib.strategies.fsdp.jax import fsdp_spec
    size = math.prod(shape)
    ref = lambda **kw: _norm(fsdp_spec(shape, kw.get("n", n), min_size=kw.get("min_size", min_size)))  # noqa: E731
    cut = [d for d, a in enumerate(got) if a is not None]
    if min_size != MIN_SIZE and got == ref(min_size=MIN_SIZE) != want:
        return (f"that is the answer for the default min_size={MIN_SIZE}: use the argument `min_size` (selective "
                "sharding passes a larger one)")
    if got and size < min_size:
        return f"{size} elements is below the threshold min_size={min_size}: replicate it, P()"
    if not got and want and size == min_size:
        return f"exactly min_size={min_size} elements counts as large: shard it (size >= min_size, not >)"
    if cut and (len(cut) > 1 or cut[0] >= len(shape) or shape[cut[0]] % n):
        d = cut[0]
        return (f"dim {d} ({shape[d] if d < len(shape) else '?'}) does not divide by n={n}, and NamedSharding does "
                "not pad: cut a dimension that n divides, or replicate")
    if n != 8 and got == ref(n=8) != want:
        return f"that is the answer for 8 devices, not n={n}: use the argument `n`"
    d_want = next((d for d, a in enumerate(want) if a is not None), None)
    if not got and d_want is not None:
        return (f"dim {d_want} ({shape[d_want]}) divides by n={n}: try the other dimensions when dim 0 does not "
                "(the largest first) before replicating")
    if cut and d_want is not None and cut[0] != d_want:
        if d_want == 0:
            return f"dim 0 ({shape[0]}) divides by n={n}: cut dim 0 first (FSDP2's Shard(0)), whatever the others"
        return (f"dims {cut[0]} ({shape[cut[0]]}) and {d_want} ({shape[d_want]}) both divide by n={n}: cut "
                "the largest other dimension that divides")
    return None


def spec_plain(got) -> dict:
    """Run half: what a learner's function returned for a PartitionSpec, as plain data, read without calling a
    method of theirs: ``{"spec": entries}`` (each None, an axis name or a tuple of them; ``"unreduced"`` /
    ``"reduced"`` only when set) for a ``jax.P`` (JAX forbids subclasses: an object merely claiming to be one is
    not), else ``{"other": the plain value, "type": its type's name}``."""
    from jax.sharding import PartitionSpec
    if type(got) is not PartitionSpec:
        out = {"other": _plain.plain(got), "type": type(got).__name__}
        if type(got) is np.ndarray:               # NumPy's own repr (an array of axis names is not plain data)
            out["repr"] = np.array_repr(got)[:300]
        return out
    out = {"spec": _plain.plain(tuple(got.partitions))}
    for k in ("unreduced", "reduced"):
        if getattr(got, k):
            out[k] = sorted(str(a) for a in getattr(got, k))
    return out


def spec_text(d: dict) -> str:
    """Judge half: the spec in ``d`` (from :func:`spec_plain`) as JAX prints it, ``P('fsdp', None)``."""
    from jax.sharding import PartitionSpec
    try:
        return str(PartitionSpec(*d["spec"], unreduced=set(d.get("unreduced", ())), reduced=set(d.get("reduced", ()))))
    except Exception:  # noqa: BLE001 - entries JAX refuses: show them as they came
        return f"P{tuple(d['spec'])!r}"


def spec_shown(d) -> str:
    """Judge half: a returned value that is not a PartitionSpec, for the ❌ line (its repr when it is plain)."""
    other = d.get("other") if isinstance(d, dict) else d
    if isinstance(other, dict) and _plain.UNPLAIN in other:
        return str(d["repr"]) if isinstance(d.get("repr"), str) else f"a {d.get('type', other[_plain.UNPLAIN])}"
    return repr(other)


def crash_record(exc: BaseException) -> dict:
    """Run half: a crash in the learner's code on one case, as plain data; its traceback kept behind the ❌ line
    (``checks.last_error()``). The judge words it (:func:`raise_crash`) when it reaches that case, in order."""
    import traceback

    from course_lib.checks.core import keep_error, learner_line
    text = "".join(traceback.format_exception(exc))
    keep_error(text)
    return {"crash": {"kind": type(exc).__name__, "msg": str(exc).strip(), "line": learner_line(text)}}


def raise_crash(record: dict) -> None:
    """Judge half: raise the ❌ text :class:`~course_lib.checks.core.check` gives a crash, from :func:`crash_record`."""
    from course_lib.checks.core import crash_text
    c = record["crash"] if isinstance(record.get("crash"), dict) else {}
    kind, msg, line = str(c.get("kind", "an exception")), str(c.get("msg", "")).splitlines(), str(c.get("line") or "")
    raise AssertionError(crash_text(kind, msg, line))


def run_cases(call, cases, record: tuple = ()) -> list:
    """Run half: ``call(case)`` for each case in order, as ``{"got": ...}``. A crash in the first case propagates
    (check() words it, on the rank's line); in a later one it becomes :func:`crash_record` and ends the run (the
    judge decides whether an earlier case was already wrong); a stub's NotImplementedError propagates; an exception
    of a type in ``record`` (a refusal the exercise asks for) is kept as ``{"raised": type name, "msg": its text}``
    and the run goes on."""
    out = []
    for case in cases:
        try:
            out.append({"got": call(case)})
        except NotImplementedError:
            raise
        except record as exc:
            out.append({"raised": type(exc).__name__, "msg": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the learner's crash, worded by the judge in its turn
            if not out:
                raise
            out.append(crash_record(exc))
            break
    return out


def case_result(entries, i: int, what: str):
    """Judge half: case ``i``'s entry of :func:`run_cases` data (a crash raised as the check words one)."""
    if not isinstance(entries, list) or i >= len(entries) or not isinstance(entries[i], dict):
        raise AssertionError(f"{what} was not run on every case; return a value for each")
    if "crash" in entries[i]:
        raise_crash(entries[i])
    return entries[i]


def run_fsdp_spec(fn) -> dict:
    """Run half: the learner's spec for each (shape, n, min_size), as plain data (no expected spec here)."""
    return {"got": run_cases(lambda c: spec_plain(fn(c[0], c[1], min_size=c[2])), _SPEC_INPUTS)}


def judge_fsdp_spec(data: dict, name: str = "fsdp_spec") -> str:
    """Judge half: each spec against the reference rule (normalised: trailing Nones say nothing), the likely
    mistake named."""
    gots = data.get("got") if isinstance(data, dict) else None
    for i, (shape, n, min_size, want, why) in enumerate(_SPEC_CASES):
        d = case_result(gots, i, name)["got"]
        if not isinstance(d, dict) or not isinstance(d.get("spec"), (tuple, list)):
            raise AssertionError(f"{name}({shape}, n={n}) returned {spec_shown(d)}; return a PartitionSpec, "
                                 "e.g. P('fsdp')")
        got = _norm(d["spec"])
        if got != want or d.get("unreduced") or d.get("reduced"):
            likely = _spec_mistake(shape, n, min_size, got, want)
            raise AssertionError(f"{name}({shape}, n={n}, min_size={min_size}) = {spec_text(d)}, want P{want!r}"
                                 + (f"\n   likely mistake: {likely}" if likely else f": {why}"))
    return f"{len({shape for shape, *_ in _SPEC_CASES})} shapes placed like the reference rule"


@exercise("05", 'fsdp_spec', cell='def my_fsdp_spec(', hints=HINTS['fsdp_spec'], tests=TESTS['fsdp_spec'],
          mistakes={'cut that does not divide': 'does not divide', 'no threshold': 'below the threshold',
                    'strict threshold': 'size >= min_size, not >', 'n ignored': 'use the argument `n`',
                    'min_size ignored': 'use the argument `min_size`', 'dim 0 only': 'try the other dimensions',
                    'not the largest': 'the largest other dimension that divides',
                    'not dim 0 first': 'cut dim 0 first', 'not a PartitionSpec': 'return a PartitionSpec'},
          guards=("argument", "boundary"), judge=judge_fsdp_spec,
          references=("course_lib.strategies.fsdp.jax.fsdp_spec",))
def check_spec_rule(fn, name: str = "fsdp_spec") -> bool:
    """Exercise check: ``fn(shape, n, min_size=...)`` returns the PartitionSpec :func:`fsdp_spec` gives."""
    fn = _guard(fn, "05", "fsdp_spec")
    return decide(name, lab="05", tests=TESTS["fsdp_spec"], run=lambda: run_fsdp_spec(fn), judge=judge_fsdp_spec,
                  params={"name": name})


def _per_device(fwd, bwd, mesh, full, shard, dim):
    """``fwd`` (one device's shard -> ?) and ``bwd`` (one device's full-size cotangent -> ?) under shard_map, as
    functions of every device's input stacked on a leading axis."""
    import jax
    from jax.sharding import PartitionSpec as P
    f = jax.shard_map(lambda ws: fwd(ws[0], dim)[None], mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    b = jax.shard_map(lambda g: bwd(g[0], dim)[None], mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    n = mesh.shape[AXIS]
    return f, b, jax.ShapeDtypeStruct((n, *shard), np.float32), jax.ShapeDtypeStruct((n, *full), np.float32)


def _per_device_shapes(fwd, bwd, mesh, full, shard, dim=0):
    """The shapes one device gets from ``fwd`` (its shard -> ?) and ``bwd`` (a full-size cotangent -> ?)."""
    import jax
    f, b, fin, bin_ = _per_device(fwd, bwd, mesh, full, shard, dim)
    return tuple(jax.eval_shape(f, fin).shape[1:]), tuple(jax.eval_shape(b, bin_).shape[1:])


#: The collectives a jaxpr can hold (``pvary`` and ``axis_index`` move nothing).
_COLLECTIVES = ("all_gather", "reduce_scatter", "psum", "psum_invariant", "psum2", "pmax", "pmin", "ppermute",
                "all_to_all", "pbroadcast")


def _collectives(fn, arg) -> list[str]:
    """The collectives in the program ``fn(arg)`` traces to, in order."""
    import re

    import jax
    text = str(jax.make_jaxpr(fn)(arg))
    return [op.replace("psum_invariant", "psum").replace("psum2", "psum")
            for op in re.findall(r"= (\w+)\[", text) if op in _COLLECTIVES]


def _forward_cost_mistake(ops: list) -> str | None:
    """The forward must be one all-gather: anything else costs more, and may change the gradient too."""
    if ops == ["all_gather"]:
        return None
    if any(op.startswith("psum") for op in ops) and "all_gather" not in ops:
        why = ("forward summed (psum) a zero-filled full buffer holding the shard: 2× the bytes of an all_gather "
               "for the same weight, and its result is replicated, so JAX sums its cotangent over the devices "
               "once more (the gradient comes out N× too large)")
    else:
        why = "one all_gather, tiled along `dim`, and nothing else"
    return (f"the forward runs {ops or 'no collective'}; FSDP's forward is one all_gather\n"
            f"   likely mistake: {why}")


def _backward_cost_mistake(ops: list) -> str | None:
    """Right values; are they computed by one reduce-scatter?"""
    if ops == ["reduce_scatter"]:
        return None
    if any(op.startswith("psum") for op in ops) and "reduce_scatter" not in ops:
        why = ("backward all-reduced the whole gradient (psum) and kept a slice: that moves 2× the bytes of a "
               "psum_scatter, and every device holds the whole summed gradient")
    else:
        why = "one psum_scatter, tiled along `dim`, and nothing else"
    return (f"the values are right, but the backward runs {ops or 'no collective'}; FSDP's backward is one "
            f"reduce_scatter (psum_scatter)\n   likely mistake: {why}")


def _shape_mistake(fs, bs, full, shard, n, dim=0, bwd_ops=()) -> str | None:
    if dim and fs != full and len(fs) == len(full) and fs[0] == n * shard[0] and fs[1:] == shard[1:]:
        return (f"with dim={dim} one device got shape {fs} from its shard {shard}, the blocks joined along dim 0; "
                f"the full weight is {full}\n   likely mistake: use the argument `dim` (the weight is cut along "
                "`dim`; gather along it)")
    if dim and fs == full and len(bs) == len(shard) and bs[0] == full[0] // n and bs[1:] == full[1:]:
        return (f"with dim={dim} the backward gave shape {bs}, scattered along dim 0; the shard is {shard}\n"
                "   likely mistake: use the argument `dim` (scatter along the dimension the weight is cut on)")
    if fs != full:
        if fs == (n, *shard):
            why = "the blocks were stacked on a new axis: tiled=True concatenates them along `dim`"
        elif sorted(fs) != sorted(full) and len(fs) == len(full) and fs[0] == shard[0]:
            why = "gathered along the wrong dimension: the weight is cut along `dim`, gather along `dim`"
        else:
            why = "one all-gather over 'fsdp' along `dim`, tiled"
        return (f"forward: one device got shape {fs} from its shard {shard}; the full weight is {full}\n"
                f"   likely mistake: {why}")
    if bs != shard:
        if bs == full and not bwd_ops:
            why = ("it returns the full gradient unchanged: the backward runs no collective, but a device must "
                   "end with its own block of the SUM over devices: one collective that sums AND keeps one block")
        elif bs == full:
            why = (f"it returns the full gradient's shape ({', '.join(bwd_ops)}): psum sums but does not scatter, "
                   "every device keeps the whole sum; use the collective that sums AND keeps one block")
        elif len(bs) == len(shard) and bs[0] == full[0]:
            why = "scattered along the wrong dimension: scatter along `dim`, the one the weight is cut on"
        else:
            why = "the backward's output must have the shard's shape (the transpose of the forward)"
        return (f"backward: one device turned a full-size gradient {full} into shape {bs}; its shard is {shard}\n"
                f"   likely mistake: {why}")
    return None


def _divided_in_backward(n: int):
    def detect(got, exp):
        if np.any(exp != 0) and np.allclose(got, exp / n, rtol=1e-4, atol=1e-7):
            return (f"got is the gradient ÷{n}: your backward divides by N, but here the loss already carries "
                    "the ÷N (each device returns its local mean ÷ N, so the SUM over devices is the global mean). "
                    "Lab 03's torch Unshard divided in the backward because its loss was not divided; doing "
                    "both divides twice")
    return detect


def _pair_inputs(n: int):
    """The weight (a kernel, cut by rows) and the batch (cut by rows) the gather-pair check uses on ``n`` devices."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8 * n, 24)).astype(np.float32)
    x = rng.standard_normal((4 * n, 8 * n)).astype(np.float32)
    return w, x


def _ref_loss(w, x):
    import jax
    return jax.numpy.mean(jax.numpy.tanh(x @ w) ** 2)


def _wire_array(a):
    """An array's numbers as plain data; a dtype NumPy does not know (bfloat16) travels by name beside float32 values."""
    arr = np.asarray(a)
    return arr if arr.dtype.kind in "biufc" else {"dtype": str(arr.dtype), "values": arr.astype(np.float32)}


def _unwire_array(v):
    """Judge half: :func:`_wire_array`'s data as an array of its own dtype again (bfloat16 from ml_dtypes)."""
    if isinstance(v, dict) and set(v) == {"dtype", "values"}:
        import ml_dtypes
        dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(v["dtype"])
        return np.asarray(v["values"]).astype(dt) if dt is not None else np.asarray(v["values"])
    return v


def run_gather_pair(fwd, bwd, mesh) -> dict:
    """Run half: under shard_map on ``mesh``, the per-device shapes ``fwd``/``bwd`` give (dim 0, then dim 1), the
    collectives their programs hold, and -- when the shapes are those of the inputs, so that a step can run --
    every device's gathered weight and gradient shard through ``gather_vjp(fwd, bwd)``. No expected value here."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    n = mesh.shape[AXIS]
    w, x = _pair_inputs(n)
    full1, shard1 = (16, 8 * n), (16, 8)                             # a weight cut along dim 1
    # a crash in the answer (an axis or argument JAX refuses) propagates: check() names its line and likely cause
    try:
        fs, bs = _per_device_shapes(fwd, bwd, mesh, w.shape, (8, 24))
    except ValueError as e:                   # JAX names the sizes; the judge names the flag
        if untiled_collective(e) is None:
            raise
        return {"raised": {"type": type(e).__name__, "text": str(e)}}
    f, b, fin, bin_ = _per_device(fwd, bwd, mesh, w.shape, (8, 24), 0)
    out = {"dim0": {"fwd": fs, "bwd": bs}, "ops": {"fwd": _collectives(f, fin), "bwd": _collectives(b, bin_)}}
    if (fs, bs) != (w.shape, (8, 24)):        # not the inputs' shapes: nothing further can run
        return out
    fs1, bs1 = _per_device_shapes(fwd, bwd, mesh, full1, shard1, dim=1)
    out["dim1"] = {"fwd": fs1, "bwd": bs1}
    gather = gather_vjp(fwd, bwd)

    def per_device(ws, xs):
        full = gather(ws, 0)
        return jax.grad(lambda s: _ref_loss(gather(s, 0), xs) / n)(ws), full[None]
    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS))))
    grad, fulls = f(*(jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (w, x)))   # a crash: check() words it
    out["fulls"], out["grad"] = _wire_array(fulls), _wire_array(grad)
    return out


def _shape(v) -> tuple:
    if not isinstance(v, (tuple, list)):
        raise AssertionError(f"a per-device shape came back as {v!r}: the functions must return arrays")
    return tuple(int(d) for d in v)


def judge_gather_pair(data: dict, mesh_shape: tuple = (8,), axis_names: tuple = (AXIS,)) -> str:
    """Judge half: the shapes, then the forward's collectives, then the values against the single-device gradient
    of the same mean loss (computed here), then the backward's collectives. ``mesh_shape``/``axis_names``: the
    mesh the run half used (the lab's: 8 devices on one axis "fsdp")."""
    import jax
    sizes = dict(zip(tuple(axis_names), tuple(mesh_shape)))
    if AXIS not in sizes:
        raise AssertionError(f"the mesh has no axis {AXIS!r} (axes {tuple(axis_names)})")
    n = int(sizes[AXIS])
    w, x = _pair_inputs(n)
    full1, shard1 = (16, 8 * n), (16, 8)
    if not isinstance(data, dict):
        raise AssertionError("the gather pair gave no result")
    if "raised" in data:
        e = data["raised"]
        text = str(e.get("text", ""))
        first = text.splitlines()[0] if text.strip() else ""
        raise AssertionError(f"backward: raised {e.get('type')}: {first}\n   likely mistake: "
                             f"{untiled_collective(ValueError(text))}")
    fs, bs = _shape(data["dim0"]["fwd"]), _shape(data["dim0"]["bwd"])
    fwd_ops, bwd_ops = list(data["ops"]["fwd"]), list(data["ops"]["bwd"])
    wrong = _shape_mistake(fs, bs, w.shape, (8, 24), n, bwd_ops=bwd_ops)
    if not wrong:
        fs1, bs1 = _shape(data["dim1"]["fwd"]), _shape(data["dim1"]["bwd"])
        wrong = _shape_mistake(fs1, bs1, full1, shard1, n, dim=1)
    if wrong:
        raise AssertionError(wrong)
    wrong = _forward_cost_mistake(fwd_ops)
    if wrong:
        raise AssertionError(wrong)
    grad_fn = jax.jit(jax.grad(_ref_loss))
    ref = np.asarray(grad_fn(w, x))                                  # a backward that slices, not sums, gives:
    local = np.concatenate([np.asarray(grad_fn(w, xd))[8 * d:8 * d + 8] / n for d, xd in enumerate(np.split(x, n))])

    def no_sum(got, exp):
        if np.allclose(got, local, rtol=1e-4, atol=1e-7):
            return "got is each device's slice of its OWN gradient: the sum over devices is missing (psum_scatter)"
    checks.assert_close("forward: the gathered weight on every device", _unwire_array(data["fulls"]),
                        np.broadcast_to(w, (n, *w.shape)), rtol=0, atol=0, hint=checks.wrong_shard_offset(n, 1))
    checks.assert_close("backward: the gradient shards", _unwire_array(data["grad"]), ref, rtol=1e-5, atol=1e-7,
                        hint=[_divided_in_backward(n), no_sum, checks.summed_not_averaged(n),
                              checks.wrong_shard_offset(n)])
    wrong = _backward_cost_mistake(bwd_ops)
    if wrong:
        raise AssertionError(wrong)
    return (f"all {n} devices see the full weight; gradient shards (one per device, shape (8, 24)) equal the "
            "single-device gradient")


@exercise("05", 'gather_pair', cell='def gather_weight(', hints=HINTS['gather_pair'], tests=TESTS['gather_pair'],
          mistakes={'psum instead of psum_scatter': 'psum sums but does not scatter',
                    'psum then slice': '2× the bytes of a psum_scatter', 'psum as a gather': '2× the bytes of an all_gather',
                    'dim ignored': 'use the argument `dim`', 'untiled gather': 'tiled=True concatenates',
                    'untiled scatter': 'psum_scatter was called without tiled=True',
                    'dtype changed': 'where the reference is',
                    'gathered on the wrong dim': 'gathered along the wrong dimension',
                    'scattered on the wrong dim': 'scattered along the wrong dimension',
                    'divided in the backward': 'the loss already carries the ÷N',
                    'no sum': 'sum over devices is missing', 'no collective in backward': 'the backward runs no collective'},
          guards=("argument", "cost"), judge=judge_gather_pair,
          references=("course_lib.strategies.fsdp.jax.all_gather_shard",
                      "course_lib.strategies.fsdp.jax.psum_scatter_grad"))
def check_gather_pair(fwd, bwd, mesh, name: str = "gather_pair") -> bool:
    """Exercise check: ``gather_vjp(fwd, bwd)`` under shard_map gives every device the full weight, and
    the gradient shards of the global mean loss (what one device computes with the whole batch)."""
    fwd, bwd = _guard(fwd, "05", "gather_pair"), _guard(bwd, "05", "gather_pair")
    params = {"mesh_shape": tuple(int(v) for v in mesh.shape.values()),
              "axis_names": tuple(str(a) for a in mesh.axis_names)}
    return decide(name, lab="05", tests=TESTS["gather_pair"], run=lambda: run_gather_pair(fwd, bwd, mesh),
                  judge=judge_gather_pair, params=params)
