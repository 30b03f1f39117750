"""Expert parallel in JAX: GShard's formulation, fixed-size buffers and ``jax.lax.all_to_all`` in ``shard_map``.

``all_to_all`` moves equal chunks, so each device packs its kept copies into a dispatch buffer of shape
``(E, C, d)`` (expert, slot in that expert's capacity, features), zeros where a slot is empty; the all-to-all over
the ``"expert"`` axis hands chunk ``(E/p, C, d)`` number j to device j. After the local experts, a second all-to-all
brings the results home, and each token sums its copies, times their gates. The buffers are padded to the capacity,
so the bytes moved are ``(p-1)/p · E·C·d`` per device whatever the routing: capacity is also the price of the
all-to-all (the torch version moves only the kept copies, with uneven splits).
"""
from __future__ import annotations

__all__ = ["AXIS", "expert_mesh", "route", "moe_layer", "ep_layer"]

AXIS = "expert"


def expert_mesh(p: int, axis: str = AXIS, devices=None):
    """``jax.make_mesh((p,), (axis,))`` with an Auto axis. Over ``devices`` (default: the first ``p``)."""
    import jax
    from jax.sharding import AxisType
    devices = list(jax.devices()[:p] if devices is None else devices)
    return jax.make_mesh((p,), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def route(x, router, k: int, cap: int):
    """GShard's dispatch and combine tensors for one group ``x`` (T, d): both (T, E, C); the same routing as
    :mod:`course_lib.strategies.ep.routing` (top-k renormalised, first choices first, then token order)."""
    import jax
    import jax.numpy as jnp
    E = router.shape[1]
    gates, ids = jax.lax.top_k(jax.nn.softmax(x @ router, axis=-1), k)          # (T, k)
    gates = gates / gates.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(ids, E, dtype=jnp.int32)                           # (T, k, E)
    flat = jnp.swapaxes(onehot, 0, 1).reshape(-1, E)                           # choice-major
    pos = (jnp.cumsum(flat, 0) * flat).sum(-1) - 1
    pos = jnp.swapaxes(pos.reshape(k, -1), 0, 1)                               # (T, k)
    slot = jax.nn.one_hot(jnp.where(pos < cap, pos, -1), cap)                  # (T, k, C); dropped: all zeros
    dispatch = jnp.einsum("tke,tkc->tec", onehot.astype(x.dtype), slot)
    combine = jnp.einsum("tke,tkc,tk->tec", onehot.astype(x.dtype), slot, gates)
    return dispatch, combine


def _experts(buf, w1, w2):
    """``buf`` (..., E', C, d) through experts ``w1`` (E', d, f), ``w2`` (E', f, d)."""
    import jax
    import jax.numpy as jnp
    h = jax.nn.relu(jnp.einsum("...ecd,edf->...ecf", buf, w1))
    return jnp.einsum("...ecf,efd->...ecd", h, w2)


def moe_layer(x, router, w1, w2, k: int, cap: int, groups: int):
    """Unsharded: ``x`` (T, d) in ``groups`` groups, each routed with capacity ``cap``."""
    import jax.numpy as jnp
    outs = []
    for xg in jnp.split(x, groups):
        dispatch, combine = route(xg, router, k, cap)
        outs.append(jnp.einsum("tec,ecd->td", combine, _experts(jnp.einsum("tec,td->ecd", dispatch, xg), w1, w2)))
    return jnp.concatenate(outs)


def ep_layer(x, router, w1, w2, mesh, k: int, cap: int, axis: str = AXIS):
    """Expert parallel: tokens ``x`` (T, d) and experts ``w1``/``w2`` sharded over ``axis``, router replicated;
    each device's tokens form one group."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    p, E = mesh.shape[axis], router.shape[1]
    if E % p:
        raise ValueError(f"{E} experts over {p} devices: use a number of experts that is a multiple of {p}")

    def per_device(x, router, w1, w2):                          # x (T/p, d); w1 (E/p, d, f), w2 (E/p, f, d)
        dispatch, combine = route(x, router, k, cap)
        buf = jnp.einsum("tec,td->ecd", dispatch, x).reshape(p, E // p, cap, -1)   # chunk j: device j's experts
        buf = jax.lax.all_to_all(buf, axis, split_axis=0, concat_axis=0)            # now chunk j: from device j
        out = jax.lax.all_to_all(_experts(buf, w1, w2), axis, split_axis=0, concat_axis=0)
        return jnp.einsum("tec,ecd->td", combine, out.reshape(E, cap, -1))

    return jax.shard_map(per_device, mesh=mesh, in_specs=(P(axis), P(), P(axis), P(axis)),
                         out_specs=P(axis))(x, router, w1, w2)
