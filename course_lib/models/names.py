"""Canonical names: the course GPT's torch ``state_dict`` names and layout, and adapters from other models' names.

Every consolidated file (:mod:`~course_lib.checkpoint.safetensors`) is written under the names of
:func:`~course_lib.models.config.weight_shapes` (``blocks.0.attn.qkv.weight`` [3C, C], torch's [out, in]).
A source with other names reaches them in two steps (:func:`adapt`): ``names`` renames tensor by tensor, then
``transform`` reshapes the set -- :func:`fuse_qkv` for a model that keeps q, k and v apart (as a tensor-parallel
model does, each column-sharded on its own), :func:`split_qkv` the way back. :func:`flax_to_torch_names` turns
Flax NNX names and layout (``kernel`` [in, out]) into torch's. Pure NumPy (torch tensors pass through).
"""
from __future__ import annotations

import re

import numpy as np

__all__ = ["adapt", "flax_to_torch_names", "fuse_qkv", "split_qkv"]

_QKV = re.compile(r"^(.*\battn)\.(q|k|v|qkv)\.(weight|bias)$")   # prefix, which part, weight or bias


def flax_to_torch_names(weights: dict) -> dict:
    """Flax NNX names and layout -> torch's: ``kernel`` [in, out] -> ``weight`` [out, in] (transposed),
    ``scale`` and ``embedding`` -> ``weight``; ``bias`` stays. Any model built from nnx.Linear/LayerNorm/Embed."""
    out = {}
    for k, w in weights.items():
        stem, _, leaf = k.rpartition(".")
        w = np.asarray(w)
        out[f"{stem}.{ {'kernel': 'weight', 'scale': 'weight', 'embedding': 'weight'}.get(leaf, leaf)}"] = (
            np.ascontiguousarray(w.T) if leaf == "kernel" else w)
    return out


def fuse_qkv(weights: dict) -> dict:
    """``...attn.q/k/v.{weight,bias}`` -> ``...attn.qkv.{weight,bias}``, concatenated along dim 0 (rows q, then
    k, then v: the course GPT's fused layout). Other tensors pass through; a lone q without k or v is refused."""
    out, parts = {}, {}
    for k, w in weights.items():
        m = _QKV.match(k)
        if m and m[2] != "qkv":
            parts.setdefault((m[1], m[3]), {})[m[2]] = w
        else:
            out[k] = w
    for (stem, leaf), qkv in parts.items():
        if set(qkv) != {"q", "k", "v"}:
            raise ValueError(f"fuse_qkv: {stem}.{{q,k,v}}.{leaf} needs all three, found only {sorted(qkv)}")
        rows = {p: tuple(np.shape(qkv[p])) for p in "qkv"}
        if len(set(rows.values())) != 1:
            raise ValueError(f"fuse_qkv: {stem}.q/k/v.{leaf} shapes differ: {rows}; q, k and v must match")
        if isinstance(qkv["q"], np.ndarray):
            out[f"{stem}.qkv.{leaf}"] = np.concatenate([qkv[p] for p in "qkv"], 0)
        else:
            import torch
            out[f"{stem}.qkv.{leaf}"] = torch.cat([qkv[p] for p in "qkv"], 0)
    return out


def split_qkv(weights: dict) -> dict:
    """The inverse of :func:`fuse_qkv`: ``...attn.qkv.*`` [3C, ...] -> ``...attn.q/k/v.*`` [C, ...] each."""
    out = {}
    for k, w in weights.items():
        m = _QKV.match(k)
        if not (m and m[2] == "qkv"):
            out[k] = w
            continue
        if w.shape[0] % 3:
            raise ValueError(f"split_qkv: {k} has {w.shape[0]} rows, not a multiple of 3 (q, k, v)")
        c = w.shape[0] // 3
        for i, p in enumerate("qkv"):
            out[f"{m[1]}.{p}.{m[3]}"] = w[i * c:(i + 1) * c]
    return out


def adapt(weights: dict, names=None, transform=None) -> dict:
    """Rename by ``names`` (a dict: listed names change, the rest stay; or a ``str -> str`` function), then
    apply ``transform`` (a ``dict -> dict`` function such as :func:`fuse_qkv`) to the whole set."""
    if isinstance(names, dict):
        weights = {names.get(k, k): w for k, w in weights.items()}
    elif callable(names):
        weights = {names(k): w for k, w in weights.items()}
    return transform(weights) if transform else weights
