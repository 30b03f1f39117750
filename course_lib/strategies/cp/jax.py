"""Ring attention in JAX: ``shard_map`` over a ``"seq"`` mesh axis, q/k/v sharded along the sequence; the k/v
blocks move one device on with ``ppermute`` (the jax-ml book "How to Scale Your Model"), and each device merges
the partial attention of its queries with the online softmax (:func:`merge`, as in the torch version).

SPMD runs the same program everywhere, so a causal block of later positions is computed and masked rather than
skipped; its rows get ``lse = -inf`` and an output of 0, which the merge adds as nothing.
"""
from __future__ import annotations

__all__ = ["AXIS", "seq_mesh", "block_attention", "merge", "full_attention", "ring_attention"]

AXIS = "seq"


def seq_mesh(p: int, axis: str = AXIS, devices=None):
    """``jax.make_mesh((p,), (axis,))`` with an Auto axis. Over ``devices`` (default: the first ``p``)."""
    import jax
    from jax.sharding import AxisType
    devices = list(jax.devices()[:p] if devices is None else devices)
    return jax.make_mesh((p,), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def block_attention(q, k, v, mask=None):
    """``(o, lse)`` of ``q`` (..., Tq, D) over keys ``k``, ``v`` (..., Tk, D); fully masked rows: o = 0, lse = -inf."""
    import jax
    import jax.numpy as jnp
    scores = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    o = jnp.exp(scores - safe[..., None]) @ v
    return o, lse


def merge(o_a, lse_a, o_b, lse_b):
    """The online-softmax merge (see :func:`course_lib.strategies.cp.torch.merge`)."""
    import jax.numpy as jnp
    lse = jnp.logaddexp(lse_a, lse_b)
    return jnp.exp(lse_a - lse)[..., None] * o_a + jnp.exp(lse_b - lse)[..., None] * o_b, lse


def full_attention(q, k, v, causal: bool = False):
    """The single-device reference: ``jax.nn.dot_product_attention`` on (B, H, T, D) arrays."""
    import jax
    import jax.numpy as jnp
    t = lambda a: jnp.swapaxes(a, 1, 2)                      # noqa: E731  (B, T, H, D), JAX's layout
    return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal))


def ring_attention(q, k, v, mesh, axis: str = AXIS, causal: bool = False):
    """Ring attention of full (B, H, T, D) arrays, sharded along T over ``axis``; returns (B, H, T, D)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    p = mesh.shape[axis]
    if q.shape[2] % p:
        raise ValueError(f"sequence length T={q.shape[2]} over {p} devices: T must be a multiple of {p}")
    perm = [(j, (j + 1) % p) for j in range(p)]

    def per_device(q, k, v):                                  # (B, H, T/p, D) each
        r = jax.lax.axis_index(axis)
        tl = q.shape[2]
        qpos = r * tl + jnp.arange(tl)
        o = lse = None
        for step in range(p):
            src = (r - step) % p
            mask = (qpos[:, None] >= (src * tl + jnp.arange(tl))[None, :]) if causal else None
            ob, lb = block_attention(q, k, v, mask)
            o, lse = (ob, lb) if step == 0 else merge(o, lse, ob, lb)
            if step < p - 1:
                k, v = jax.lax.ppermute((k, v), axis, perm)
        return o

    spec = P(None, None, axis, None)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)(q, k, v)
