"""The course GPT in Flax NNX, the twin of :mod:`~course_lib.models.torch_gpt`, from the same weights.

Flax differs only in names and layout: ``nn.Linear.weight`` [out, in] is ``nnx.Linear.kernel`` [in, out],
``LayerNorm.weight`` is ``scale``, ``Embedding.weight`` is ``embedding``.

JAX is imported lazily: a JAX lab sets the number of simulated devices before the first ``import jax``,
so importing this module must not. :func:`_flax` defines the Flax classes on first use;
``models.FlaxGPT`` (PEP 562 ``__getattr__``) and :func:`flax_gpt` reach them.
"""
from __future__ import annotations

import functools
import math
import types

import numpy as np

from course_lib.models.config import LN_EPS, GPTConfig, init_weights, weight_shapes

__all__ = ["flax_gpt", "flax_load_", "flax_to_numpy_weights"]


@functools.cache
def _flax() -> types.SimpleNamespace:
    """Import JAX and define the Flax twins of the torch classes, once (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @jax.custom_jvp
    def erf(x):
        return jax.lax.erf(x)

    @erf.defjvp
    def _erf_jvp(primals, tangents):
        # d/dx erf(x) = 2/sqrt(pi) exp(-x^2), written here because jax 0.12's own derivative of erf fails
        # inside jax.shard_map ("Primitive polynomial requires varying manual axes to match", a JAX bug).
        (x,), (dx,) = primals, tangents
        return erf(x), dx * (2 / math.sqrt(math.pi)) * jnp.exp(-jnp.square(x))

    def gelu(x):  # exact GELU, written as torch writes F.gelu: x/2 (1 + erf(x/sqrt 2))
        return 0.5 * x * (1 + erf(x * (1 / math.sqrt(2))))

    def _fused_attention(q, dropout) -> bool:
        """cuDNN's fused attention where it exists and computes what the einsums compute: a GPU, bf16 or fp16
        (cuDNN's flash kernels take no fp32), head_dim a multiple of 8 up to 128, no attention dropout. It never
        writes the [B, H, T, T] score matrix (the einsums save it and its softmax for backward: 4 GiB per layer
        in bf16 at 2 x 8192 tokens and 8 heads) and runs FlashAttention's tiling, as torch's SDPA does (its cuDNN
        backend). Decided while tracing, so CPU programs -- and every number the tests compare -- keep the einsums."""
        hd = q.shape[-1]
        return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and hd % 8 == 0
                and hd <= 128 and not dropout)

    def layer_norm(cfg, rngs):  # two-pass variance, as torch computes it (Flax's default is E[x²] − E[x]²)
        return nnx.LayerNorm(cfg.d_model, epsilon=LN_EPS, use_fast_variance=False, rngs=rngs)

    class FlaxAttention(nnx.Module):
        def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
            self.n_heads = cfg.n_heads
            self.qkv = nnx.Linear(cfg.d_model, 3 * cfg.d_model, rngs=rngs)
            self.proj = nnx.Linear(cfg.d_model, cfg.d_model, rngs=rngs)
            self.attn_drop, self.resid_drop = nnx.Dropout(cfg.dropout), nnx.Dropout(cfg.dropout)

        def __call__(self, x, rngs=None):
            B, T, C = x.shape  # batch, time, channels
            q, k, v = (t.reshape(B, T, self.n_heads, -1) for t in jnp.split(self.qkv(x), 3, axis=-1))  # [B, T, H, hd]
            if _fused_attention(q, self.attn_drop.rate):  # GPU, bf16/fp16: cuDNN's flash attention
                y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # [B, T, H, hd]
                return self.resid_drop(self.proj(y.reshape(B, T, C)), rngs=rngs)
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // self.n_heads)  # [B, H, T, T], SDPA's scale
            att = jnp.where(jnp.tril(jnp.ones((T, T), dtype=bool)), att, -jnp.inf)    # causal: no peeking ahead
            y = jnp.einsum("bhqk,bkhd->bqhd", self.attn_drop(jax.nn.softmax(att, axis=-1), rngs=rngs), v)
            return self.resid_drop(self.proj(y.reshape(B, T, C)), rngs=rngs)  # y was [B, T, H, hd]

    class FlaxMLP(nnx.Module):
        def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
            self.fc = nnx.Linear(cfg.d_model, cfg.d_ff, rngs=rngs)
            self.proj = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)
            self.drop = nnx.Dropout(cfg.dropout)

        def __call__(self, x, rngs=None):
            return self.drop(self.proj(gelu(self.fc(x))), rngs=rngs)

    class FlaxBlock(nnx.Module):
        def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
            self.ln1, self.attn = layer_norm(cfg, rngs), FlaxAttention(cfg, rngs=rngs)
            self.ln2, self.mlp = layer_norm(cfg, rngs), FlaxMLP(cfg, rngs=rngs)

        def __call__(self, x, rngs=None):
            x = x + self.attn(self.ln1(x), rngs)
            return x + self.mlp(self.ln2(x), rngs)

    class FlaxGPT(nnx.Module):
        def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
            self.cfg = cfg
            self.tok_emb = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
            self.pos_emb = nnx.Embed(cfg.seq_len, cfg.d_model, rngs=rngs)
            self.drop = nnx.Dropout(cfg.dropout)  # no stored RNG: the model's state is its parameters alone
            self.blocks = nnx.List([FlaxBlock(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
            self.ln_f = layer_norm(cfg, rngs)
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

        def __call__(self, idx, rngs: nnx.Rngs | None = None):  # rngs: only for dropout > 0 in train mode
            B, T = idx.shape  # batch, time
            if T > self.cfg.seq_len:
                raise ValueError(f"sequence length T({T}) > cfg.seq_len({self.cfg.seq_len}); crop idx or raise seq_len")
            x = self.drop(self.tok_emb(idx) + self.pos_emb(jnp.arange(T)), rngs=rngs)  # [B, T, C]
            for block in self.blocks:
                x = block(x, rngs)
            return self.head(self.ln_f(x))  # [B, T, V]

    classes = (FlaxAttention, FlaxMLP, FlaxBlock, FlaxGPT)
    for cls in classes:  # name them as module-level classes, for reprs, pickling and `models.FlaxGPT`
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return types.SimpleNamespace(jnp=jnp, nnx=nnx, **{c.__name__: c for c in classes})


def __getattr__(name: str):  # PEP 562: `models.FlaxGPT` imports JAX on first touch, not at import
    if name in ("FlaxAttention", "FlaxMLP", "FlaxBlock", "FlaxGPT"):
        return getattr(_flax(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FLAX_LEAF = {  # Flax module type -> torch leaf name -> (Flax attribute, transposed?)
    "Linear": {"weight": ("kernel", True), "bias": ("bias", False)},
    "LayerNorm": {"weight": ("scale", False), "bias": ("bias", False)},
    "Embed": {"weight": ("embedding", False)},
}


def _flax_param(model, name: str):
    """The Flax variable behind a torch name: ``blocks.1.attn.qkv.weight`` -> ``blocks[1].attn.qkv.kernel``."""
    *path, leaf = name.split(".")
    module = model
    for part in path:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    attr, transposed = _FLAX_LEAF[type(module).__name__][leaf]
    return getattr(module, attr), transposed


def flax_load_(model, weights: dict[str, np.ndarray]):
    """Copy torch-named NumPy weights into a ``FlaxGPT`` in place, as plain (unsharded) ``jnp`` arrays."""
    jnp = _flax().jnp
    for name, w in weights.items():
        param, transposed = _flax_param(model, name)
        w = w.T if transposed else w
        if (want := param.get_value().shape) != w.shape:
            raise ValueError(f"{name}: weights {w.shape} (Flax layout) vs model {want}; build both from one GPTConfig")
        param.set_value(jnp.asarray(w, dtype=jnp.float32))
    return model


def flax_gpt(cfg: GPTConfig = GPTConfig(), seed: int = 0):
    """A ``FlaxGPT`` holding ``init_weights(cfg, seed)``.

    Built with ``nnx.eval_shape``, JAX's meta device: Flax's own random init is traced for shapes but
    never run (it would compile a program per shape, seconds on CPU), then every parameter is filled.
    """
    fx = _flax()
    return flax_load_(fx.nnx.eval_shape(lambda: fx.FlaxGPT(cfg, rngs=fx.nnx.Rngs(seed))), init_weights(cfg, seed))


def flax_to_numpy_weights(model) -> dict[str, np.ndarray]:
    """Float32 NumPy copies of a ``FlaxGPT``'s parameters, by torch name and in torch layout."""
    out = {}
    for name in weight_shapes(model.cfg):
        param, transposed = _flax_param(model, name)
        w = np.array(param.get_value(), dtype=np.float32)  # to host first: a .T in JAX would compile a program
        out[name] = np.ascontiguousarray(w.T) if transposed else w
    return out
