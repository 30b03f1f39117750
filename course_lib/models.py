"""A tiny decoder-only transformer (GPT-2 shaped) in PyTorch and in Flax NNX, from the same weights.

Same numbers in both frameworks, so a lab can end with "sharded run == single-device run" whichever
framework sharded it. Weights are born in NumPy (:func:`init_weights`) under the *torch* ``state_dict``
names. Flax differs only in names and layout: ``nn.Linear.weight`` [out, in] is ``nnx.Linear.kernel``
[in, out], ``LayerNorm.weight`` is ``scale``, ``Embedding.weight`` is ``embedding``. The maths is matched:
exact (erf) GELU, LayerNorm eps 1e-5 with two-pass variance, attention scaled by 1/sqrt(head_dim).
Dropout sits where GPT-2 puts it but defaults to 0, because the frameworks draw different masks.

JAX is imported lazily: a JAX lab sets ``--xla_force_host_platform_device_count`` before the first
``import jax``, so importing this module must not. :func:`_flax` defines the Flax classes on first use;
``models.FlaxGPT`` (PEP 562 ``__getattr__``) and :func:`flax_gpt` reach them. They are kept out of
``__all__`` so that ``from course_lib.models import *`` stays JAX-free.
"""
from __future__ import annotations

import functools
import math
import types
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "GPTConfig", "param_count", "weight_shapes", "init_weights",
    "TorchGPT", "Block", "CausalSelfAttention", "MLP", "torch_gpt", "torch_init_", "loss_fn",
    "to_numpy_weights", "flax_gpt", "flax_load_", "flax_to_numpy_weights",
]

LN_EPS = 1e-5    # torch's nn.LayerNorm default; Flax's default is 1e-6, so Flax is told explicitly
INIT_STD = 0.02  # GPT-2's std for every matrix and embedding


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the tiny GPT. The defaults are awkward on purpose, so that sharding has to pad."""

    vocab_size: int = 67  #: prime: tok_emb and head rows pad at every world size > 1
    seq_len: int = 30     #: longest context, the rows of pos_emb; 30 pads at world size 4 and 8
    d_model: int = 66     #: 2·3·11 pads at 4 and 8; head_dim = 66 / 3 = 22
    n_heads: int = 3      #: must divide d_model
    n_layers: int = 3
    d_ff: int = 198       #: 3·d_model, not GPT-2's 4·d_model: 264 = 8·33 would shard evenly at 8
    dropout: float = 0.0  #: 0 so that torch and Flax agree (their masks come from different RNGs)

    def __post_init__(self):
        sizes = {k: getattr(self, k) for k in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")}
        bad = {k: v for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"GPTConfig sizes must be positive ints, got {bad}; e.g. GPTConfig(d_model=66, n_heads=3)")
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0]
            raise ValueError(
                f"d_model({self.d_model}) % n_heads({self.n_heads}) = {self.d_model % self.n_heads}, but attention "
                f"splits d_model evenly across heads; pick n_heads from the divisors of {self.d_model}: {divisors}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout({self.dropout}) must be in [0, 1); use 0.0 to compare torch with Flax")


def param_count(cfg: GPTConfig) -> int:
    """Number of parameters, by formula (the tests check it against the torch model)."""
    V, T, C, F_, L = cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.d_ff, cfg.n_layers
    attn = (C * 3 * C + 3 * C) + (C * C + C)  # qkv + proj, with biases
    mlp = (C * F_ + F_) + (F_ * C + C)        # fc + proj, with biases
    block = 2 * 2 * C + attn + mlp            # two LayerNorms (weight + bias), attention, MLP
    return V * C + T * C + L * block + 2 * C + C * V  # tok_emb, pos_emb, blocks, ln_f, head (no bias)


def weight_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Torch ``state_dict`` name -> shape, in ``state_dict`` order (the tests hold it to the torch model)."""
    V, T, C, F_ = cfg.vocab_size, cfg.seq_len, cfg.d_model, cfg.d_ff
    per_block = {"ln1": (C,), "attn.qkv": (3 * C, C), "attn.proj": (C, C),  # weights, torch [out, in];
                 "ln2": (C,), "mlp.fc": (F_, C), "mlp.proj": (C, F_)}       # each has a bias [out] too
    shapes = {"tok_emb.weight": (V, C), "pos_emb.weight": (T, C)}
    for i in range(cfg.n_layers):
        for layer, shape in per_block.items():
            shapes[f"blocks.{i}.{layer}.weight"], shapes[f"blocks.{i}.{layer}.bias"] = shape, shape[:1]
    return {**shapes, "ln_f.weight": (C,), "ln_f.bias": (C,), "head.weight": (V, C)}


