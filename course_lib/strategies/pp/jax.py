"""Pipeline parallel in JAX: one SPMD program, ``jax.shard_map`` over a ``"stage"`` mesh axis, ``ppermute`` to pass
activations to the next stage (the jax-ml book "How to Scale Your Model", pipelining section).

Each device holds one stage's weights (the stacked weights ``(p, d, d)`` sharded on dim 0). The program runs
``m + p - 1`` ticks; at tick t, stage s works on micro-batch ``t - s`` when ``0 <= t - s < m`` and on padding
otherwise (the bubble: computed and thrown away, since SPMD devices all run the same program), then every stage
``ppermute``\\ s its output one stage on. Stage 0 reads micro-batch t; the last stage keeps its result for
micro-batch ``t - p + 1``. The backward is ``jax.grad`` of it: the transpose of ``ppermute`` is the ``ppermute``
the other way round, so the gradients flow back stage by stage (GPipe's order: all forwards, then all backwards).
"""
from __future__ import annotations

__all__ = ["AXIS", "stage_mesh", "init_weights", "sequential", "pipeline", "tick_table"]

AXIS = "stage"


def stage_mesh(p: int, axis: str = AXIS, devices=None):
    """``jax.make_mesh((p,), (axis,))`` with an Auto axis: ``shard_map`` places the inputs itself. Over ``devices`` (default: the first ``p``)."""
    import jax
    from jax.sharding import AxisType
    devices = list(jax.devices()[:p] if devices is None else devices)
    return jax.make_mesh((p,), (axis,), axis_types=(AxisType.Auto,), devices=devices)


def init_weights(p: int, d: int, seed: int = 0):
    """``p`` stages' weights, stacked: (p, d, d), scaled 1/sqrt(d)."""
    import jax
    return jax.random.normal(jax.random.key(seed), (p, d, d)) / d ** 0.5


def sequential(w, x):
    """The unsharded model: ``x`` (rows, d) through every stage in turn, ``tanh(x @ w[s])``."""
    import jax.numpy as jnp
    for s in range(w.shape[0]):
        x = jnp.tanh(x @ w[s])
    return x


def tick_table(p: int, m: int) -> list[list[int | None]]:
    """Which micro-batch each stage works on at each tick (None: the bubble), ``[tick][stage]``."""
    return [[t - s if 0 <= t - s < m else None for s in range(p)] for t in range(m + p - 1)]


def pipeline(w, xs, mesh, axis: str = AXIS):
    """The pipelined model: ``w`` (p, d, d) sharded over ``axis``, micro-batches ``xs`` (m, rows, d) replicated;
    returns (m, rows, d), replicated. Equal to ``sequential`` on each micro-batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    p, m = mesh.shape[axis], xs.shape[0]
    if w.shape[0] != p:
        raise ValueError(f"weights for {w.shape[0]} stages on a mesh axis {axis!r} of {p} devices: one stage per "
                         "device; stack exactly that many")
    perm = [(j, (j + 1) % p) for j in range(p)]            # stage j -> j + 1 (the last one's wraps: never read)

    def per_stage(w_s, xs):                                 # w_s: (1, d, d), this stage's weights
        s = jax.lax.axis_index(axis)
        state = jnp.zeros_like(xs[0])
        outs = jnp.zeros_like(xs)
        for t in range(m + p - 1):                          # unrolled: m + p - 1 ppermutes in the HLO
            inp = jnp.where(s == 0, xs[min(t, m - 1)], state)
            y = jnp.tanh(inp @ w_s[0])
            if t >= p - 1:                                   # the last stage finished micro-batch t - p + 1
                outs = outs.at[t - p + 1].set(jnp.where(s == p - 1, y, 0.0))
            state = jax.lax.ppermute(y, axis, perm)
        return jax.lax.psum(outs, axis)                      # only the last stage's rows are non-zero

    return jax.shard_map(per_stage, mesh=mesh, in_specs=(P(axis), P()), out_specs=P())(w, xs)
