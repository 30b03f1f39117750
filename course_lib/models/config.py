"""The course GPT's sizes and its weights, born in NumPy so that torch and Flax start from the same numbers.

Weights carry the *torch* ``state_dict`` names; :mod:`~course_lib.models.flax_gpt` maps them to Flax's
names and layout. Each tensor has its own random stream, so adding a layer leaves the rest unchanged.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["GPTConfig", "LAB_CONFIG", "param_count", "weight_shapes", "init_weights", "LN_EPS", "INIT_STD"]

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


#: The labs' GPT (Labs 03, 04, 06-08): d_ff = 199 and seq_len = 31 are primes, so every sharding pads.
LAB_CONFIG = GPTConfig(seq_len=31, d_ff=199)
