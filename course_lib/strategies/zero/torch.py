"""ZeRO stages 1, 2 and 3 on a plain torch model, from flat padded buffers: the road from DP to FSDP.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020).
Data parallel keeps 16 bytes per parameter on every rank (fp32 weights, gradients, Adam ``m`` and ``v``);
ZeRO keeps the same training maths but lets each rank *own* one ``1/N`` slice of some of these states:

=====  =============================  ========================  ===========================================
stage  full on every rank             only this rank's shard    collectives per step (per unit)
=====  =============================  ========================  ===========================================
1      parameters, gradients          Adam m, v                 reduce-scatter grads, all-gather params
2      parameters                     gradients, m, v           same (the reduce-scatter runs in backward)
3      nothing between uses           parameters, grads, m, v   all-gather in forward, again in backward,
                                                                reduce-scatter grads: 1.5x DP's bytes
=====  =============================  ========================  ===========================================

Words are :mod:`course_lib.maths.sharding`'s. A **unit** is a module whose parameters are flattened into one
buffer padded to a multiple of ``N`` (:func:`~course_lib.maths.sharding.flat_layout`, as FSDP's FlatParameter);
rank ``r`` owns ``[r*S, (r+1)*S)`` of it. A parameter belongs to the first unit (in the order given) that
contains it, so ``units=[*model.blocks, model]`` gives one unit per block plus a root unit for the rest.

The optimizer is a plain ``torch.optim.Adam`` over the shards: Adam is elementwise, so updating a slice
of the flat buffer is exactly what DP's Adam does to those elements (padding has zero gradient, so its
``m``, ``v`` and value stay 0). Every rank must hold the same initial weights; the constructor
broadcasts rank 0's, as DDP does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from course_lib.comm import torch_ledger
from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
from course_lib.maths.sharding import flat_layout

__all__ = ["FlatUnit", "ZeRO"]


# ----------------------------------------------------------------------------------------------------
# one unit: its parameters as views of one padded flat buffer
# ----------------------------------------------------------------------------------------------------
class FlatUnit:
    """Parameters ``params`` re-pointed into ``full`` [Ψpad]; ``shard`` [S] is rank ``rank``'s slice.

    ``sharded_params=False`` (ZeRO-1/2): ``full`` stays allocated and ``shard`` is a *view* of it.
    ``sharded_params=True`` (ZeRO-3): ``shard`` is a tensor of its own and ``full``'s storage is freed
    (0 bytes) except between :meth:`gather_` and :meth:`free_`. The parameters stay views of ``full``:
    refilling that storage brings them back, and revives the tensors autograd saved in forward
    (FSDP1 frees and refills its FlatParameter the same way).
    """

    def __init__(self, params: list[nn.Parameter], rank: int, world: int, sharded_params: bool, group=None):
        if not params:
            raise ValueError("a unit needs at least one parameter (drop modules that own none from `units`)")
        self.params, self.rank, self.world, self.group = params, rank, world, group
        self.layout = flat_layout([p.numel() for p in params], world)
        self.full = torch.zeros(self.layout.padded_numel, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets):
                self.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
        with torch_ledger.phase("init"):
            dist.broadcast(self.full, src=0, group=group)   # replicas start equal, whatever their seeds
        for p, off in zip(params, self.layout.offsets):
            p.data = self.full[off:off + p.numel()].view_as(p)   # the module now reads from `full`
        S = self.layout.shard_size
        self.sharded_params, self.shard = sharded_params, self.full[rank * S:(rank + 1) * S]   # [S]
        self.grad_shard: torch.Tensor | None = None   # [S], the averaged gradient of `shard`
        self.ready, self.gathered = 0, True           # gradients accumulated in this backward; `full` valid?
        if sharded_params:
            self.shard = self.shard.clone()
            self.free_()

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.params]

    def gather_(self) -> None:
        """Re-allocate ``full`` and fill it with every rank's shard (an all-gather of ``Ψpad`` elements)."""
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        src = self.shard if self.sharded_params else self.shard.clone()   # input must not alias the output
        with torch.no_grad():
            all_gather_flat(src, self.group, out=self.full)
        self.gathered = True

    def free_(self) -> None:
        """Release ``full``'s memory (ZeRO-3); the parameters' views stay, pointing at an empty storage."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_scatter_grads_(self, flat: torch.Tensor | None = None) -> None:
        """``grad_shard`` <- this rank's slice of the mean over ranks of the flat gradient ``flat``
        (by default the parameters' ``.grad``, copied into a padded buffer)."""
        if flat is None:
            flat = torch.zeros(self.layout.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
            for p, off in zip(self.params, self.layout.offsets):
                if p.grad is not None:
                    flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        self.grad_shard = torch.empty_like(self.shard)
        reduce_scatter_flat(flat, self.group, out=self.grad_shard)
        self.grad_shard.div_(self.world)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    return [t for o in items for t in _tensors(o)]


# ----------------------------------------------------------------------------------------------------
# the wrapper
# ----------------------------------------------------------------------------------------------------
class ZeRO:
    """ZeRO stage ``stage`` (1, 2 or 3) over ``model`` with a sharded Adam (see the module docstring)::

        zero = ZeRO(model, stage=2, units=[*model.blocks, model], lr=1e-3)
        loss_fn(model(x), y).backward()     # stages 2 and 3 reduce-scatter the gradients in here
        zero.step(); zero.zero_grad()

    ``units``: modules, one flat buffer each (default ``[model]``). ``state_tensors()`` lists what the
    rank keeps (for :mod:`course_lib.measure.memory`); ``unit_shapes()`` describes the units (for
    :func:`course_lib.maths.costs.step_cost`).
    """

    def __init__(self, model: nn.Module, stage: int, *, units=None, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, group=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} must be 1 (shard Adam state), 2 (+ gradients) or 3 (+ parameters)")
        self.model, self.stage, self.group = model, stage, group
        owner: dict = {}                              # parameter -> the first unit module that holds it
        for module in ([model] if units is None else list(units)):
            for p in module.parameters():
                if p.requires_grad:
                    owner.setdefault(p, module)
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in owner]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are in no unit; add their module (or `model`) to units")
        modules = list(dict.fromkeys(owner.values()))
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.units = [FlatUnit([p for p, m in owner.items() if m is module], rank, world, stage == 3, group)
                      for module in modules]
        self.optimizer = torch.optim.Adam([u.shard for u in self.units], lr=lr, betas=betas, eps=eps)
        self._unit_of = {p: u for u in self.units for p in u.params}
        for u, module in zip(self.units, modules):
            if stage == 1:   # gradients accumulate in place into one flat buffer per unit (DDP's bucket views)
                u.grad_full = torch.zeros_like(u.full)
                for p, off in zip(u.params, u.layout.offsets):
                    p.grad = u.grad_full[off:off + p.numel()].view_as(p)
            else:
                for p in u.params:
                    p.register_post_accumulate_grad_hook(self._grad_ready)
            if stage == 3:
                module.register_forward_pre_hook(lambda mod, args, u=u: self._pre_forward(u))
                module.register_forward_hook(lambda mod, args, out, u=u: self._post_forward(u, out))

    # -- stage 3: gather on use, free after ---------------------------------------------------------
    def _pre_forward(self, unit: FlatUnit) -> None:
        with torch_ledger.phase("forward"):
            unit.gather_()

    def _post_forward(self, unit: FlatUnit, out) -> None:
        unit.free_()
        if torch.is_grad_enabled():   # gather again just before backward reaches this unit's operations
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=unit: None if u.gathered else u.gather_())

    # -- stages 2 and 3: reduce-scatter a unit's gradients as soon as they are all there ------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        unit = self._unit_of[p]
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._finish_unit(unit)

    def _finish_unit(self, unit: FlatUnit) -> None:
        unit.reduce_scatter_grads_()
        for q in unit.params:
            q.grad = None   # the full gradient is gone: only this rank's shard of it remains
        unit.ready = 0
        if self.stage == 3 and unit.gathered:
            unit.free_()

    # -- the optimizer step -------------------------------------------------------------------------
    def step(self) -> None:
        """Average the gradient shards (ZeRO-1, or a unit backward did not finish), Adam on the shards,
        then (ZeRO-1/2) all-gather the updated parameters; ZeRO-3 gathers at the next forward."""
        with torch_ledger.phase("optimizer"):
            for u in self.units:
                if self.stage == 1:
                    u.reduce_scatter_grads_(u.grad_full)
                elif u.ready or u.grad_shard is None:   # a unit whose gradients never all arrived
                    self._finish_unit(u)
                u.shard.grad = u.grad_shard
            self.optimizer.step()
            for u in self.units:
                if self.stage == 1:
                    u.grad_shard = u.shard.grad = None   # transient: ZeRO-1 keeps the full gradient instead
                if self.stage in (1, 2):
                    u.gather_()

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard = u.shard.grad = None
            if self.stage == 1:
                u.grad_full.zero_()

    # -- what this rank holds, and the model description --------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor of model state this rank keeps: ``params``, ``grads``, ``optimizer``."""
        grads = [u.grad_full if self.stage == 1 else u.grad_shard for u in self.units]
        grads += [p.grad for u in self.units for p in u.params]
        return {"params": [u.full for u in self.units] + [u.shard for u in self.units],   # views count once
                "grads": [g for g in grads if g is not None],
                "optimizer": [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]}

    def unit_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per unit, the parameter shapes: ``costs.step_cost(f"zero{stage}", zero.unit_shapes(), N)``."""
        return [u.shapes for u in self.units]