def init_weights(cfg: GPTConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 initial weights by torch name: N(0, 0.02) matrices, zero biases, unit LayerNorm weights.

    Each tensor has its own stream, seeded by ``(seed, crc32(name))``: adding a layer leaves the rest unchanged.
    """
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        elif name.split(".")[-2].startswith("ln"):
            out[name] = np.ones(shape, np.float32)
        else:
            rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
            out[name] = INIT_STD * rng.standard_normal(shape, dtype=np.float32)
    return out


# ---------------------------------------------------------------------------------------------- torch
class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)  # q, k, v of all heads in one matmul
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels
        q, k, v = self.qkv(x).split(C, dim=2)                                              # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))  # 3 x [B, H, T, hd]
        p = self.dropout if self.training else 0.0  # SDPA does not look at .training itself
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)      # [B, H, T, hd]
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))         # heads side by side


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # exact erf GELU; [B, T, C] -> [B, T, d_ff] -> [B, T, C]


class Block(nn.Module):
    """Pre-LN transformer block (GPT-2): x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model, eps=LN_EPS), CausalSelfAttention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model, eps=LN_EPS), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TorchGPT(nn.Module):
    """The GPT in torch, from standard layers only, so every submodule has a ``reset_parameters()``.

    Meta-device build: ``with torch.device("meta"): m = TorchGPT(cfg)``, ``m.to_empty(device=d)``, then
    ``m.reset_parameters(seed)`` (= ``torch_init_(m, cfg, seed)``) gives exactly ``torch_gpt(cfg, seed)``.
    Careful: ``for x in m.modules(): x.reset_parameters()`` visits the root first, then the layers
    overwrite it with nn's own random init; ``m.apply(...)`` visits the root last and is fine.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)  # untied from tok_emb: one owner per tensor

    def reset_parameters(self, seed: int = 0) -> None:
        torch_init_(self, self.cfg, seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape  # batch, time
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length T({T}) > cfg.seq_len({self.cfg.seq_len}); crop idx or raise seq_len")
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(T, device=idx.device)))  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # [B, T, V]


def torch_init_(model: nn.Module, cfg: GPTConfig, seed: int = 0) -> nn.Module:
    """Copy ``init_weights(cfg, seed)`` into ``model`` in place, on whatever device it lives. A DTensor
    (after ``fully_shard``) gets just its shard, cut locally: every rank can compute the full tensor."""
    weights, params = init_weights(cfg, seed), dict(model.named_parameters())
    if params.keys() != weights.keys():
        raise ValueError(f"model does not match cfg={cfg}: missing {sorted(weights.keys() - params.keys())}, "
                         f"unexpected {sorted(params.keys() - weights.keys())}; build the model from the same cfg")
    from torch.distributed.tensor import DTensor, distribute_tensor  # here, not on top: ~0.6 s to import
    with torch.no_grad():
        for name, p in params.items():
            full = torch.from_numpy(weights[name])
            if isinstance(p, DTensor):
                full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(full)
    return model


def torch_gpt(cfg: GPTConfig = GPTConfig(), seed: int = 0) -> TorchGPT:
    """A :class:`TorchGPT` holding ``init_weights(cfg, seed)``."""
    return torch_init_(TorchGPT(cfg), cfg, seed)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over every position: logits [B, T, V], targets [B, T]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def to_numpy_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """Float32 copies of the parameters by torch name. DTensors are gathered, so every rank must call."""
    from torch.distributed.tensor import DTensor
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", torch.float32).numpy().copy()
            for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------- Flax NNX
@functools.cache
def _flax() -> types.SimpleNamespace:
    """Import JAX and define the Flax twins of the torch classes, once (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

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
            return self.drop(self.proj(jax.nn.gelu(self.fc(x), approximate=False)), rngs=rngs)  # exact, like F.gelu

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
