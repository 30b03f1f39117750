"""Who owns which slice of every parameter: the data behind the ownership widget.

Pure data, no drawing and no ipywidgets (``widgets.show_ownership`` draws it). Four ways in, one
result, an :class:`OwnershipSpec`:

* :func:`what_if` -- a description: parameter shapes, ``world_size`` (or an HSDP ``mesh_shape``),
  a strategy (``dp``, ``zero1``, ``zero2``, ``zero3``, ``fsdp``, ``hsdp``). Nothing runs.
* :func:`describe_flat` -- our from-scratch FSDP's flat units (lab 03): the FSDP paper's FlatParameter.
* :func:`course_lib.measure.ownership.describe_torch` -- a real FSDP2 model, called ON A RANK inside
  ``course_lib.run``: reads every DTensor's placements and mesh; returns plain picklable data.
* :func:`course_lib.measure.ownership.describe_jax` -- a pytree of ``jax.Array`` (e.g.
  ``nnx.state(model)``), from each array's ``sharding.devices_indices_map``.

Vocabulary is :mod:`course_lib.maths.sharding`'s. A **bar** is one parameter (``dim0`` layout, FSDP2) or one
flat unit (``flat`` layout, FSDP1 / ZeRO / ours). Its **slices** tile the *padded* buffer in order; each
slice has ``owners`` (the ranks holding it: one rank when fully sharded, several when replicated,
the replicate group in HSDP), ``start:stop`` in padded elements, how many of those are ``real`` and
how many ``padding``, and ``where`` -- the exact ranges in the real tensor(s): per-dimension
``(lo, hi)`` for a parameter, ``(member, lo, hi)`` flat element ranges for a flat unit.
``sharded`` says which model states (parameters, gradients, optimizer state) use the layout; the
others are replicated (ZeRO-1 shards only the optimizer state, DP nothing).

Longer than ~300 lines: one data type (:class:`OwnershipSpec`) and the constructors that build it
from a description, kept together so the vocabulary above is defined once.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from course_lib.maths.memory import PRECISIONS
from course_lib.maths.sharding import flat_layout
from course_lib.maths.strategy import STATES, STRATEGIES

__all__ = ["owners_label", "Slice", "Bar", "RankMemory", "OwnershipSpec", "what_if", "describe_flat", "grid_bar",
           "OWNERSHIP_STRATEGIES", "STATES"]

#: The strategies :func:`what_if` draws: every row of :mod:`course_lib.maths.strategy`'s table.
OWNERSHIP_STRATEGIES = tuple(STRATEGIES)


def owners_label(owners, ranks=None) -> str:
    """``"2"``, ``"0,2"`` or ``"all 8"`` (every rank holds it: replicated)."""
    owners = tuple(owners)
    if ranks is not None and len(owners) > 2 and set(owners) == set(ranks):
        return f"all {len(owners)}"
    return ",".join(map(str, owners))


@dataclass(frozen=True)
class Slice:
    """One contiguous stretch of a bar's padded buffer and the ranks that hold it."""

    owners: tuple[int, ...]     #: ranks (or JAX device ids) holding this slice
    start: int                  #: first element in the padded buffer
    stop: int                   #: one past the last
    real: int                   #: real elements in [start, stop)
    padding: int                #: padding elements in [start, stop)
    where: tuple = ()           #: ((lo, hi) per dim) for a parameter; ((member, lo, hi), ...) for a flat unit

    @property
    def size(self) -> int:
        return self.stop - self.start

    def describe(self, bar: "Bar") -> str:
        """``rows 3:6 of (11, 7)`` -- the exact ranges, as a learner would index them."""
        if bar.members:
            parts = [f"{m}[{lo}:{hi}]" for m, lo, hi in self.where] or ["(no real elements)"]
            text = " + ".join(parts)
        elif self.where:
            text = f"[{', '.join(f'{lo}:{hi}' for lo, hi in self.where)}] of {tuple(bar.shape)}"
        else:
            text = "(empty)"
        if not self.real:
            text = "no real elements"
        return text + (f" + {self.padding} padding" if self.padding else "")


@dataclass(frozen=True)
class Bar:
    """One parameter (``members == ()``) or one flat unit (``members`` = its tensors)."""

    name: str
    shape: tuple[int, ...]      #: the parameter's shape; ``(numel,)`` for a flat unit
    numel: int                  #: real elements
    padded_numel: int           #: elements of the padded buffer (the all-gather output)
    slices: tuple[Slice, ...]
    members: tuple[tuple[str, tuple[int, ...]], ...] = ()   #: flat unit: (name, shape) in flat order
    itemsize: int = 4

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def held_by(self, rank: int) -> int:
        """Elements (padding included: it is allocated) of the sharded buffer that ``rank`` holds."""
        return sum(s.size for s in self.slices if rank in s.owners)


