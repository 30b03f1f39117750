"""Lab 07's Orbax exercise, ``restore_target``, in two halves (:mod:`course_lib.checks.judge`).

* run half (:func:`run_restore_target`): a small state saved on 8 devices by the FSDP rule; per new mesh (4, then
  1 devices) the learner's target described as plain facts -- its type and keys, per array its kind
  (ShapeDtypeStruct, jax.Array...), shape, dtype and sharding (type, device count, spec, whether it is the saved
  array's own, whether it lies on the mesh given) -- and the values Orbax restored into it;
* judge half (:func:`judge_restore_target`): each leaf against the FSDP rule for that mesh (a fixed or the saved
  device count, a replicated array, a concrete target named), then the restored values against the saved ones,
  rebuilt here from the same seed.
"""
from __future__ import annotations

import tempfile

import numpy as np

from course_lib.checks import plain as _plain
from course_lib.checks.lab07_crash import answer_of, crash_info, crash_message, filled, learner_files
from course_lib.checks.lab07_judge import same_array

__all__ = ["restore_inputs", "run_restore_target", "judge_restore_target"]


def restore_inputs() -> dict:
    """The state the restore_target check saves (on 8 devices, by the FSDP rule), as NumPy arrays."""
    rng = np.random.default_rng(7)
    return {"w": rng.standard_normal((64, 48)).astype(np.float32),    # dim 0 cut over 8, 4, 1
            "emb": rng.standard_normal((67, 40)).astype(np.float32),  # 67 rows do not divide: dim 1 cut
            "m": rng.standard_normal((36, 40)).astype(np.float32),    # 36 rows: dim 1 over 8, dim 0 over 4
            "b": rng.standard_normal((48,)).astype(np.float32), "count": np.int32(5)}   # small: replicated


def _norm(spec) -> tuple:
    """A PartitionSpec (or its plain tuple) without trailing Nones: P('fsdp', None) == P('fsdp')."""
    t = () if spec is None or isinstance(spec, (dict, str)) else tuple(spec)
    return t[:max([i + 1 for i, a in enumerate(t) if a is not None], default=0)]


# -- run half -----------------------------------------------------------------------------------------
def _describe(target, state: dict, mesh) -> dict:
    """The learner's target as plain facts: its type and keys, and per array its kind, shape, dtype and sharding
    (its type, devices, spec; whether it is the saved array's own, whether it lies on ``mesh``)."""
    import jax
    from jax.sharding import NamedSharding
    if not isinstance(target, dict):
        return {"type": type(target).__name__, "keys": None}
    leaves = {}
    for k in state:
        t = dict.get(target, k)
        kind = "jax.Array" if isinstance(t, jax.Array) else "ShapeDtypeStruct" if isinstance(
            t, jax.ShapeDtypeStruct) else "other"
        leaf = {"kind": kind, "type": type(t).__name__}
        if kind == "ShapeDtypeStruct":
            s = t.sharding
            leaf.update(shape=tuple(int(d) for d in t.shape), dtype=str(np.dtype(t.dtype)), sharding=None if s is None
                        else {"type": type(s).__name__, "is_saved": s is state[k].sharding,
                              "on_mesh": isinstance(s, NamedSharding) and s.mesh == mesh, "devices": len(s.device_set),
                              "spec": tuple(s.spec) if isinstance(s, NamedSharding) else None})
        leaves[k] = leaf
    return _plain.plain({"type": "dict", "keys": list(dict.keys(target)), "leaves": leaves})


