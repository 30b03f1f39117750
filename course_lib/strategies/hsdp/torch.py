"""HSDP in PyTorch: FSDP2's ``fully_shard`` over a 2-D ``DeviceMesh`` (replicate × shard).

Words (defined once, used in the JAX module and the labs the same way):

* **sharding factor F** -- how many ranks one parameter is cut across (the mesh's ``shard`` dim);
  ``F = N`` is FSDP, ``F = 1`` is plain data parallel. The FSDP paper calls this the sharding factor
  (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023, sec. 3.2,
  "hybrid sharding").
* **replicate factor R = N / F** -- how many copies of each shard exist (the mesh's ``replicate`` dim).
* **shard group** -- the F ranks that together hold one full copy of the model: a *row* of the mesh,
  ranks ``r·F … r·F + F − 1``. Put it inside a node: its all-gathers and reduce-scatters are the heavy traffic.
* **replica group** -- the R ranks that hold the *same* shard: a *column*, ranks ``f, f + F, f + 2F …``.
  Only the gradient all-reduce (``Ψpad/F`` elements per unit) crosses it: this is what crosses nodes.

torch 2.13 (``_fully_shard/_fsdp_init.py``): **dim 0 of the mesh replicates, dim 1 shards**; parameters get
placements ``(Replicate(), Shard(0))``. (torchtitan's docs/fsdp.md says the reverse; the code is what runs.)
A step: all-gather (shard dim) before each unit's forward and again in backward, reduce-scatter of the
gradient (shard dim), then all-reduce of the reduced shard (replicate dim). ``set_requires_all_reduce(False)``
skips only that last all-reduce: gradient accumulation across micro-batches without crossing nodes.

A dimension that spans every rank is backed by the default process group, which carries no mesh-axis name
(F = N or F = 1): :func:`label_axes` names records from their ranks instead.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MESH_DIMS", "HSDPConfig", "hsdp_mesh", "shard_gpt_hsdp", "shard_hsdp", "build_gpt", "shard_groups", "replica_groups",
           "axis_of", "label_axes", "unit_shapes", "placements_of", "accumulate_step",
           "formula_by_axis", "ledger_by_axis"]

MESH_DIMS = ("replicate", "shard")   #: mesh dim names, in torch's order: dim 0 replicates, dim 1 shards


@dataclass(frozen=True)
class HSDPConfig:
    """The 2-D data-parallel layout: ``replicate`` copies of a model cut ``shard`` ways, on ``world_size`` ranks."""

    replicate: int    #: R, copies of every shard (mesh dim 0)
    shard: int        #: F, the sharding factor (mesh dim 1): ranks one copy is cut across
    world_size: int   #: N, must equal R * F

    def __post_init__(self):
        vals = {"replicate": self.replicate, "shard": self.shard, "world_size": self.world_size}
        bad = {k: v for k, v in vals.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"HSDPConfig factors must be positive ints, got {bad}")
        if self.replicate * self.shard != self.world_size:
            fs = [f for f in range(1, self.world_size + 1) if self.world_size % f == 0]
            raise ValueError(
                f"replicate({self.replicate}) * shard({self.shard}) != world_size({self.world_size}); "
                f"pick shard from the divisors of {self.world_size}: {fs}, and replicate = "
                f"{self.world_size} // shard (e.g. replicate={self.world_size // fs[len(fs) // 2]}, "
                f"shard={fs[len(fs) // 2]})")

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return (self.replicate, self.shard)


def shard_groups(replicate: int, shard: int) -> list[list[int]]:
    """The rows of the mesh: ``replicate`` groups of ``shard`` ranks that together hold one model copy."""
    HSDPConfig(replicate, shard, replicate * shard)
    return [[r * shard + f for f in range(shard)] for r in range(replicate)]


def replica_groups(replicate: int, shard: int) -> list[list[int]]:
    """The columns of the mesh: ``shard`` groups of ``replicate`` ranks holding the same shard."""
    HSDPConfig(replicate, shard, replicate * shard)
    return [[r * shard + f for r in range(replicate)] for f in range(shard)]


def hsdp_mesh(replicate: int, shard: int, device_type: str = "cpu", world_size: int | None = None):
    """``init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))``, validated.

    Call on every rank. ``world_size`` defaults to the process group's.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    world = world_size if world_size is not None else dist.get_world_size()
    cfg = HSDPConfig(replicate, shard, world)
    return init_device_mesh(device_type, cfg.mesh_shape, mesh_dim_names=MESH_DIMS)


def _check_mesh(mesh) -> None:
    if mesh.ndim != 2:
        raise ValueError(f"HSDP needs a 2-D mesh (replicate, shard); got a {mesh.ndim}-D mesh {mesh}. "
                         "A 1-D mesh is plain FSDP: build one with hsdp_mesh(R, F)")
    names = tuple(mesh.mesh_dim_names or ())
    if names and names != MESH_DIMS:
        raise ValueError(f"mesh_dim_names={names}, expected {MESH_DIMS}: FSDP2 replicates on dim 0 and shards "
                         "on dim 1 whatever the names say; name them so the ledger tells the truth")


def shard_gpt_hsdp(model, mesh, **kwargs):
    """HSDP on the course GPT: ``fully_shard(block, mesh=mesh)`` for every block, then the root (bottom-up, as
    for FSDP); ``mesh`` is 2-D (replicate, shard). ``kwargs`` go to every ``fully_shard`` call."""
    from torch.distributed.fsdp import fully_shard
    _check_mesh(mesh)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def shard_hsdp(model, replicate: int, shard: int, device_type: str = "cpu"):
    """On a rank: build the (replicate, shard) mesh and apply :func:`shard_gpt_hsdp`; returns the mesh (the
    reference answer of Lab 06's first exercise)."""
    mesh = hsdp_mesh(replicate, shard, device_type)
    shard_gpt_hsdp(model, mesh)
    return mesh


