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

Words are :mod:`course_lib.sharding`'s. A **unit** is a module whose parameters are flattened into one
buffer padded to a multiple of ``N`` (:func:`~course_lib.sharding.flat_layout`, as FSDP's FlatParameter);
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

from . import ledger_torch
from .sharding import flat_layout

__all__ = ["all_gather_flat", "reduce_scatter_flat", "FlatUnit", "ZeRO", "check_sharded_step", "check_gather_free"]


# ----------------------------------------------------------------------------------------------------
# raw communication (torch 2.13 renamed the flat collectives; use whichever this torch has)
# ----------------------------------------------------------------------------------------------------
def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group=None) -> None:
    """``output`` [N*S] <- every rank's ``shard`` [S], in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, shard, group=group)


def reduce_scatter_flat(shard: torch.Tensor, full: torch.Tensor, group=None) -> None:
    """``shard`` [S] <- this rank's slice of the SUM over ranks of ``full`` [N*S]."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(shard, full, op=dist.ReduceOp.SUM, group=group)


# ----------------------------------------------------------------------------------------------------
# one unit: its parameters as views of one padded flat buffer
# ----------------------------------------------------------------------------------------------------
class FlatUnit:
    """Parameters ``params`` re-pointed into ``full`` [Ψpad]; ``shard`` [S] is rank ``rank``'s slice.

    ``sharded_params=False`` (ZeRO-1/2): ``full`` stays allocated and ``shard`` is a *view* of it.
    ``sharded_params=True`` (ZeRO-3): ``shard`` is a separate tensor and ``full``'s storage is freed
    (resized to 0 bytes) except between :meth:`gather_` and :meth:`free_`. The parameters stay views of
    ``full`` throughout: refilling the same storage brings them back, which also revives the tensors
    autograd saved in forward (FSDP1 frees and refills its flat parameter the same way).
    """

    def __init__(self, params: list[nn.Parameter], rank: int, world: int, sharded_params: bool, group=None):
        if not params:
            raise ValueError("a unit needs at least one parameter (drop modules that own none from `units`)")
        self.params, self.rank, self.world, self.group = params, rank, world, group
        self.layout = flat_layout([p.numel() for p in params], world)
        p0 = params[0]
        self.full = torch.zeros(self.layout.padded_numel, dtype=p0.dtype, device=p0.device)  # [Ψpad]
        with torch.no_grad():
            for p, off in zip(params, self.layout.offsets):
                self.full[off:off + p.numel()].copy_(p.detach().reshape(-1))
        with ledger_torch.phase("init"):
            dist.broadcast(self.full, src=0, group=group)  # replicas start equal, whatever their seeds
        for p, off in zip(params, self.layout.offsets):
            p.data = self.full[off:off + p.numel()].view_as(p)  # the module now reads from `full`
        S = self.layout.shard_size
        self.sharded_params = sharded_params
        self.shard = self.full[rank * S:(rank + 1) * S]           # [S], the slice this rank updates
        if sharded_params:
            self.shard = self.shard.clone()
            self.free_()
        self.grad_shard: torch.Tensor | None = None  # [S], the averaged gradient of `shard`
        self.ready = 0                               # gradients accumulated during this backward
        self.gathered = not sharded_params

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.params]

    def gather_(self) -> None:
        """Re-allocate ``full`` and fill it with every rank's shard (an all-gather of ``Ψpad`` elements)."""
        if self.sharded_params and self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        src = self.shard if self.sharded_params else self.shard.clone()  # input must not alias the output
        with torch.no_grad():
            all_gather_flat(self.full, src, group=self.group)
        self.gathered = True

    def free_(self) -> None:
        """Release ``full``'s memory (ZeRO-3); the parameters' views stay, pointing at an empty storage."""
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def reduce_scatter_grads_(self) -> None:
        """``grad_shard`` <- this rank's slice of the mean over ranks of the (padded, flat) gradient."""
        flat = torch.zeros(self.layout.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        for p, off in zip(self.params, self.layout.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        self.grad_shard = torch.empty_like(self.shard)
        reduce_scatter_flat(self.grad_shard, flat, group=self.group)
        self.grad_shard.div_(self.world)


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


# ----------------------------------------------------------------------------------------------------
# the wrapper
# ----------------------------------------------------------------------------------------------------
class ZeRO:
    """ZeRO stage ``stage`` (1, 2 or 3) over ``model`` with a sharded Adam (see the module docstring).

    Use it like a model plus its optimizer::

        zero = ZeRO(model, stage=2, units=[*model.blocks, model], lr=1e-3)
        loss = loss_fn(model(x), y); loss.backward()   # stage 2/3: grads reduce-scattered in backward
        zero.step(); zero.zero_grad()

    ``units``: modules, each one flat buffer (default ``[model]``: one unit). ``state_tensors()``
    lists what the rank keeps, for :mod:`course_lib.memory_measure`; ``unit_shapes()`` describes the
    units for :func:`course_lib.costs.step_cost`.
    """

    def __init__(self, model: nn.Module, stage: int, *, units=None, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, group=None):
        if stage not in (1, 2, 3):
            raise ValueError(f"stage={stage!r} must be 1 (shard Adam state), 2 (+ gradients) or 3 (+ parameters)")
        self.model, self.stage, self.group = model, stage, group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        units = [model] if units is None else list(units)
        owner, order = {}, []
        for i, unit in enumerate(units):
            for p in unit.parameters():
                if p.requires_grad and p not in owner:
                    owner[p] = i
                    order.append(p)
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in owner]
        if missing:
            raise ValueError(f"parameters {missing[:3]}... are in no unit; add their module (or `model`) to units")
        self.units = [FlatUnit([p for p in order if owner[p] == i], rank, world, stage == 3, group)
                      for i in range(len(units)) if any(owner[p] == i for p in order)]
        self.optimizer = torch.optim.Adam([u.shard for u in self.units], lr=lr, betas=betas, eps=eps)
        self._unit_of = {p: u for u in self.units for p in u.params}
        if stage == 1:  # gradients accumulate in place into one flat buffer per unit (DDP's bucket views)
            for u in self.units:
                u.grad_full = torch.zeros_like(u.full)
                for p, off in zip(u.params, u.layout.offsets):
                    p.grad = u.grad_full[off:off + p.numel()].view_as(p)
        else:
            for p in order:
                p.register_post_accumulate_grad_hook(self._grad_ready)
        if stage == 3:
            for module, unit in zip([m for i, m in enumerate(units) if any(owner[p] == i for p in order)], self.units):
                module.register_forward_pre_hook(lambda mod, args, u=unit: self._pre_forward(u))
                module.register_forward_hook(lambda mod, args, out, u=unit: self._post_forward(u, out))

    # -- stage 3: gather on use, free after -------------------------------------------------------
    def _pre_forward(self, unit: FlatUnit) -> None:
        with ledger_torch.phase("forward"):
            unit.gather_()

    def _post_forward(self, unit: FlatUnit, out) -> None:
        unit.free_()
        if torch.is_grad_enabled():  # regather just before backward reaches this unit's operations
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=unit: self._pre_backward(u))

    def _pre_backward(self, unit: FlatUnit) -> None:
        if not unit.gathered:
            unit.gather_()

    # -- stages 2 and 3: reduce-scatter a unit's gradients as soon as they are all there ----------
    def _grad_ready(self, p: torch.Tensor) -> None:
        unit = self._unit_of[p]
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._finish_unit(unit)

    def _finish_unit(self, unit: FlatUnit) -> None:
        unit.reduce_scatter_grads_()
        for q in unit.params:
            q.grad = None  # the full gradient is gone: only this rank's shard of it remains
        unit.ready = 0
        if self.stage == 3 and unit.gathered:
            unit.free_()

    # -- the optimizer step ---------------------------------------------------------------------
    def step(self) -> None:
        """Average the gradient shards (if backward has not), Adam on the shards, then (ZeRO-1/2)
        all-gather the updated parameters; ZeRO-3 gathers them only at the next forward."""
        with ledger_torch.phase("optimizer"):
            for u in self.units:
                if self.stage == 1:
                    flat = u.grad_full
                    u.grad_shard = torch.empty_like(u.shard)
                    reduce_scatter_flat(u.grad_shard, flat, group=self.group)
                    u.grad_shard.div_(u.world)
                elif u.ready or u.grad_shard is None:  # a unit whose gradients never all arrived
                    self._finish_unit(u)
                u.shard.grad = u.grad_shard
            self.optimizer.step()
            if self.stage == 1:
                for u in self.units:
                    u.grad_shard = u.shard.grad = None  # transient: ZeRO-1 keeps full gradients instead
            if self.stage in (1, 2):
                for u in self.units:
                    u.gather_()

    def zero_grad(self) -> None:
        for u in self.units:
            u.grad_shard = u.shard.grad = None
            if self.stage == 1:
                u.grad_full.zero_()

    # -- what this rank holds, and the model description --------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor of model state this rank keeps: ``params``, ``grads``, ``optimizer``."""
        params = [u.full for u in self.units] + [u.shard for u in self.units]  # views are counted once
        grads = [g for u in self.units for g in ([u.grad_full] if self.stage == 1 else [u.grad_shard])
                 if g is not None]
        grads += [p.grad for u in self.units for p in u.params if p.grad is not None]
        optimizer = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"params": params, "grads": grads, "optimizer": optimizer}

    def unit_shapes(self) -> list[list[tuple[int, ...]]]:
        """Per unit, the parameter shapes: ``costs.step_cost(f"zero{stage}", zero.unit_shapes(), N)``."""
        return [u.shapes for u in self.units]