def run_restore_target(fn, devices, sizes: tuple = (4, 1)) -> dict:
    """Run half: a small state saved on 8 devices by the FSDP rule; per new mesh (4, then 1 devices) the learner's
    target, described, and what Orbax restored into it."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from course_lib.checkpoint import orbax as cj
    from course_lib.strategies.fsdp.jax import fsdp_spec
    files = learner_files(answer_of(fn)[0])

    def mesh_of(n):
        return jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,), devices=list(devices)[:n])
    big = mesh_of(8)
    state = {k: jax.device_put(v, NamedSharding(big, fsdp_spec(v.shape, 8))) for k, v in restore_inputs().items()}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        mngr = cj.manager(d)
        cj.save(mngr, 1, state)
        mngr.wait_until_finished()
        try:
            for n in sizes:
                devs, mesh = f"{n} device{'s' if n > 1 else ''}", mesh_of(n)
                try:
                    target = fn(state, mesh)
                except NotImplementedError:
                    raise
                except Exception as e:  # noqa: BLE001 - a crash in the learner's function: named, not a raw traceback
                    rows.append({"error": crash_info(e, files, f"restore_target(state, mesh) for a mesh of {devs}")})
                    break
                rows.append({"target": _describe(target, state, mesh)})
                if isinstance(target, dict) and set(dict.keys(target)) == set(state):
                    try:
                        rows[-1]["restored"] = _plain.plain(cj.restore(mngr, 1, target)[0])
                    except Exception as e:  # noqa: BLE001 - Orbax raising deep inside: named by the judge
                        rows[-1]["restore_error"] = crash_info(e, files, f"Orbax's restore into your target on {devs}")
        finally:
            mngr.close()
    return {"meshes": filled(rows)}


# -- judge half ---------------------------------------------------------------------------------------
def _leaf_verdict(k: str, t, x: np.ndarray, n: int, passed: list, saved_n: int) -> str | None:
    """The ❌ text for target leaf ``t`` (its plain description) of saved array ``x`` on a mesh of ``n``; None if
    it is an abstract array with the FSDP rule's NamedSharding on that mesh."""
    from course_lib.strategies.fsdp.jax import fsdp_spec
    devs = f"{n} device{'s' if n > 1 else ''}"
    t = t if isinstance(t, dict) else {"kind": "?", "type": "nothing"}
    if t.get("kind") == "jax.Array":
        return (f"target[{k!r}] is a jax.Array → a concrete target allocates the whole state once more before "
                "reading it; give abstract arrays (jax.ShapeDtypeStruct)")
    if t.get("kind") != "ShapeDtypeStruct":
        return f"target[{k!r}] is a {t.get('type')}; give a jax.ShapeDtypeStruct"
    shape, dtype = t.get("shape"), t.get("dtype")
    if shape != x.shape or dtype != str(x.dtype):
        return (f"target[{k!r}] is {dtype}{list(shape) if isinstance(shape, tuple) else shape}, saved "
                f"{x.dtype}{list(x.shape)} → Orbax would cast or fail; keep each array's shape and dtype")
    s = t.get("sharding")
    if s is None:
        return (f"target[{k!r}] has no sharding → Orbax puts it back on the mesh it was saved from ({saved_n} "
                "devices), not on yours. nnx.eval_shape drops shardings (flax#5110): add sharding=NamedSharding(mesh, spec)")
    if not isinstance(s, dict):
        return f"target[{k!r}] has a sharding that could not be read; build a NamedSharding on the `mesh` argument"
    if s.get("is_saved"):
        return (f"target[{k!r}] is sharded over {saved_n} devices, the target mesh has {devs} → that is the saved "
                "array's own sharding; build a NamedSharding on the new mesh")
    if not s.get("on_mesh"):
        on, kind = s.get("devices"), s.get("type") if isinstance(s.get("type"), str) else "sharding of unknown kind"
        return (f"target[{k!r}] has a {kind} over {on} device{'s' if on != 1 else ''}, not on the mesh you "
                f"were given ({devs}) → the restore would land wherever that sharding says; build a NamedSharding "
                "on the `mesh` argument")
    want, got = _norm(fsdp_spec(x.shape, n)), _norm(s.get("spec"))
    if got == want:
        return None
    per = x.nbytes // (n if want else 1)
    # a fixed device count: one the answer was right for on an earlier mesh first, then the saved one
    other = next((m for m in (*passed, saved_n, 2, 4, 8) if m != n and got == _norm(fsdp_spec(x.shape, m))), None)
    if other:
        why = (f"that is the FSDP rule for {other} devices"
               + (", the saved mesh's size" if other == saved_n and other not in passed else "")
               + f", not for the {devs} of the mesh you were given"
               + (f" (right on the {other}-device mesh: a device count fixed in your code?)" if other in passed else "")
               + "; the rule's cut depends on the number of devices: take it from the mesh")
    elif not got:
        why = f"each device would hold the whole array (N× the memory): {x.nbytes:,} bytes instead of {per:,}"
    else:
        why = "each device would hold another cut"
    return (f"target[{k!r}] {x.shape} is {'replicated' if not got else f'P{got}'} on {devs}, the FSDP rule gives "
            f"P{want} → {why}" + ("" if other else "; cut by the FSDP rule for the mesh you are given"))


def judge_restore_target(data: dict, sizes: tuple = (4, 1), saved_devices: int = 8) -> str:
    """Judge half: per new mesh, the target's leaves against the FSDP rule for that mesh, then the restored values
    against the saved ones."""
    host = restore_inputs()
    rows = data.get("meshes") if isinstance(data, dict) else None
    rows = rows if isinstance(rows, list) else []
    passed: list[int] = []                       # the mesh sizes the answer was right for
    for i, n in enumerate(sizes):
        devs = f"{n} device{'s' if n > 1 else ''}"
        row = rows[i] if i < len(rows) and isinstance(rows[i], dict) else None
        if row is None:
            raise AssertionError(f"no result for the mesh of {devs}")
        if "error" in row:
            raise AssertionError(crash_message(row["error"]))
        target = row.get("target") if isinstance(row.get("target"), dict) else {}
        keys = target.get("keys")
        if target.get("type") != "dict" or not isinstance(keys, list) or sorted(map(str, keys)) != sorted(host):
            shown = sorted(map(str, keys)) if isinstance(keys, list) else "?"
            raise AssertionError(f"returned {target.get('type')} with keys {shown}; return the same pytree as the "
                                 f"state: {sorted(host)}")
        leaves = target.get("leaves") if isinstance(target.get("leaves"), dict) else {}
        for k, x in host.items():
            verdict = _leaf_verdict(k, leaves.get(k), np.asarray(x), n, passed, saved_devices)
            if verdict:
                raise AssertionError(verdict)
        if "restore_error" in row:
            raise AssertionError(crash_message(row["restore_error"]))
        restored = row.get("restored") if isinstance(row.get("restored"), dict) else {}
        bad = [f"[{k!r}]" for k in sorted(host) if not same_array(restored.get(k), np.asarray(host[k]))]
        if bad:
            raise AssertionError(f"restored onto {devs}, {bad} differ from the saved values")
        passed.append(n)
    return (f"restored from {saved_devices} devices onto {' and '.join(map(str, sizes))}, every array where the FSDP "
            "rule puts it, bit-identical")
