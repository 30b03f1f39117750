"""FSDP in JAX and Flax NNX: sharding rules, a jit (GSPMD) train step, and FSDP by hand with ``shard_map``.

Words are :mod:`course_lib.sharding`'s (sharded parameter, all-gather output, padding). The algorithm is
ZeRO-3 / FSDP (Rajbhandari et al. 2020; Zhao et al. 2023): every parameter, gradient and Adam state is
stored cut along one mesh axis ``"fsdp"``; a weight is all-gathered just before it is used, and its
gradient is reduce-scattered so that each device keeps the sum of its own slice. Two ways to get there:

* **automatic** -- :func:`shard_model` + :func:`make_train_step`: parameters stored with a
  ``NamedSharding``, the batch sharded on the same axis, one ``jax.jit``. The partitioner (Shardy /
  GSPMD) inserts the collectives; read them back with ``ledger_jax.from_compiled``.
* **by hand** -- :func:`shard_map_step`: the per-device program is written out, ``all_gather`` before
  use and its transpose, ``psum_scatter``, on the gradient (:func:`gather_vjp` pairs them explicitly).

Rules are shape-based (:func:`fsdp_spec`), so one rule places a parameter and its Adam ``m``, ``v`` alike.
``NamedSharding`` refuses a dimension the mesh axis does not divide (FSDP2 pads; JAX does not): the rule
falls back to another dimension, then to replication. Importing this module does not import JAX.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import checks

__all__ = ["AXIS", "MIN_SIZE", "CPU_FAST_COMPILE", "fsdp_spec", "state_specs", "shardings", "spec_table", "path_name",
           "compile_options", "shard_model", "sharded_optimizer", "forward", "loss_fn", "pin", "make_train_step",
           "all_gather_shard", "psum_scatter_grad", "gather_vjp", "shard_map_step", "sharded_dim",
           "check_spec_rule", "check_gather_pair"]

AXIS = "fsdp"      #: the one mesh axis FSDP shards over
MIN_SIZE = 2**10   #: elements; smaller parameters (biases, norms) are replicated, as in the seed's rule
#: XLA:CPU spends most of a compile generating machine code. These options use its older, quicker
#: fusion emitters and skip LLVM's expensive passes: the same partitioned HLO (same collectives), slower
#: kernels -- ~4x quicker compiles, the right trade for a tiny model on a laptop. Never used on GPU.
CPU_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
                    "xla_llvm_disable_expensive_passes": True}


# -- rules: shape -> PartitionSpec ---------------------------------------------------------------------
def fsdp_spec(shape, n: int, *, min_size: int = MIN_SIZE, axis: str = AXIS):
    """Where to cut a parameter of ``shape`` over ``n`` devices.

    Replicate (``P()``) below ``min_size`` elements. Otherwise shard dim 0 (the seed's ``P('fsdp')``,
    FSDP2's ``Shard(0)``) if ``n`` divides it, else the largest other dimension ``n`` divides, else
    replicate: ``NamedSharding`` cannot cut 66 rows in 8 (pad the parameter, or pick other sizes).
    ``min_size`` large enough gives the seed's *selective* sharding (only the biggest tables).
    """
    from jax.sharding import PartitionSpec as P
    shape = tuple(shape)
    if math.prod(shape) < min_size:
        return P()
    for d in [0] + sorted(range(1, len(shape)), key=lambda k: -shape[k]):
        if shape[d] % n == 0:
            return P(*[None] * d, axis)
    return P()


def sharded_dim(spec, axis: str = AXIS):
    """The dimension ``spec`` cuts along ``axis``, or None when replicated."""
    return tuple(spec).index(axis) if axis in tuple(spec) else None


def state_specs(state, n: int, rule=fsdp_spec, **kw):
    """``rule(shape, n, **kw)`` for every array of ``state`` (an ``nnx.State`` or any pytree)."""
    import jax
    return jax.tree.map(lambda x: rule(tuple(x.shape), n, **kw), state)


def shardings(mesh, specs):
    """The ``NamedSharding`` pytree for ``specs`` on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, PartitionSpec))