# ----------------------------------------------------------------------------------------------------
# lab 02 exercise checks (on a 17x257 -> 257x5 MLP: 5,911 elements, padded at every N > 1)
# ----------------------------------------------------------------------------------------------------
def _mlp_and_batch():
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(17, 257), nn.Tanh(), nn.Linear(257, 5, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, torch.randn(8, 17, generator=g), torch.randn(8, 5, generator=g)


def _flat(tensors, padded: int) -> torch.Tensor:
    out = torch.zeros(padded)
    torch.cat([t.detach().reshape(-1) for t in tensors], out=out[:sum(t.numel() for t in tensors)])
    return out


def _sharded_step_on_rank(fn, lr: float = 1e-2) -> dict:
    import copy
    r, n = dist.get_rank(), dist.get_world_size()
    model, x, y = _mlp_and_batch()
    ref = copy.deepcopy(model)                                   # one process, whole batch, torch Adam
    opt = torch.optim.Adam(ref.parameters(), lr=lr)
    nn.functional.mse_loss(ref(x), y).backward()
    unit = FlatUnit(list(model.parameters()), r, n, sharded_params=False)
    pad, S = unit.layout.padded_numel, unit.layout.shard_size
    out = {"ref_grad": _flat([p.grad for p in ref.parameters()], pad), "S": S, "before": unit.full.clone()}
    opt.step()
    out["ref_full"] = _flat(list(ref.parameters()), pad)
    rows = slice(r * 8 // n, (r + 1) * 8 // n)
    nn.functional.mse_loss(model(x[rows]), y[rows]).backward()    # this rank's local gradient
    out["local_grad"] = _flat([p.grad for p in model.parameters()], pad)
    ledger_torch.recorder().reset()
    fn(unit.full, out["local_grad"].clone(), unit.shard, torch.optim.Adam([unit.shard], lr=lr))
    out.update(grad_shard=unit.shard.grad, full=unit.full.clone(), ops=[x.op for x in ledger_torch.recorder().ledger()])
    return out


def check_sharded_step(fn, world_size: int = 4, name: str = "sharded_step") -> bool:
    """Exercise check: ``fn(full_params, full_grads, shard_params, optimizer)`` is ZeRO-1's step: the
    averaged gradient of this rank's shard in ``shard_params.grad``, then everyone's updated parameters."""
    from . import checks
    from .launch import run
    with checks.check(name) as c:
        res = run(_sharded_step_on_rank, fn, world_size=world_size)
        S = res[0]["S"]
        for r in range(world_size):
            got = res[r]["grad_shard"]
            if got is None:
                raise AssertionError(f"rank {r}: shard_params.grad is None; set it to the averaged gradient shard")
            mine = res[r]["ref_grad"][r * S:(r + 1) * S]
            others = [res[r]["ref_grad"][q * S:(q + 1) * S] for q in range(world_size)]
            checks.assert_close("shard_params.grad", got, mine, rtol=1e-5, atol=1e-7, rank=r,
                                hint=[checks.summed_not_averaged(world_size), checks.averaged_twice(world_size),
                                      checks.skipped_collective([res[q]["local_grad"][r * S:(r + 1) * S]
                                                                 for q in range(world_size)]),
                                      lambda g, e: next((f"got is shard {q}'s gradient; rank r owns [r*S, (r+1)*S)"
                                                         for q, o in enumerate(others) if q != r
                                                         and torch.allclose(torch.as_tensor(g).float(), o.double().float())), None)])
            full, ref, before = res[r]["full"], res[r]["ref_full"], res[r]["before"]
            stale = [q for q in range(world_size) if torch.equal(full[q * S:(q + 1) * S], before[q * S:(q + 1) * S])]
            if stale and len(stale) < world_size and not torch.allclose(before, ref):
                raise AssertionError(f"rank {r}: shards {stale} of full_params were never updated: all-gather "
                                     "the updated shards into full_params after optimizer.step()")
            checks.assert_close("full_params after the step", full, ref, rtol=1e-5, atol=1e-6, rank=r,
                                hint=checks.not_updated(before))
        ops = res[0]["ops"]
        if "all_reduce" in ops or sorted(set(ops)) != ["all_gather", "reduce_scatter"]:
            raise AssertionError(f"the numbers are right, but rank 0 issued {ops}: ZeRO needs a reduce_scatter "
                                 "(each rank keeps only its shard of the gradient) and an all_gather")
        c.ok(f"on {world_size} ranks: reduce-scatter ÷N, Adam on {S} of {S * world_size} elements, all-gather")
    return bool(c.passed)


def _gather_free_on_rank(gather, free) -> dict:
    r, n = dist.get_rank(), dist.get_world_size()
    model, x, _ = _mlp_and_batch()
    ref_out = model(x).detach()
    unit = FlatUnit(list(model.parameters()), r, n, sharded_params=True)    # full's storage is freed
    p0, out = unit.params[0], {"padded_bytes": unit.layout.padded_numel * 4, "ref": ref_out}
    for i in range(2):                                                      # gather, use, free -- twice
        gather(unit.full, unit.shard)
        out[f"gathered_bytes{i}"] = p0.untyped_storage().nbytes()
        out[f"out{i}"] = model(x).detach() if out[f"gathered_bytes{i}"] else None
        free(unit.full)
        out[f"freed_bytes{i}"] = p0.untyped_storage().nbytes()
    return out


def check_gather_free(gather, free, world_size: int = 4, name: str = "gather / free") -> bool:
    """Exercise check: ``gather(full, shard)`` refills the storage the parameters view and all-gathers
    into it; ``free(full)`` releases that storage -- twice in a row, as every training step does."""
    from . import checks
    from .launch import run
    with checks.check(name) as c:
        res = run(_gather_free_on_rank, gather, free, world_size=world_size)
        for r in range(world_size):
            o = res[r]
            for i in range(2):
                if o[f"gathered_bytes{i}"] != o["padded_bytes"]:
                    raise AssertionError(
                        f"rank {r}, gather #{i + 1}: the parameters' storage holds {o[f'gathered_bytes{i}']} bytes, "
                        f"expected {o['padded_bytes']}: the parameters are views of `full`'s storage, so refill "
                        "that one (full.untyped_storage().resize_(...)) and all-gather into `full` itself")
                checks.assert_close(f"model output after gather #{i + 1}", o[f"out{i}"], o["ref"], rtol=1e-5,
                                    atol=1e-6, rank=r, hint="all-gather every rank's shard into `full`, in rank order")
                if o[f"freed_bytes{i}"] != 0:
                    raise AssertionError(f"rank {r}, free #{i + 1}: the parameters' storage still holds "
                                         f"{o[f'freed_bytes{i}']} bytes; release it: full.untyped_storage().resize_(0)")
        c.ok(f"gathered {res[0]['padded_bytes']:,} bytes, output matches, freed to 0 bytes, twice")
    return bool(c.passed)
