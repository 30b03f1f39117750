"""FSDP from scratch, the way the FSDP paper builds it (Zhao et al., "PyTorch FSDP: Experiences on
Scaling Fully Sharded Data Parallel", VLDB 2023, sec. 3): flat parameters, units, prefetch.

Vocabulary (the padding words are :mod:`course_lib.maths.sharding`'s):

* **unit** -- a module whose parameters are gathered, used and freed together: here each transformer
  block, plus the **root** (the model itself), which owns every parameter no block owns (embeddings,
  final norm, head).
* **FlatParameter** -- one unit's parameters flattened, concatenated and padded *at the end* to a
  multiple of ``N`` (:func:`sharding.flat_layout`). Each rank keeps only its **sharded** piece, an
  ``nn.Parameter`` named ``flat_param`` on the unit's module: it is what the optimizer sees.
* **state** -- :class:`State`: ``SHARDED`` (only the shard is held) or ``UNSHARDED`` (the all-gather
  output is held too and the unit's modules see their parameters as views into it).

One unit in one training step::

    forward   pre-hook: all-gather -> UNSHARDED, set views | unit runs | post-hook: free -> SHARDED
    backward  first saved parameter autograd unpacks: all-gather again -> UNSHARDED | unit's backward
              | the gather's backward: reduce-scatter ÷N into flat_param.grad, free -> SHARDED
    step      any optimizer over model.parameters(): the shards alone (AdamW is elementwise)

"All-gather in forward, reduce-scatter ÷N in backward" is one autograd.Function (:class:`Unshard`),
the custom-gradient pattern of the University of Amsterdam's "Training Models at Scale" JAX notebooks. The re-gather in backward comes from saved-tensor hooks: autograd keeps not the
unsharded parameters but a note of where they lie in the flat buffer, and gathers them again when the
backward needs them -- as activation checkpointing recomputes, but without recomputing anything else.
With ``prefetch=True`` the next unit's all-gather is issued (asynchronously) before the current unit
computes; ``reshard_after_forward=False`` keeps units unsharded until their backward (no re-gather).

Naive on purpose: one process group, fp32, no mixed precision, no CPU offload, no gradient
accumulation without sync. :mod:`torch.distributed.fsdp` (FSDP2) is the real one (lab 04).

Longer than ~300 lines: the FSDP paper's three pieces (flat parameter, unit, wrapper) are one
algorithm; the raw collectives are already apart in :mod:`course_lib.comm.shim`.
"""
from __future__ import annotations

import enum
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from course_lib.comm import torch_ledger
from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
from course_lib.maths.sharding import flat_layout

__all__ = ["State", "FlatParameter", "Unshard", "FlatFSDP", "gathered_parameters"]


class State(enum.Enum):
    SHARDED = "sharded"        #: only this rank's shard is held
    UNSHARDED = "unsharded"    #: the all-gather output is held; the modules see views into it


class FlatParameter:
    """One unit's parameters as one flat, padded buffer, of which this rank keeps one shard."""

    def __init__(self, name: str, slots: list[tuple[str, nn.Module, str, torch.Tensor]], group=None):
        self.name, self.group = name, group                    # name: the unit's module path ("" = root)
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.fqns = [fqn for fqn, *_ in slots]                 # original parameter names, in flat order
        self._where = [(module, attr) for _, module, attr, _ in slots]
        self.shapes = [tuple(p.shape) for *_, p in slots]
        self.layout = flat_layout([p.numel() for *_, p in slots], self.world)
        b = self.layout.shards[self.rank]
        with torch.no_grad():                                  # every rank built the same full model
            pad = slots[0][3].new_zeros(self.layout.padding)   # zeros at the end: the padding
            full = torch.cat([p.detach().reshape(-1) for *_, p in slots] + [pad])  # [padded numel]
            self.sharded = nn.Parameter(full[b.start:b.stop].clone())             # [padded / N]
        self.state, self.unsharded, self._pending = State.SHARDED, None, None
        self.saved = False  # did autograd save one of its parameters in the last forward? (-> re-gather)
        self.timeline: list | None = None   # FlatFSDP's list of (unit, phase, start, end) compute spans
        self._t0 = 0.0

    def note(self, phase: str | None) -> None:
        """Timeline: ``None`` marks the start of the unit's compute, a phase name its end."""
        now = time.perf_counter() - torch_ledger.recorder().t0   # the ledger's clock
        if phase is None:
            self._t0 = now
        elif self.timeline is not None:
            self.timeline.append((self.name or "root", phase, self._t0, now))

    @property
    def unsharded_bytes(self) -> int:
        return self.layout.padded_numel * self.sharded.element_size()

    def unshard(self, async_op: bool = False) -> None:
        """Start (``async_op``) or do the all-gather; a no-op when unsharded or already started."""
        if self.state is State.SHARDED and self._pending is None:
            self._pending = all_gather_flat(self.sharded, self.group, async_op=async_op)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Finish a started all-gather: -> UNSHARDED."""
        if self._pending is not None:
            buffer, work = self._pending
            if work is not None:
                work.wait()
            self.unsharded, self._pending, self.state = buffer, None, State.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded buffer and the modules' views of it: -> SHARDED."""
        for module, attr in self._where:
            setattr(module, attr, None)   # a stale view would keep the whole buffer alive
        self.unsharded, self.state = None, State.SHARDED

    def views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The original parameters as views into a padded flat buffer (the padding left out)."""
        return [full[off:off + n].view(shape)
                for off, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)]

    def set_views(self, full: torch.Tensor) -> None:
        for (module, attr), view in zip(self._where, self.views(full)):
            setattr(module, attr, view)   # a plain attribute: the Parameter was removed at wrap time

    def __repr__(self) -> str:
        L = self.layout
        return (f"FlatParameter({self.name or '<root>'!r}: {len(self.fqns)} tensors, {L.numel:,} elements "
                f"+ {L.padding} padding = {L.padded_numel:,}, shard {L.shard_size:,} on rank {self.rank} "
                f"of {self.world}, {self.state.name})")


class Unshard(torch.autograd.Function):
    """All-gather in forward; in backward, reduce-scatter ÷N: each rank's shard gets the mean gradient."""

    @staticmethod
    def forward(ctx, sharded, flat: FlatParameter):
        ctx.flat = flat
        flat.unshard()               # waits for a prefetch if one was started
        return flat.unsharded        # [padded numel]; views of it become the module's parameters

    @staticmethod
    def backward(ctx, grad_full):    # [padded numel], zeros over the padding
        flat = ctx.flat
        grad_shard = reduce_scatter_flat(grad_full, flat.group, mean=True)
        flat.reshard()               # the unit's backward is over: autograd runs this node last
        return grad_shard, None