def path_name(path) -> str:
    """``blocks.0.mlp.fc.kernel`` for a pytree path of an ``nnx.State`` (the Variable's ``.value`` dropped)."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path).removesuffix(
        ".value")


def spec_table(state, n: int | None = None, rule=fsdp_spec, **kw) -> str:
    """One line per array: name, shape, PartitionSpec, bytes held per device (debugging: "is it sharded?").
    With ``n`` the specs come from ``rule`` (a plan); without, from each array's own ``.sharding``."""
    import jax
    rows, held, full = [], 0, 0
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        spec = rule(tuple(x.shape), n, **kw) if n else x.sharding.spec
        k = (n or x.sharding.mesh.size) if sharded_dim(spec) is not None else 1
        nbytes = math.prod(x.shape) * np.dtype(x.dtype).itemsize
        held, full = held + nbytes // k, full + nbytes
        rows.append(f"{path_name(path):<28} {str(tuple(x.shape)):<11} {str(spec):<20} {nbytes // k:>8,}")
    head = f"{'parameter':<28} {'shape':<11} {'spec':<20} {'B/device':>8}"
    return "\n".join([head, *rows, f"{'total':<61} {held:>8,} of {full:,} ({held / full:.1%})"])


# -- the automatic (jit) FSDP --------------------------------------------------------------------------
def compile_options(mesh_or_devices) -> dict | None:
    """:data:`CPU_FAST_COMPILE` when the devices are CPUs, else None (GPU/TPU keep their defaults)."""
    devs = getattr(mesh_or_devices, "devices", mesh_or_devices)
    return CPU_FAST_COMPILE if np.asarray(devs).flat[0].platform == "cpu" else None


def shard_model(model, mesh, rule=fsdp_spec, **kw):
    """Place ``model``'s state on ``mesh`` by ``rule`` (in place); returns the PartitionSpec pytree. Goes
    through host memory: a device-to-device reshard compiles a small program per shape (seconds here)."""
    import jax
    from flax import nnx
    state = nnx.state(model)
    specs = state_specs(state, mesh.size, rule, **kw)
    nnx.update(model, jax.device_put(jax.tree.map(np.asarray, state), shardings(mesh, specs)))
    return specs


def sharded_optimizer(model, tx, mesh, rule=fsdp_spec, **kw):
    """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` built in one small jit, Adam's ``m``, ``v`` born sharded by
    ``rule`` (eagerly, each ``zeros_like`` is a compile of its own and the step counter lands on one device)."""
    import jax
    from flax import nnx
    make = lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param)          # noqa: E731
    opt_def, abstract = nnx.split(nnx.eval_shape(make, model))
    out = shardings(mesh, state_specs(abstract, mesh.size, rule, **kw))
    model_def, params = nnx.split(model)
    init = jax.jit(lambda p: nnx.split(make(nnx.merge(model_def, p)))[1], out_shardings=out)
    return nnx.merge(opt_def, init.lower(params).compile(compile_options(mesh))(params))


def forward(model, idx, remat: bool = False):
    """``FlaxGPT``'s forward (dropout 0), each block under ``nnx.remat`` when ``remat``: its activations
    are recomputed in the backward pass instead of kept (Chen et al. 2016, "sublinear memory cost")."""
    import jax.numpy as jnp
    from flax import nnx
    B, T = idx.shape  # batch, time
    x = model.tok_emb(idx) + model.pos_emb(jnp.arange(T))           # [B, T, C]
    block = nnx.remat(lambda blk, h: blk(h)) if remat else (lambda blk, h: blk(h))
    for blk in model.blocks:
        x = block(blk, x)
    return model.head(model.ln_f(x))                                # [B, T, V]


