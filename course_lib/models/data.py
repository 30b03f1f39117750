"""A synthetic token task: a sparse random Markov chain. Deterministic, learnable, nothing downloaded.

Each token has 2 or 3 possible successors with seeded random probabilities. A sequence starts at a
uniformly random token and walks the chain. A model that has learnt the chain cannot do better than
the chain's own uncertainty, so :meth:`TokenTask.entropy_floor` is the exact loss to aim for. The
default GPT (V=67, T=30) falls from ln(67) = 4.2 to within ~0.2 nats of the floor (0.68) in ~50 Adam
steps of 32 sequences at lr 5e-3; the last ~0.05 nats take hundreds more.

Data parallel needs every rank to see its own part of *one* global batch, so that N ranks on slices
equal one process on the whole: :meth:`TokenTask.global_batch` depends only on ``(seed, step)``, and
:meth:`TokenTask.rank_batch` is rank ``r``'s contiguous rows of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["TokenTask"]

MAX_SUCCESSORS = 3  # 2 or 3 next tokens: quick to learn, and a floor far below ln(V)
CONCENTRATION = 1.0  # Dirichlet alpha: 1 is uniform over the simplex, so some successors are rare, some dominant
_STRUCTURE, _BATCH = 0, 1  # stream tags: the chain and the batches never share random numbers


@dataclass(frozen=True)
class TokenTask:
    """Sequences from a fixed sparse Markov chain over ``vocab_size`` tokens."""

    vocab_size: int  #: V, should equal the model's GPTConfig.vocab_size
    seq_len: int     #: T, tokens per input row; the sampled rows are T + 1 long before the shift
    seed: int = 0    #: fixes the chain and every batch
    successors: np.ndarray = field(init=False, repr=False, compare=False)  #: [V, K] next-token ids
    probs: np.ndarray = field(init=False, repr=False, compare=False)       #: [V, K] their probabilities

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"TokenTask.{name} must be an int, got {value!r}")
        if self.vocab_size < MAX_SUCCESSORS or self.seq_len < 1 or self.seed < 0:
            raise ValueError(f"TokenTask(vocab_size={self.vocab_size}, seq_len={self.seq_len}, seed={self.seed}) "
                             f"needs vocab_size >= {MAX_SUCCESSORS}, seq_len >= 1, seed >= 0")
        V, K = self.vocab_size, MAX_SUCCESSORS
        rng = np.random.default_rng([self.seed, _STRUCTURE])
        successors = np.stack([rng.choice(V, size=K, replace=False) for _ in range(V)])  # [V, K] distinct
        probs = rng.dirichlet(np.full(K, CONCENTRATION), size=V)                          # [V, K]
        probs[rng.random(V) < 0.5, -1] = 0.0  # about half the tokens have only 2 successors
        probs /= probs.sum(axis=1, keepdims=True)
        # frozen dataclass: derived fields are set once here, and read-only so no one edits the chain
        for name, value in (("successors", successors), ("probs", probs)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    def transition_matrix(self) -> np.ndarray:
        """P[i, j] = probability that token j follows token i; [V, V], rows sum to 1."""
        P = np.zeros((self.vocab_size, self.vocab_size))
        P[np.arange(self.vocab_size)[:, None], self.successors] = self.probs  # successors are distinct
        return P

    def entropy_floor(self) -> float:
        """The lowest achievable mean cross entropy (nats) of ``y`` given ``x``, averaged as training does.

        The chain is Markov, so the best prediction at position t uses only x[t]: its loss is the
        entropy H_i of row i of P, weighted by how likely x[t] = i is. x[0] is uniform, so that
        distribution is u·P^t, and the floor is the mean over t = 0..T-1 of (u·P^t)·H.
        """
        P = self.transition_matrix()
        with np.errstate(divide="ignore", invalid="ignore"):
            H = -np.where(P > 0, P * np.log(P), 0.0).sum(axis=1)  # [V] entropy of each row
        dist, total = np.full(self.vocab_size, 1.0 / self.vocab_size), 0.0
        for _ in range(self.seq_len):
            total += dist @ H
            dist = dist @ P
        return float(total / self.seq_len)

    def global_batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and targets ``(x, y)``, int64 [B, T] each, a function of ``(seed, step)`` only.

        ``y[:, t] = x[:, t + 1]`` in the sampled row: the target is always the next token.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step({step!r}) must be an int >= 0; steps index the batch stream")
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size({batch_size!r}) must be an int >= 1")
        rng = np.random.default_rng([self.seed, _BATCH, step])
        cdf = np.cumsum(self.probs, axis=1)[:, :-1]  # [V, K-1] inner boundaries of the inverse-CDF sampler
        last = (self.probs > 0).sum(axis=1) - 1      # [V] a cdf summing to 0.9999999 must not pick a 0-prob slot
        tokens = np.empty((batch_size, self.seq_len + 1), dtype=np.int64)  # [B, T + 1]
        tokens[:, 0] = rng.integers(0, self.vocab_size, size=batch_size)
        for t in range(self.seq_len):
            cur = tokens[:, t]                                          # [B]
            u = rng.random(batch_size)[:, None]                         # [B, 1]
            pick = np.minimum((u >= cdf[cur]).sum(axis=1), last[cur])  # [B] which successor
            tokens[:, t + 1] = self.successors[cur, pick]
        return tokens[:, :-1].copy(), tokens[:, 1:].copy()

    def rank_batch(self, step: int, batch_size: int, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Rank ``rank``'s contiguous ``batch_size // world_size`` rows of ``global_batch(step, batch_size)``.

        Concatenating every rank's slice in rank order gives the global batch back exactly, so a mean
        loss averaged over ranks equals the global mean loss (equal slice sizes).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank({rank}) must be in [0, world_size({world_size})) and world_size >= 1")
        if batch_size % world_size:
            down, up = batch_size // world_size * world_size, -(-batch_size // world_size) * world_size
            nearest = [down, up] if down else [up]
            raise ValueError(
                f"batch_size({batch_size}) % world_size({world_size}) = {batch_size % world_size}: ranks need equal "
                f"slices for their mean losses to average to the global mean; use batch_size "
                + " or ".join(map(str, nearest)))
        x, y = self.global_batch(step, batch_size)
        per_rank = batch_size // world_size
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        return x[rows].copy(), y[rows].copy()
