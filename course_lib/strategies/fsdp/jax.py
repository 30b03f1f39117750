"""FSDP in JAX and Flax NNX: sharding rules, a jit (GSPMD) train step, and FSDP by hand with ``shard_map``.

Words are :mod:`course_lib.maths.sharding`'s (sharded parameter, all-gather output, padding). The algorithm is
ZeRO-3 / FSDP (Rajbhandari et al. 2020; Zhao et al. 2023): every parameter, gradient and Adam state is
stored cut along one mesh axis ``"fsdp"``; a weight is all-gathered just before it is used, and its
gradient is reduce-scattered so that each device keeps the sum of its own slice. Two ways to get there:

* **automatic** -- :func:`shard_model` + :func:`make_train_step`: parameters stored with a
  ``NamedSharding``, the batch sharded on the same axis, one ``jax.jit``. The partitioner (Shardy /
  GSPMD) inserts the collectives; read them back with ``jax_ledger.from_compiled``.
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


__all__ = ["AXIS", "MIN_SIZE", "CPU_FAST_COMPILE", "fsdp_spec", "state_specs", "shardings", "spec_table", "path_name",
           "compile_options", "shard_model", "sharded_optimizer", "forward", "loss_fn", "pin", "make_train_step",
           "all_gather_shard", "psum_scatter_grad", "gather_vjp", "shard_map_step", "sharded_dim"]

AXIS = "fsdp"      #: the one mesh axis FSDP shards over
MIN_SIZE = 2**10   #: elements; smaller parameters (biases, norms) are replicated, as in the JAX/Flax NNX guide "FSDP: Fully Sharded Data Parallel"
#: XLA:CPU spends most of a compile generating machine code. These options use its older, quicker
#: fusion emitters and skip LLVM's expensive passes: the same partitioned HLO (same collectives), slower
#: kernels -- ~4x quicker compiles, the right trade for a tiny model on a laptop. Never used on GPU.
CPU_FAST_COMPILE = {"xla_cpu_use_fusion_emitters": False, "xla_backend_optimization_level": 0,
                    "xla_llvm_disable_expensive_passes": True}


# -- rules: shape -> PartitionSpec ---------------------------------------------------------------------
def fsdp_spec(shape, n: int, *, min_size: int = MIN_SIZE, axis: str = AXIS):
    """Where to cut a parameter of ``shape`` over ``n`` devices.

    Replicate (``P()``) below ``min_size`` elements. Otherwise shard dim 0 (the guide's ``P('fsdp')``,
    FSDP2's ``Shard(0)``) if ``n`` divides it, else the largest other dimension ``n`` divides, else
    replicate: ``NamedSharding`` cannot cut 66 rows in 8 (pad the parameter, or pick other sizes).
    ``min_size`` large enough gives the guide's *selective* sharding (only the biggest tables).
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
    """:data:`CPU_FAST_COMPILE` when the devices are CPUs, else None (GPU/TPU keep their defaults).

    Only the options this jaxlib's XLA knows: XLA drops options as it moves on (jax 0.12 no longer has
    ``xla_cpu_use_fusion_emitters``), and an unknown one fails every compile."""
    devs = getattr(mesh_or_devices, "devices", mesh_or_devices)
    return _known_cpu_options() if np.asarray(devs).flat[0].platform == "cpu" else None


@functools.lru_cache(maxsize=None)
def _known_cpu_options() -> dict:
    """The part of :data:`CPU_FAST_COMPILE` that this XLA accepts (one tiny compile per option, once)."""
    import jax
    import jax.numpy as jnp
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(1))
    known = {}
    for key, value in CPU_FAST_COMPILE.items():
        try:
            lowered.compile(compiler_options={key: value})
        except Exception as exc:  # XLA raises JaxRuntimeError("INVALID_ARGUMENT: No such compile option ...")
            if "No such compile option" not in str(exc):
                raise
            continue
        known[key] = value
    return known


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
    """The JAX/Flax NNX guide's train step with current NNX: ``nnx.jit`` (model and optimizer donated), value_and_grad,
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