@dataclass(frozen=True)
class RankMemory:
    """Model-state bytes on one rank, as the layout allocates them (padding included)."""

    rank: int
    params: float
    grads: float
    optimizer: float
    padding: float      #: bytes of the three above that are padding

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class OwnershipSpec:
    """Everything the ownership widget draws; plain data (pickles, compares, prints)."""

    source: str                 #: "what_if", "flat", "torch" or "jax"
    strategy: str               #: one of OWNERSHIP_STRATEGIES, or "jax"
    world_size: int
    bars: tuple[Bar, ...]
    ranks: tuple[int, ...]      #: every rank / device id that appears
    mesh_shape: tuple[int, ...] | None = None
    mesh_axes: tuple[str, ...] | None = None
    layout: str = "dim0"        #: "dim0", "flat" or "block" (JAX: any dims)
    precision: str = "fp32"     #: bytes per element for memory(): memory.PRECISIONS
    sharded: tuple[bool, bool, bool] = (True, True, True)   #: params, grads, optimizer
    inputs: dict | None = field(default=None, compare=False)  #: what_if's arguments, so controls can redraw
    notes: tuple[str, ...] = ()

    def bar(self, name: str) -> Bar:
        for b in self.bars:
            if b.name == name:
                return b
        raise KeyError(f"no parameter or unit named {name!r}; have {[b.name for b in self.bars]}")

    def slices_of(self, rank: int) -> list[tuple[str, Slice]]:
        """(bar name, slice) for every slice ``rank`` holds."""
        return [(b.name, s) for b in self.bars for s in b.slices if rank in s.owners]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.bars)

    def memory(self) -> list[RankMemory]:
        """Per-rank bytes of parameters, gradients and Adam state (``precision``'s bytes per element).

        A sharded state costs what the rank holds of the padded buffer; a replicated one the real numel.
        """
        per = PRECISIONS[self.precision]
        out = []
        for r in self.ranks:
            held = sum(b.held_by(r) for b in self.bars)
            pad = sum(s.padding for b in self.bars for s in b.slices if r in s.owners)
            elems = [held if sh else self.numel for sh in self.sharded]
            padding = sum(pad * nb for sh, nb in zip(self.sharded, per) if sh)
            out.append(RankMemory(r, *(float(e * nb) for e, nb in zip(elems, per)), float(padding)))
        return out

    def summary(self, max_bars: int = 12) -> str:
        """A plain-text view: the header, each bar's slices with their exact ranges, memory per rank."""
        mesh = f", mesh {self.mesh_shape} {self.mesh_axes or ''}" if self.mesh_shape else ""
        states = ", ".join(s for s, sh in zip(STATES, self.sharded) if sh) or "nothing"
        who = "devices" if self.source == "jax" else "ranks"
        lines = [f"{self.strategy} over {self.world_size} {who}{mesh}, {self.layout} layout ({self.source}); "
                 f"sharded: {states}; {self.numel:,} elements in {len(self.bars)} "
                 f"{'units' if self.layout == 'flat' else 'parameters'}"]
        replicated = [st for st, sh in zip(STATES, self.sharded) if not sh]
        if replicated:
            lines.append(f"  {', '.join(replicated)}: replicated, every rank holds every element"
                         + ("; the slices below are the sharded states'" if len(replicated) < 3 else ""))
        for b in self.bars[:max_bars]:
            pad = f" + {b.padding:,} padding" if len(replicated) < 3 else " (no padding: nothing is split)"
            lines.append(f"  {b.name} {tuple(b.shape)}: {b.numel:,} real{pad}")
            for s in b.slices if len(replicated) < 3 else ():
                who = owners_label(s.owners, self.ranks)
                lines.append(f"    rank {who:<7} [{s.start}:{s.stop})  {s.describe(b)}")
        if len(self.bars) > max_bars:
            lines.append(f"  ... {len(self.bars) - max_bars} more")
        lines.append("  bytes per rank (params / grads / optimizer):")
        for m in self.memory():
            lines.append(f"    rank {m.rank}: {m.params:,.0f} / {m.grads:,.0f} / {m.optimizer:,.0f}"
                         f" = {m.total:,.0f}" + (f" ({m.padding:,.0f} padding)" if m.padding else ""))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