def loss_fn(model, x, y, remat: bool = False):
    """Mean next-token cross entropy, as ``models.loss_fn`` computes it in torch."""
    import optax
    return optax.softmax_cross_entropy_with_integer_labels(forward(model, x, remat), y).mean()


def pin(*nodes, mesh, rule=fsdp_spec, **kw):
    """Inside a jit: constrain every array of the NNX ``nodes`` to ``rule``'s sharding on ``mesh``. Left free,
    the partitioner may lay an *output* out otherwise than its input (a 66-vector cut in two, say): the
    compiled step would then refuse its own outputs as the next step's inputs."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding
    for node in nodes:
        nnx.update(node, jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, rule(tuple(x.shape), mesh.size, **kw))), nnx.state(node)))


def make_train_step(mesh, rule=fsdp_spec, remat: bool = False, **kw):
    """The seed's step with current NNX: ``nnx.jit`` (model and optimizer donated), value_and_grad,
    ``optimizer.update``, then :func:`pin`. The inputs carry the sharding; the compiler makes the collectives."""
    from flax import nnx

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(functools.partial(loss_fn, remat=remat))(model, x, y)
        optimizer.update(model, grads)
        pin(model, optimizer, mesh=mesh, rule=rule, **kw)
        return loss
    return train_step


# -- FSDP by hand: shard_map ---------------------------------------------------------------------------
def all_gather_shard(w, dim: int, axis: str = AXIS):
    """Forward: this device's shard -> the all-gather output, the shards side by side along ``dim``."""
    import jax
    return jax.lax.all_gather(w, axis, axis=dim, tiled=True)


def psum_scatter_grad(g, dim: int, axis: str = AXIS):
    """Backward: this device's full-size gradient -> its slice of the SUM over devices (reduce-scatter)."""
    import jax
    return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)


def gather_vjp(fwd=all_gather_shard, bwd=psum_scatter_grad):
    """``gather(w, dim)`` that runs ``fwd`` forward and ``bwd`` on the cotangent: FSDP's pair, spelled out.
    ``jax.grad`` derives the same pair from a plain ``all_gather``: its transpose *is* ``psum_scatter``."""
    import jax

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def gather(w, dim):
        return fwd(w, dim)
    gather.defvjp(lambda w, dim: (fwd(w, dim), None), lambda dim, _, g: (bwd(g, dim),))
    return gather


def shard_map_step(graphdef, tx, mesh, specs, opt_specs, *, gather=None, axis: str = AXIS):
    """One FSDP training step, per device, under ``jax.shard_map``: ``step(params, opt_state, x, y)``.

    ``params``/``opt_state`` are the sharded pytrees (``specs``/``opt_specs``); ``x``, ``y`` are cut on
    ``axis`` by rows. Each device scales its local mean loss by 1/N, so that the collectives' SUMs
    (``psum_scatter`` for sharded weights, the ``psum`` JAX puts on replicated ones: the transpose of
    using an invariant value on every device) are the gradients of the global mean. ``gather``
    defaults to a plain ``all_gather`` (autodiff makes the ``psum_scatter``); pass ``gather_vjp(...)``.
    """
    import jax
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    gather, n = gather or (lambda w, dim: all_gather_shard(w, dim, axis)), mesh.shape[axis]

    def body(params, opt_state, x, y):
        def local_loss(p):
            full = jax.tree.map(lambda w, s: w if sharded_dim(s, axis) is None else gather(w, sharded_dim(s, axis)),
                                p, specs, is_leaf=lambda s: isinstance(s, P))
            logits = nnx.merge(graphdef, full)(x)                         # [B/N, T, V] this device's rows
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() / n
        loss, grads = jax.value_and_grad(local_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)  # elementwise; a global-norm clip needs a psum
        return optax.apply_updates(params, updates), opt_state, jax.lax.psum(loss, axis)

    return jax.shard_map(body, mesh=mesh, in_specs=(specs, opt_specs, P(axis), P(axis)),
                         out_specs=(specs, opt_specs, P()))


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
