"""Lab 05's exercise checks: the FSDP sharding rule and the all-gather / psum-scatter pair in JAX."""
from __future__ import annotations

import numpy as np

from course_lib import checks
from course_lib.strategies.fsdp_jax import AXIS, MIN_SIZE, gather_vjp

__all__ = ["check_spec_rule", "check_gather_pair"]


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
]


def check_spec_rule(fn, name: str = "fsdp_spec") -> bool:
    """Exercise check: ``fn(shape, n, min_size=...)`` returns the PartitionSpec :func:`fsdp_spec` gives."""
    from jax.sharding import PartitionSpec
    with checks.check(name) as c:
        for shape, n, min_size, want, why in _SPEC_CASES:
            got = fn(shape, n, min_size=min_size)
            if not isinstance(got, PartitionSpec):
                raise AssertionError(f"{name}({shape}, n={n}) returned {got!r}; return a PartitionSpec, e.g. P('fsdp')")
            if _norm(got) != want:
                raise AssertionError(f"{name}({shape}, n={n}, min_size={min_size}) = {got}, want P{want!r}: {why}")
        c.ok(f"{len(_SPEC_CASES)} shapes placed like the reference rule")
    return bool(c.passed)


def check_gather_pair(fwd, bwd, mesh, name: str = "FSDP gather pair") -> bool:
    """Exercise check: ``gather_vjp(fwd, bwd)`` under shard_map gives every device the full weight, and
    the gradient shards of the global mean loss (what one device computes with the whole batch)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    n, rng = mesh.shape[AXIS], np.random.default_rng(5)
    w = rng.standard_normal((8 * n, 24)).astype(np.float32)         # a kernel, cut by rows
    x = rng.standard_normal((4 * n, 8 * n)).astype(np.float32)      # a batch, cut by rows
    ref_loss = lambda w, x: jax.numpy.mean(jax.numpy.tanh(x @ w) ** 2)  # noqa: E731
    grad_fn = jax.jit(jax.grad(ref_loss))
    ref = np.asarray(grad_fn(w, x))                                  # a backward that slices, not sums, gives:
    local = np.concatenate([np.asarray(grad_fn(w, xd))[8 * d:8 * d + 8] / n for d, xd in enumerate(np.split(x, n))])

    def no_sum(got, exp):
        if np.allclose(got, local, rtol=1e-4, atol=1e-7):
            return "got is each device's slice of its OWN gradient: the sum over devices is missing (psum_scatter)"
    with checks.check(name) as c:
        gather = gather_vjp(fwd, bwd)

        def per_device(ws, xs):
            full = gather(ws, 0)
            return jax.grad(lambda s: ref_loss(gather(s, 0), xs) / n)(ws), full[None]
        f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS))))
        try:
            grad, fulls = f(*(jax.device_put(a, NamedSharding(mesh, P(AXIS))) for a in (w, x)))
        except Exception as e:  # a shape or axis mistake: JAX's own words, then ours (a stub's error passes)
            if isinstance(e, NotImplementedError):
                raise
            raise AssertionError(f"JAX rejected it: {type(e).__name__}: {str(e).splitlines()[0][:300]}\n   hint: "
                                 "forward all_gather(.., axis=dim, tiled=True) returns the full weight; backward "
                                 "psum_scatter(.., scatter_dimension=dim, tiled=True) a shard's shape") from None
        checks.assert_close("forward: the gathered weight on every device", np.asarray(fulls),
                            np.broadcast_to(w, (n, *w.shape)), rtol=0, atol=0, hint=checks.wrong_shard_offset(n, 1))
        checks.assert_close("backward: the gradient shards", np.asarray(grad), ref, rtol=1e-5, atol=1e-7,
                            hint=[checks.averaged_twice(n), no_sum, checks.wrong_shard_offset(n)])
        c.ok(f"all {n} devices see the full weight; gradient shards equal the single-device gradient")
    return bool(c.passed)
