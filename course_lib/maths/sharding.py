"""Sharding maths: who owns which slice of every parameter, and how much of it is padding.

Pure arithmetic -- no process group, no torch, no JAX -- so it is tested with plain pytest and used
the same way by the torch labs, the JAX labs and the ownership widget.

Vocabulary (defined here once; ``costs``, ``memory``, the strategies and the labs use these words):

* **world** ``N`` -- the number of ranks a parameter is sharded over (the *sharding factor*; in HSDP
  it is the size ``F`` of the shard axis, not the whole world).
* **unsharded parameter** -- the full tensor as the model sees it (``numel`` real elements).
* **padding** -- zeros appended so that every rank's piece has the same size; collectives need equal
  sizes. ``padded_size(n, N) = ceil(n / N) * N``.
* **sharded parameter** -- the piece one rank keeps between uses: ``padded_size / N`` elements, some of
  which may be padding. It is also the **all-gather input**.
* **all-gather output** -- the padded unsharded buffer every rank holds after the all-gather
  (``padded_size`` elements); strip the padding to get the unsharded parameter back. The gradient
  goes the other way: the padded full gradient is the **reduce-scatter input**, a rank's gradient
  shard its output.

Two layouts, as the two generations of PyTorch FSDP do it:

* :func:`flat_layout` -- FSDP1 and our from-scratch FSDP (the FSDP paper's ``FlatParameter``): the
  tensors of one unit are flattened and concatenated, then padded *at the end* to a multiple of ``N``;
  rank ``r`` owns the contiguous range ``[r*S, (r+1)*S)``, which may cut tensors in two.
* :func:`dim0_layout` -- FSDP2 / DTensor ``Shard(0)``: each parameter is split on dim 0 with
  ``torch.chunk`` semantics (chunks of ``ceil(d0/N)`` rows, so the last ranks may get fewer rows or
  none) and every chunk is padded to the same number of rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "padded_size", "shard_bounds", "flat_layout", "dim0_layout",
    "ShardBounds", "Piece", "FlatShard", "FlatLayout", "RowShard", "Dim0Layout",
]


def _check_world(world: int) -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world={world!r} must be an int >= 1 (the number of ranks sharing the parameter)")


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0 (a number of elements)")


def padded_size(n: int, world: int) -> int:
    """``ceil(n / world) * world``: the smallest multiple of ``world`` that holds ``n`` elements."""
    _check_count("n", n)
    _check_world(world)
    return -(-n // world) * world


@dataclass(frozen=True)
class ShardBounds:
    """Rank ``rank``'s slice ``[start, stop)`` of a padded flat buffer of ``padded_size(n, world)``."""

    rank: int
    start: int      #: first index in the padded flat buffer
    stop: int       #: one past the last index
    real: int       #: elements of ``[start, stop)`` that are real (index < n)
    padding: int    #: elements of ``[start, stop)`` that are padding

    @property
    def size(self) -> int:
        """Elements this rank holds: the same on every rank, ``padded_size / world``."""
        return self.stop - self.start


def shard_bounds(n: int, world: int, rank: int) -> ShardBounds:
    """Where rank ``rank``'s shard of an ``n``-element flat buffer lies, and how much is padding.

    >>> shard_bounds(10, 4, 3)   # padded to 12, shards of 3: rank 3 holds [9, 12) = 1 real + 2 pad
    ShardBounds(rank=3, start=9, stop=12, real=1, padding=2)
    """
    size = padded_size(n, world) // world
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} must be an int in [0, world={world})")
    start, stop = rank * size, (rank + 1) * size
    real = max(0, min(stop, n) - start)
    return ShardBounds(rank=rank, start=start, stop=stop, real=real, padding=size - real)


@dataclass(frozen=True)
class Piece:
    """A contiguous part of one tensor that lands in one rank's flat shard."""

    tensor: int         #: index of the tensor in the unit
    tensor_start: int   #: first element, counted in the flattened tensor
    tensor_stop: int    #: one past the last element
    shard_start: int    #: where it starts inside the rank's shard

    @property
    def numel(self) -> int:
        return self.tensor_stop - self.tensor_start


