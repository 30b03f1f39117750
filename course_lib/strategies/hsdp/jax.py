"""HSDP in JAX: the 2-D mesh, its placements, and HSDP by hand with ``shard_map``.

Words are those of :mod:`course_lib.strategies.hsdp.torch` (sharding factor F, replicate factor R, shard group,
replica group); the JAX mesh names its axes ``('replicate', 'fsdp')`` -- ``'fsdp'`` is the shard axis, as in
:mod:`course_lib.strategies.fsdp.jax`, so every FSDP rule there works unchanged with ``n = F``.

* **automatic HSDP** -- :func:`hsdp_mesh`, :func:`hsdp_rule`: parameters ``P('fsdp')`` (cut over F, copied over
  R), the batch cut over *both* axes ``P(('replicate', 'fsdp'))``; one ``jit``, the partitioner inserts the
  collectives; ``jax_ledger.from_compiled(compiled, mesh)`` names the axis each one spans.
* **HSDP by hand** -- :func:`shard_map_hsdp_step`: ``all_gather`` over ``'fsdp'`` before use, the local
  gradient ``psum_scatter``-ed over ``'fsdp'`` and then ``psum``-ed over ``'replicate'`` -- FSDP2's
  reduce-scatter + all-reduce, written out. ``check_vma=False`` so JAX adds no psum of its own: every
  collective in the program is one written here.

FSDP × tensor parallel, the other 2-D mesh, is :mod:`course_lib.strategies.tp.jax`.

Importing this module does not import JAX.
"""
from __future__ import annotations

import math

from course_lib.strategies.fsdp.jax import MIN_SIZE, all_gather_shard, fsdp_spec, sharded_dim

__all__ = ["HSDP_AXES", "auto_mesh", "hsdp_mesh", "hsdp_rule", "batch_spec", "shard_map_hsdp_step", "bytes_per_device"]

HSDP_AXES = ("replicate", "fsdp")   #: the HSDP mesh: R copies (axis 0) of a model cut F ways (axis 1)


def auto_mesh(shape, names, devices=None):
    """``jax.make_mesh`` of a 2-D ``shape`` with Auto axes over ``devices`` (default: the first ones),
    refusing a device count that is not the product of the factors."""
    import jax
    from jax.sharding import AxisType
    if devices is None:
        devices = jax.devices()[:math.prod(shape)]
    if len(devices) != math.prod(shape):
        raise ValueError(f"{names[0]}({shape[0]}) * {names[1]}({shape[1]}) = {math.prod(shape)} != "
                         f"{len(devices)} devices; pick factors whose product is the device count")
    return jax.make_mesh(tuple(shape), names, axis_types=(AxisType.Auto,) * 2, devices=devices)


def hsdp_mesh(replicate: int, fsdp: int, devices=None):
    """``jax.make_mesh((R, F), ('replicate', 'fsdp'))`` with Auto axes (the partitioner places what we do
    not pin). Device ``r·F + f`` is at ``[r, f]``: consecutive devices share a shard group, as ranks do in torch."""
    for k, v in (("replicate", replicate), ("fsdp", fsdp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} must be a positive int")
    return auto_mesh((replicate, fsdp), HSDP_AXES, devices)


def hsdp_rule(fsdp: int, min_size: int = MIN_SIZE):
    """A rule for :mod:`course_lib.strategies.fsdp.jax` (``rule(shape, n, **kw)``) that cuts over the ``'fsdp'`` axis's F devices
    whatever ``n`` (the mesh size R·F) it is handed: the parameter is copied along ``'replicate'``."""
    def rule(shape, n=None, **kw):
        return fsdp_spec(shape, fsdp, min_size=kw.get("min_size", min_size))
    rule.__name__ = f"hsdp_rule(F={fsdp})"
    return rule


def batch_spec(mesh):
    """Rows of the batch cut over every data-parallel axis: ``P(('replicate', 'fsdp'))`` for HSDP,
    ``P('fsdp')`` for FSDP × TP (the tensor axis shares rows)."""
    from jax.sharding import PartitionSpec as P
    names = tuple(mesh.axis_names)
    return P(("replicate", "fsdp")) if names == HSDP_AXES else P("fsdp")


def shard_map_hsdp_step(graphdef, tx, mesh, specs, opt_specs):
    """One HSDP step per device under ``jax.shard_map``: ``step(params, opt_state, x, y)``.

    Per device: all-gather each cut parameter over ``'fsdp'``; the local mean loss scaled by 1/N (N = R·F)
    so the SUMs below are the gradient of the global mean; gradients of the *gathered* parameters, then
    ``psum_scatter`` over ``'fsdp'`` (reduce-scatter inside the shard group) and ``psum`` over ``'replicate'``
    (the all-reduce across replica groups) -- replicated small parameters get one ``psum`` over both axes.
    """
    import jax
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    n = mesh.shape["replicate"] * mesh.shape["fsdp"]
    is_spec = lambda s: isinstance(s, P)  # noqa: E731

    def reduce_grad(g, s):
        d = sharded_dim(s)
        if d is None:                                          # replicated: sum over every device
            return jax.lax.psum(g, ("replicate", "fsdp"))
        g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=d, tiled=True)   # shard group: reduce-scatter
        return jax.lax.psum(g, "replicate")                                    # replica group: all-reduce

    def body(params, opt_state, x, y):
        full = jax.tree.map(lambda w, s: w if sharded_dim(s) is None else all_gather_shard(w, sharded_dim(s)),
                            params, specs, is_leaf=is_spec)

        def local_loss(p):
            logits = nnx.merge(graphdef, p)(x)                 # [B/N, T, V] this device's rows
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() / n
        loss, g_full = jax.value_and_grad(local_loss)(full)
        grads = jax.tree.map(reduce_grad, g_full, specs, is_leaf=is_spec)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, ("replicate", "fsdp"))

    data = P(("replicate", "fsdp"))
    return jax.shard_map(body, mesh=mesh, in_specs=(specs, opt_specs, data, data), out_specs=(specs, opt_specs, P()),
                         check_vma=False)


def bytes_per_device(tree) -> list[int]:
    """Bytes of ``tree``'s arrays held by each device (addressable shards), in device-id order."""
    import jax
    held: dict = {}
    for x in jax.tree.leaves(tree):
        for s in x.addressable_shards:
            held[s.device.id] = held.get(s.device.id, 0) + s.data.nbytes
    return [held[k] for k in sorted(held)]

