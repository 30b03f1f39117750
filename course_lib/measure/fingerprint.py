"""A fingerprint of a tensor's exact bits, to tell whether ranks that should hold the same parameter do.

Replicas drift apart silently: a rank initialised from another seed, a broadcast that was forgotten, a
non-deterministic kernel. Comparing the parameters themselves across ranks would move the whole model; a
fingerprint per parameter is 8 bytes, so every rank's fingerprints travel in **one** all-gather.

A float sum is no fingerprint: two swapped elements, or a change below the sum's rounding, give the same sum.
:func:`fingerprint` reads the tensor's bits as integers and weights each by its position (int64 arithmetic wraps
around the same way everywhere, so equal tensors give equal fingerprints on every rank and machine), so a single
flipped bit or two swapped elements change it. It is a checksum, not a cryptographic hash: two different tensors
can collide, with a chance of about 2^-64 for random differences.

Meant for *replicated* tensors (DP, and the replicate dim of HSDP): an FSDP shard differs from rank to rank by
design, so :func:`fingerprints` of a DTensor reads its local shard, which is only comparable within a replicate group.
"""
from __future__ import annotations

import torch

__all__ = ["fingerprint", "fingerprints"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: torch.Tensor) -> int:
    """An int64 checksum of ``t``'s bits (and its size), the same for bit-identical tensors on every rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fingerprint() takes a tensor, got {type(t).__name__}")
    t = getattr(t, "_local_tensor", t).detach().contiguous().reshape(-1)
    if t.dtype not in (torch.bool,) and t.element_size() in _INT_OF_SIZE:
        bits = t.view(_INT_OF_SIZE[t.element_size()]).to(torch.int64)
    else:
        bits = t.to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64) * 0x9E3779B1   # position matters
    h = int((bits * weights).sum()) if bits.numel() else 0
    return h ^ (bits.numel() << 8) ^ t.element_size()     # no hash(): Python salts it per process


def fingerprints(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """``(names, fps)``: every parameter's name in ``model.named_parameters()`` order, and a 1-D int64 tensor of
    their fingerprints, ready for one ``all_gather_into_tensor`` (or ``all_gather``)."""
    names, fps = [], []
    for name, p in model.named_parameters():
        names.append(name)
        fps.append(fingerprint(p))
    return names, torch.tensor(fps, dtype=torch.int64)