@dataclass(frozen=True)
class FlatShard:
    """What one rank owns of a flat parameter: the pieces of real tensors, then padding."""

    rank: int
    start: int                  #: first index in the padded flat buffer
    stop: int                   #: one past the last index
    pieces: tuple[Piece, ...]   #: in flat order
    padding: int                #: trailing padding elements in this shard

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class FlatLayout:
    """A unit's tensors concatenated into one flat buffer, padded at the end, split into ``world`` shards."""

    numels: tuple[int, ...]     #: elements of each tensor, in order
    world: int
    offsets: tuple[int, ...]    #: where each tensor starts in the flat buffer
    shards: tuple[FlatShard, ...]

    @property
    def numel(self) -> int:
        """Real elements: the sum of ``numels``."""
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        """The all-gather output size in elements: ``padded_size(numel, world)``."""
        return padded_size(self.numel, self.world)

    @property
    def shard_size(self) -> int:
        return self.padded_numel // self.world

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def flat_layout(numels, world: int) -> FlatLayout:
    """Lay out tensors of ``numels`` elements as one flat parameter sharded over ``world`` ranks.

    >>> [[(p.tensor, p.tensor_start, p.tensor_stop) for p in s.pieces] for s in flat_layout([5, 2], 3).shards]
    [[(0, 0, 3)], [(0, 3, 5), (1, 0, 1)], [(1, 1, 2)]]
    """
    numels = tuple(numels)
    for i, n in enumerate(numels):
        _check_count(f"numels[{i}]", n)
    _check_world(world)
    offsets, total = [], 0
    for n in numels:
        offsets.append(total)
        total += n
    shards = []
    for rank in range(world):
        b = shard_bounds(total, world, rank)
        pieces = []
        for i, (off, n) in enumerate(zip(offsets, numels)):
            lo, hi = max(off, b.start), min(off + n, b.stop)
            if lo < hi:  # this tensor overlaps the shard; zero-numel tensors never do
                pieces.append(Piece(tensor=i, tensor_start=lo - off, tensor_stop=hi - off, shard_start=lo - b.start))
        shards.append(FlatShard(rank=rank, start=b.start, stop=b.stop, pieces=tuple(pieces), padding=b.padding))
    return FlatLayout(numels=numels, world=world, offsets=tuple(offsets), shards=tuple(shards))


@dataclass(frozen=True)
class RowShard:
    """Rank ``rank``'s rows ``[row_start, row_stop)`` of a dim-0 sharded parameter."""

    rank: int
    row_start: int
    row_stop: int
    padding_rows: int   #: rows of padding FSDP2 appends so every rank holds the same number

    @property
    def rows(self) -> int:
        """Real rows this rank owns (may be 0: ``torch.chunk`` makes fewer chunks than ranks)."""
        return self.row_stop - self.row_start


@dataclass(frozen=True)
class Dim0Layout:
    """A parameter split on dim 0 as FSDP2 does it (``torch.chunk``, then pad each chunk)."""

    shape: tuple[int, ...]
    world: int
    chunk_rows: int             #: ``ceil(d0 / world)``, rows every padded shard holds
    shards: tuple[RowShard, ...]

    @property
    def row_numel(self) -> int:
        """Elements per row: the product of ``shape[1:]``."""
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def padded_numel(self) -> int:
        """The all-gather output size in elements: ``ceil(d0/world) * world * prod(shape[1:])``."""
        return self.chunk_rows * self.world * self.row_numel

    @property
    def shard_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def dim0_layout(shape, world: int) -> Dim0Layout:
    """Split a parameter of ``shape`` on dim 0 over ``world`` ranks, FSDP2 style.

    >>> [(s.row_start, s.row_stop, s.padding_rows) for s in dim0_layout((12, 3), 8).shards][5:]
    [(10, 12, 0), (12, 12, 2), (12, 12, 2)]
    """
    shape = tuple(shape)
    _check_world(world)
    if not shape:
        raise ValueError("shape=() is a scalar: dim-0 sharding needs at least one dimension; "
                         "reshape it to (1,) or keep it replicated")
    for i, d in enumerate(shape):
        _check_count(f"shape[{i}]", d)
    d0 = shape[0]
    chunk = -(-d0 // world)
    shards = []
    for rank in range(world):
        lo, hi = min(rank * chunk, d0), min((rank + 1) * chunk, d0)
        shards.append(RowShard(rank=rank, row_start=lo, row_stop=hi, padding_rows=chunk - (hi - lo)))
    return Dim0Layout(shape=shape, world=world, chunk_rows=chunk, shards=tuple(shards))