def build_gpt(cfg, mesh, *, device="cpu", dtype=None, seed: int = 0, shard=None):
    """On a rank: the course GPT built on the meta device, sharded by ``shard(model, mesh)`` (default
    :func:`shard_gpt_hsdp`; a 1-D mesh takes plain FSDP), materialised and set to ``init_weights(cfg, seed)``.
    FSDP2 broadcasts nothing: every rank computes each full tensor and keeps its own slice."""
    import torch
    from course_lib.models import TorchGPT, torch_init_
    with torch.device("meta"):
        model = TorchGPT(cfg)
    if dtype is not None:
        model = model.to(dtype)
    if shard is None:
        shard = shard_gpt_hsdp if mesh.ndim == 2 else _fsdp_1d
    shard(model, mesh)
    model.to_empty(device=device)
    return torch_init_(model, cfg, seed)


def _fsdp_1d(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def unit_shapes(model) -> list[list[tuple[int, ...]]]:
    """FSDP units of the course GPT as ``costs.step_cost`` wants them: the root's own parameters, then each
    block's. Works on a meta, plain or sharded model (DTensor shapes are global)."""
    blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = [tuple(p.shape) for p in model.parameters() if id(p) not in blocks]
    return [root] + [[tuple(p.shape) for p in b.parameters()] for b in model.blocks]


def placements_of(model) -> dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """On a rank: ``name -> (placements, global shape, local shape)`` of every parameter."""
    out = {}
    for name, p in model.named_parameters():
        pl = str(tuple(getattr(p, "placements", ()))) if hasattr(p, "placements") else "(plain tensor)"
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = (pl, tuple(p.shape), tuple(local.shape))
    return out


def axis_of(record, replicate: int, shard: int) -> str | None:
    """The mesh axis a torch ledger record ran over, from its ranks: ``"shard"`` (a row), ``"replicate"``
    (a column), ``"replicate,shard"`` (all ranks); None for any other group. A record already carrying an
    axis keeps it."""
    if record.axis:
        return record.axis
    ranks = tuple(sorted(record.group_ranks or ()))
    if not ranks:
        return None
    rows = {tuple(g) for g in shard_groups(replicate, shard)}
    cols = {tuple(g) for g in replica_groups(replicate, shard)}
    if ranks in rows and ranks in cols:   # a 1x1 mesh, or a dimension of size 1 and a single rank
        return "shard" if shard >= replicate else "replicate"
    if ranks in rows:
        return "shard"
    if ranks in cols:
        return "replicate"
    if len(ranks) == replicate * shard:
        return "replicate,shard"
    return None


def label_axes(ledger, replicate: int, shard: int):
    """A copy of ``ledger`` whose records all name their mesh axis (see :func:`axis_of`). Needed where a mesh
    dimension spans every rank: DeviceMesh then reuses the default group, which has no axis name."""
    import dataclasses
    from course_lib.comm.ledger import Ledger
    return Ledger(dataclasses.replace(r, axis=axis_of(r, replicate, shard)) for r in ledger)


def accumulate_step(model, opt, micro_batches, loss_fn, *, all_reduce_each: bool = False):
    """One optimizer step over ``micro_batches`` (a list of ``(x, y)``), each loss scaled by 1/k, so the step
    equals one step on their concatenation. With HSDP, ``set_requires_all_reduce(False)`` on all but the
    last micro-batch: each still reduce-scatters inside its shard group (cheap, intra-node), the partial
    sums accumulate, and the replicate all-reduce (the inter-node one) runs once. ``all_reduce_each=True``
    all-reduces after every micro-batch (the naive way: k times the inter-node bytes). Returns the loss."""
    k = len(micro_batches)
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        if hasattr(model, "set_requires_all_reduce"):
            model.set_requires_all_reduce(all_reduce_each or i == k - 1)
        loss = loss_fn(model(x), y) / k
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad()
    return total


def formula_by_axis(units, replicate: int, shard: int, **kw) -> dict[str, float]:
    """Wire bytes one rank sends per step on each mesh axis, from the model alone
    (``costs.step_cost("hsdp", ..., replicate=R)``): all-gathers and reduce-scatters on ``"shard"``, the
    gradient all-reduce on ``"replicate"``. ``kw`` go to ``step_cost`` (``padding="dim0"``, ``root_unit=0``)."""
    from course_lib.maths import costs
    cost = costs.step_cost("hsdp", units, replicate * shard, replicate=replicate, **kw)
    out = {"shard": 0.0, "replicate": 0.0}
    for o in cost.ops:
        out["replicate" if o.op == "all_reduce" else "shard"] += o.wire_bytes
    return out


def ledger_by_axis(ledger, replicate: int, shard: int, *, rank: int = 0, step=None) -> dict[str, float]:
    """Measured wire bytes per mesh axis of one rank's records (``step``: one step, else all of them)."""
    from course_lib.maths import costs
    out = {"shard": 0.0, "replicate": 0.0}
    for r in label_axes(ledger.filter(rank=rank, step=step), replicate, shard):
        out[r.axis] = out.get(r.axis, 0.0) + costs.record_wire_bytes(r)
    return out