# -- building slices ----------------------------------------------------------------------------------
def _chunks(lo: int, hi: int, k: int) -> list[tuple[int, int, int]]:
    """torch.chunk semantics: ``k`` pieces of ``ceil(len/k)``; returns (lo, hi, padding) per piece."""
    n = hi - lo
    c = -(-n // k) if n else 0
    out = []
    for j in range(k):
        a, b = min(lo + j * c, hi), min(lo + (j + 1) * c, hi)
        out.append((a, b, c - (b - a)))
    return out


def grid_bar(name: str, shape, mesh_ranks, placements, itemsize: int = 4) -> Bar:
    """Slices of a parameter on a device mesh: ``placements[i]`` is ``("shard", dim)`` or ``("replicate",)``
    for mesh dim ``i`` (DTensor's language). Shard splits with torch.chunk semantics and pads every
    piece to the same extent (FSDP2); Replicate makes the ranks along that mesh dim co-owners.
    """
    import numpy as np
    shape = tuple(int(d) for d in shape)
    mesh = np.asarray(mesh_ranks, dtype=int)
    if mesh.ndim != len(placements):
        raise ValueError(f"{len(placements)} placements for a {mesh.ndim}-D mesh {mesh.shape}")
    blocks: dict = {}   # shard coordinates -> [owners, ranges, padded extents]
    for coord in itertools.product(*(range(k) for k in mesh.shape)):
        ranges = [(0, d) for d in shape]
        padded = list(shape)
        key = []
        for i, pl in enumerate(placements):
            if pl[0] == "shard":
                d = pl[1]
                lo, hi, _ = _chunks(*ranges[d], mesh.shape[i])[coord[i]]
                padded[d] = -(-padded[d] // mesh.shape[i])
                ranges[d] = (lo, hi)
                key.append(coord[i])
            else:
                key.append(None)
        entry = blocks.setdefault(tuple(key), [[], ranges, padded])
        entry[0].append(int(mesh[coord]))
    slices, pos = [], 0
    for key in sorted(blocks, key=lambda k: tuple(-1 if c is None else c for c in k)):
        owners, ranges, padded = blocks[key]
        size, real = math.prod(padded), math.prod(hi - lo for lo, hi in ranges)
        slices.append(Slice(tuple(sorted(owners)), pos, pos + size, real, size - real, tuple(ranges)))
        pos += size
    return Bar(name, shape, math.prod(shape), pos, tuple(slices), itemsize=itemsize)


def _flat_bar(name: str, members, groups, itemsize: int = 4) -> Bar:
    """A flat unit sharded over ``len(groups)`` shards; ``groups[j]`` = the ranks holding shard ``j``."""
    members = tuple((str(m), tuple(int(d) for d in s)) for m, s in members)
    lay = flat_layout([math.prod(s) for _, s in members], len(groups))
    slices = []
    for sh, owners in zip(lay.shards, groups):
        where = tuple((members[p.tensor][0], p.tensor_start, p.tensor_stop) for p in sh.pieces)
        slices.append(Slice(tuple(sorted(owners)), sh.start, sh.stop, sh.size - sh.padding, sh.padding, where))
    return Bar(name, (lay.numel,), lay.numel, lay.padded_numel, tuple(slices), members, itemsize)


def _is_shape(x) -> bool:
    return isinstance(x, (tuple, list)) and all(isinstance(d, int) and not isinstance(d, bool) for d in x)


def _is_named(x) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[0], str) and _is_shape(x[1])


def _as_units(shapes) -> list[tuple[str, list[tuple[str, tuple[int, ...]]]]]:
    """(unit name, [(param name, shape), ...]) from: ``{unit: {name: shape}}``, ``{name: shape}`` (one
    unit), a list of shapes or of ``(name, shape)`` (one unit), or a list of such lists (units)."""
    def named(items, prefix=""):
        items = list(items.items()) if isinstance(items, dict) else list(items)
        out = []
        for i, x in enumerate(items):
            if _is_named(x):
                out.append((x[0], tuple(x[1])))
            elif _is_shape(x):
                out.append((f"{prefix}p{i}", tuple(x)))
            else:
                raise ValueError(f"{x!r} is neither a shape like (64, 32) nor a (name, shape) pair")
        return out
    if isinstance(shapes, dict) and shapes and all(isinstance(v, dict) or (isinstance(v, (list, tuple)) and not _is_shape(v))
                                                   for v in shapes.values()):
        return [(str(k), named(v)) for k, v in shapes.items()]   # {unit: {name: shape}} or {unit: [(name, shape)]}
    items = list(shapes.items()) if isinstance(shapes, dict) else list(shapes)
    if all(_is_shape(x) or _is_named(x) for x in items):
        return [("unit0", named(items))]
    return [(f"unit{i}", named(u, f"u{i}.")) for i, u in enumerate(items)]


def _mesh(strategy: str, world_size: int, mesh_shape):
    """(replicate R, shard F) for the strategy; validates the factors."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if strategy != "hsdp":
        if mesh_shape not in (None, (world_size,), [world_size]):
            raise ValueError(f"mesh_shape={mesh_shape} only applies to strategy='hsdp' (a 2-D replicate x shard "
                             f"mesh); {strategy} shards over the whole world of {world_size}")
        return 1, world_size
    if mesh_shape is None:  # a sensible default so a strategy control can switch to HSDP at once
        mesh_shape = (2, world_size // 2) if world_size % 2 == 0 and world_size >= 4 else (1, world_size)
    if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != world_size:
        raise ValueError(f"mesh_shape={tuple(mesh_shape)} must be (replicate, shard) with replicate * shard "
                         f"== world_size({world_size}), e.g. (2, {world_size // 2})")
    return int(mesh_shape[0]), int(mesh_shape[1])


def what_if(shapes, *, world_size: int, mesh_shape=None, strategy: str = "fsdp", layout: str | None = None,
            precision: str = "fp32") -> OwnershipSpec:
    """Who would own what, without running anything.

    ``shapes``: ``{name: shape}`` or a list of shapes (one parameter each), or units -- a list of
    lists of ``(name, shape)`` / a dict of dicts -- for the flat layout. ``layout``: ``"dim0"`` (FSDP2:
    each parameter split on dim 0, each piece padded) or ``"flat"`` (FSDP1 / ZeRO / our from-scratch
    FSDP: each unit flattened, padded at the end; a plain dict or list of shapes is one unit, as ZeRO
    flattens the whole model). Default: ``dim0`` for ``fsdp``/``hsdp``, ``flat`` otherwise.
    ``hsdp``: ``mesh_shape=(R, F)``, rank = r*F + f; shard ``f`` is held by the ``R`` ranks of column f.

    >>> s = what_if({"w": (10, 3)}, world_size=4, strategy="fsdp")
    >>> [(sl.owners, sl.where, sl.padding) for sl in s.bars[0].slices]
    [((0,), ((0, 3), (0, 3)), 0), ((1,), ((3, 6), (0, 3)), 0), ((2,), ((6, 9), (0, 3)), 0), ((3,), ((9, 10), (0, 3)), 6)]
    """
    if strategy not in OWNERSHIP_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {OWNERSHIP_STRATEGIES}")
    layout = layout or ("dim0" if strategy in ("fsdp", "hsdp") else "flat")
    if layout not in ("dim0", "flat"):
        raise ValueError(f"layout={layout!r} must be 'dim0' (FSDP2) or 'flat' (FSDP1, ZeRO, from scratch)")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {tuple(PRECISIONS)}")
    r, f = _mesh(strategy, world_size, mesh_shape)
    grid = [[i * f + j for j in range(f)] for i in range(r)]
    inputs = dict(shapes=shapes, world_size=world_size, mesh_shape=mesh_shape, strategy=strategy,
                  layout=layout, precision=precision)
    if layout == "flat":
        groups = [[grid[i][j] for i in range(r)] for j in range(f)]
        bars = tuple(_flat_bar(name, members, groups) for name, members in _as_units(shapes))
    else:
        placements = [("replicate",), ("shard", 0)]
        bars = []
        for name, shape in (m for _, members in _as_units(shapes) for m in members):
            if not shape:  # a scalar cannot be split on dim 0: FSDP2 would refuse; keep it replicated
                bars.append(grid_bar(name, (1,), grid, [("replicate",), ("replicate",)]))
            else:
                bars.append(grid_bar(name, shape, grid, placements))
        bars = tuple(bars)
    mesh = (r, f) if strategy == "hsdp" else None
    return OwnershipSpec("what_if", strategy, world_size, bars, tuple(range(world_size)), mesh,
                         ("replicate", "shard") if mesh else None, layout, precision, STRATEGIES[strategy].sharded, inputs)


def describe_flat(units, world_size: int, *, strategy: str = "zero3", precision: str = "fp32") -> OwnershipSpec:
    """Our from-scratch FSDP's flat units: ``units`` = a list of units, each a list of ``(name, shape)``
    (or ``{unit_name: [(name, shape), ...]}``); one FlatParameter per unit, padded to a multiple of
    ``world_size``, rank ``r`` owning ``[r*S, (r+1)*S)``."""
    spec = what_if(units if isinstance(units, dict) else [list(u) for u in units], world_size=world_size,
                   strategy=strategy, layout="flat", precision=precision)
    return dataclasses.replace(spec, source="flat")