class _Saved:
    """What autograd keeps instead of a view into an unsharded buffer: where it lay."""

    __slots__ = ("flat", "offset", "size", "stride")

    def __init__(self, flat, t):
        self.flat, self.offset, self.size, self.stride = flat, t.storage_offset(), t.size(), t.stride()


class FlatFSDP(nn.Module):
    """Shard ``model`` into units (``units`` in forward order, then the root) and train it fully sharded.

    Build the same model on every rank first (same seed): each rank keeps its shard of those numbers.
    ``model.parameters()`` then yields the flat shards only; give them to any elementwise optimizer.
    """

    def __init__(self, model: nn.Module, units=(), *, group=None, prefetch: bool = False,
                 reshard_after_forward: bool = True):
        super().__init__()
        self.module, self.group = model, group
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        unit_mods = [model, *units]   # root first: it is the first to run in forward
        names = {m: n for n, m in model.named_modules()}
        if any(m not in names for m in units) or len(set(unit_mods)) != len(unit_mods):
            raise ValueError("units must be distinct submodules of model (e.g. list(model.blocks)); "
                             "the root (model itself) is always a unit and must not be listed")
        self.flats: list[FlatParameter] = []
        for um in reversed(unit_mods):  # bottom-up, as FSDP2's fully_shard: blocks first, then the root
            slots = [(f"{names[m]}.{a}".lstrip("."), m, a, p) for m in self._owned_modules(um, unit_mods)
                     for a, p in list(m._parameters.items()) if p is not None]
            if not slots:
                raise ValueError(f"unit {names[um] or '<root>'!r} owns no parameters: leave it out of units")
            flat = FlatParameter(names[um], slots, group)
            for _, m, a, _ in slots:
                del m._parameters[a]   # the original Parameter goes; a view takes its place when gathered
            um.register_parameter("flat_param", flat.sharded)
            um.register_forward_pre_hook(lambda mod, args, f=flat: self._on_pre_forward(f))
            um.register_forward_hook(lambda mod, args, out, f=flat: self._on_post_forward(f))
            self.flats.insert(0, flat)
        self._live: dict[int, FlatParameter] = {}   # storage address -> flat, for the saved-tensor hooks
        self.unsharded_peak_bytes = 0                # high-water mark of gathered buffers (+ prefetches)
        self.timeline: list[tuple[str, str, float, float]] = []  # (unit, phase, start, end), ledger clock
        for flat in self.flats:
            flat.timeline = self.timeline
            flat.sharded.register_post_accumulate_grad_hook(lambda p, f=flat: f.note("backward"))

    @staticmethod
    def _owned_modules(unit: nn.Module, units: list[nn.Module]):
        """``unit`` and its submodules, minus the subtrees of other units."""
        stack = [unit]
        while stack:
            m = stack.pop()
            yield m
            stack.extend(c for c in reversed(list(m.children())) if c not in units)

    # -- the unit's lifecycle: what FSDP does, one method per moment (override to experiment) ----
    def pre_forward(self, flat: FlatParameter) -> None:
        """Before the unit's forward: all-gather (autograd: reduce-scatter in backward), set views."""
        full = Unshard.apply(flat.sharded, flat)   # [padded numel], flat is now UNSHARDED
        flat.set_views(full)
        nxt = self.next_unit(flat)
        if self.prefetch and nxt is not None:
            nxt.unshard(async_op=True)   # the next unit's all-gather overlaps this unit's compute

    def post_forward(self, flat: FlatParameter) -> None:
        """After the unit's forward: free the unsharded parameters (autograd kept notes, not them)."""
        if self.reshard_after_forward:
            flat.reshard()

    def pre_backward(self, flat: FlatParameter) -> None:
        """When the backward first needs the unit's parameters: all-gather them again."""
        flat.unshard()
        prev = self.next_unit(flat, backward=True)
        if self.prefetch and prev is not None and prev.saved:   # a unit autograd saved nothing of: no gather
            prev.unshard(async_op=True)   # backward runs the units in reverse

    def next_unit(self, flat: FlatParameter, backward: bool = False):
        """The unit that runs after ``flat``: forward order is root, blocks; backward reverses the
        blocks (the root, outermost, stays unsharded through both). None at the end."""
        order = self.flats if not backward else [self.flats[0], *reversed(self.flats[1:])]
        i = order.index(flat) + 1
        return order[i] if i < len(order) and order[i] is not self.flats[0] else None

    # -- plumbing: hooks, saved-tensor notes, memory and timeline bookkeeping ------------------------
    def _note_memory(self):
        held = sum(f.unsharded_bytes for f in self.flats if f.state is State.UNSHARDED or f._pending)
        self.unsharded_peak_bytes = max(self.unsharded_peak_bytes, held)

    def _on_pre_forward(self, flat: FlatParameter):
        self.pre_forward(flat)
        if flat.state is not State.UNSHARDED or flat.unsharded is None:
            raise RuntimeError(f"pre_forward left unit {flat.name or 'root'!r} {flat.state.name}: it must "
                               "all-gather and set flat.unsharded (state UNSHARDED) before the unit runs")
        self._live[flat.unsharded.untyped_storage().data_ptr()] = flat
        self._note_memory()
        flat.note(None)

    def _on_post_forward(self, flat: FlatParameter):
        flat.note("forward")
        if flat.unsharded is not None:   # its forward is over: no more saved tensors to take notes of
            self._live.pop(flat.unsharded.untyped_storage().data_ptr(), None)
        self.post_forward(flat)

    def _pack(self, t: torch.Tensor):
        flat = self._live.get(t.untyped_storage().data_ptr()) if t.device.type != "meta" else None
        if flat is None:
            return t
        flat.saved = True
        return _Saved(flat, t)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        flat = saved.flat
        if flat.state is not State.UNSHARDED:   # first need of this unit in backward
            self.pre_backward(flat)
            if flat.state is not State.UNSHARDED:
                raise RuntimeError(f"pre_backward left unit {flat.name or 'root'!r} {flat.state.name}: it "
                                   "must all-gather the parameters again (flat.unshard())")
            self._note_memory()
            flat.note(None)
        return flat.unsharded.as_strided(saved.size, saved.stride, saved.offset)

    def forward(self, *args, **kwargs):
        rec = torch_ledger.recorder()
        for flat in self.flats:
            flat.saved = False
        with torch_ledger.phase(rec.phase or "forward"), \
                torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        self._live.clear()
        return out

    # -- inspection (collectives: every rank must call) -----------------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """All-gather every unit: the unsharded parameters by their original names (copies)."""
        out = {}
        for flat in self.flats:
            full, _ = all_gather_flat(flat.sharded, flat.group)
            out.update({fqn: v.clone() for fqn, v in zip(flat.fqns, flat.views(full))})
        return out

    def unit_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per unit, its parameters' shapes: the ``units`` argument of ``costs.step_cost``."""
        return [list(f.shapes) for f in self.flats]

    def regathers(self) -> list[bool]:
        """Per unit: will the backward gather it again? Only if autograd saved one of its parameters in
        the last forward (an embedding saves indices, a first Linear fed raw data saves only its input):
        the ``regather`` argument of ``costs.step_cost``."""
        return [f.saved and self.reshard_after_forward for f in self.flats]

    def named_units(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """``{unit: {parameter name: shape}}`` in flat order, for ``ownership.describe_flat``."""
        return {f.name or "root": dict(zip(f.fqns, f.shapes)) for f in self.flats}


def gathered_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, by its original name: for :class:`FlatFSDP`, FSDP2 (``fully_shard``),
    DDP or a plain model. Issues collectives: every rank must call it.

    FSDP2's units are unsharded with their own ``unshard()`` (rather than ``DTensor.full_tensor()``,
    whose functional collective the course's ledger process group cannot forward on gloo yet).
    """
    if isinstance(model, FlatFSDP):
        return model.full_parameters()
    model = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    out = {k: v.detach().clone() for k, v in model.named_parameters()}
    for m in units:
        m.reshard()
    return out
