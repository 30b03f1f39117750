"""Ownership data: who holds which slice, for what-if descriptions, flat units, FSDP2 DTensors and JAX arrays."""
import doctest
import math
import pickle

import pytest

from course_lib.maths import costs
from course_lib.maths import memory
from course_lib.maths import ownership
from course_lib.maths import sharding
from course_lib.maths.ownership import describe_flat, what_if
from course_lib.measure import ownership as describe


def test_docstrings_run():
    assert doctest.testmod(ownership).failed == 0


def _tiles(bar):
    """Slices tile the padded buffer in order, with no gap and no overlap."""
    pos = 0
    for s in bar.slices:
        assert s.start == pos and s.stop > s.start and s.real + s.padding == s.size
        pos = s.stop
    assert pos == bar.padded_numel and sum(s.real for s in bar.slices) >= bar.numel


def test_fsdp_dim0_awkward_17x257_over_4():
    spec = what_if({"w": (17, 257)}, world_size=4, strategy="fsdp")
    (bar,) = spec.bars
    _tiles(bar)
    # torch.chunk: ceil(17/4) = 5 rows each, rank 3 gets the last 2 rows and 3 rows of padding
    assert [s.owners for s in bar.slices] == [(0,), (1,), (2,), (3,)]
    assert [s.where[0] for s in bar.slices] == [(0, 5), (5, 10), (10, 15), (15, 17)]
    assert all(s.where[1] == (0, 257) for s in bar.slices)
    assert [s.padding for s in bar.slices] == [0, 0, 0, 3 * 257]
    assert bar.padded_numel == sharding.dim0_layout((17, 257), 4).padded_numel == costs.padded_numel([[(17, 257)]], 4, "dim0")
    assert "rows" not in bar.slices[3].describe(bar) and "[15:17, 0:257]" in bar.slices[3].describe(bar)


def test_fsdp_dim0_fewer_rows_than_ranks():
    spec = what_if({"b": (3,)}, world_size=8, strategy="fsdp")
    (bar,) = spec.bars
    _tiles(bar)
    assert [s.real for s in bar.slices] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bar.slices[5].describe(bar) == "no real elements + 1 padding"


def test_flat_units_match_sharding_and_costs():
    units = [[("w1", (5,)), ("b1", (2,))], [("w2", (4, 4))]]
    spec = describe_flat(units, 3)
    assert spec.source == "flat" and spec.layout == "flat" and [b.name for b in spec.bars] == ["unit0", "unit1"]
    for bar, unit in zip(spec.bars, units):
        _tiles(bar)
        lay = sharding.flat_layout([math.prod(s) for _, s in unit], 3)
        assert [(s.start, s.stop, s.padding) for s in bar.slices] == [(sh.start, sh.stop, sh.padding) for sh in lay.shards]
    # rank 1's shard of unit0 cuts across two tensors: the end of w1 and the start of b1
    assert spec.bars[0].slices[1].where == (("w1", 3, 5), ("b1", 0, 1))
    assert sum(b.padded_numel for b in spec.bars) == costs.padded_numel([[s for _, s in u] for u in units], 3, "flat")
    assert [name for name, _ in spec.slices_of(2)] == ["unit0", "unit1"]


def test_unit_forms_are_equivalent():
    a = what_if([[("w", (4, 3)), ("b", (3,))]], world_size=2, strategy="zero3")
    b = what_if({"unit0": {"w": (4, 3), "b": (3,)}}, world_size=2, strategy="zero3")
    c = what_if({"w": (4, 3), "b": (3,)}, world_size=2, strategy="zero3")   # one unit, as ZeRO flattens
    d = describe_flat({"unit0": [("w", (4, 3)), ("b", (3,))]}, 2)
    assert a.bars == b.bars == c.bars == d.bars and len(a.bars) == 1
    assert len(what_if([[(4, 3)], [(3,)]], world_size=2, strategy="zero3").bars) == 2


def test_hsdp_shards_over_F_and_replicates_over_R():
    spec = what_if({"w": (10, 3)}, world_size=4, mesh_shape=(2, 2), strategy="hsdp")
    (bar,) = spec.bars
    _tiles(bar)
    assert spec.mesh_shape == (2, 2) and spec.mesh_axes == ("replicate", "shard")
    assert [s.owners for s in bar.slices] == [(0, 2), (1, 3)]     # rank = r*F + f: column f holds shard f
    assert [s.where[0] for s in bar.slices] == [(0, 5), (5, 10)]
    assert what_if({"w": (10, 3)}, world_size=8, strategy="hsdp").mesh_shape == (2, 4)  # the default R = 2
    flat = what_if({"w": (10, 3)}, world_size=4, mesh_shape=(2, 2), strategy="hsdp", layout="flat").bars[0]
    assert [(s.owners, s.start, s.stop) for s in flat.slices] == [((0, 2), 0, 15), ((1, 3), 15, 30)]


def test_state_sharding_follows_the_zero_stages():
    shapes = {"w": (10, 3)}
    got = {s: what_if(shapes, world_size=4, strategy=s).sharded for s in ownership.OWNERSHIP_STRATEGIES}
    assert got["dp"] == (False, False, False) and got["zero1"] == (False, False, True)
    assert got["zero2"] == (False, True, True) and got["zero3"] == got["fsdp"] == got["hsdp"] == (True, True, True)


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_memory_matches_the_zero_formulas_with_padding(strategy, precision):
    shapes = {"w": (17, 257), "b": (257,)}   # one flat unit of 4626 elements: padded to 4628 over 4
    spec = what_if(shapes, world_size=4, strategy=strategy, precision=precision)
    ref = memory.state_bytes(strategy, spec.numel, 4, precision=precision, pad=True)
    for m in spec.memory():
        assert (m.params, m.grads, m.optimizer) == (ref.params, ref.grads, ref.optimizer)


def test_memory_counts_dim0_padding_on_the_rank_that_holds_it():
    spec = what_if({"w": (17, 257)}, world_size=4, strategy="fsdp")
    mem = spec.memory()
    assert {m.params for m in mem} == {5 * 257 * 4}            # every rank allocates 5 rows
    assert [m.padding for m in mem] == [0, 0, 0, 3 * 257 * 16]  # rank 3's 3 rows of padding, in all 3 states


@pytest.mark.parametrize("bad, match", [
    (dict(strategy="zero4"), "strategy"),
    (dict(strategy="hsdp", mesh_shape=(3, 2)), r"replicate \* shard == world_size\(4\)"),
    (dict(strategy="fsdp", mesh_shape=(2, 2)), "only applies to strategy='hsdp'"),
    (dict(strategy="fsdp", layout="rows"), "layout"),
    (dict(strategy="fsdp", precision="fp8"), "precision"),
])
def test_what_if_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        what_if({"w": (4, 4)}, world_size=4, **bad)


def test_spec_pickles_and_prints():
    spec = what_if({"w": (10, 3), "b": (3,)}, world_size=4, strategy="fsdp")
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again.inputs == spec.inputs
    text = spec.summary()
    assert "[9:10, 0:3] of (10, 3) + 6 padding" in text and "rank 3" in text
    assert "replicated" in what_if({"w": (4,)}, world_size=2, strategy="dp").summary()


# -- real sharded models ---------------------------------------------------------------------------------
def _fsdp2_specs():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from course_lib.measure import ownership as describe
    out = []
    for mesh_shape, names in (((dist.get_world_size(),), None), ((2, 2), ("replicate", "shard"))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.ReLU(), torch.nn.Linear(11, 3))
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        out.append(describe.describe_torch(model))
    return out


@pytest.mark.slow   # ~3 s on warm ranks; up to ~20 s when it starts the 4-rank pool and imports FSDP2
def test_describe_torch_reads_fsdp2_dtensors_as_the_what_if_predicts():
    import course_lib
    res = course_lib.run(_fsdp2_specs, world_size=4)
    shapes = {"0.weight": (11, 7), "0.bias": (11,), "2.weight": (3, 11), "2.bias": (3,)}
    for got, kw in zip(res[0], (dict(strategy="fsdp"), dict(strategy="hsdp", mesh_shape=(2, 2)))):
        want = what_if(shapes, world_size=4, **kw)
        assert got.bars == want.bars, got.summary()
        assert got.strategy == kw["strategy"] and got.source == "torch"
        # the self-check against to_local() and DTensor's own offsets found nothing to say
        assert [n for n in got.notes if not n.startswith("described on")] == []
    assert all(r[0].bars == res[0][0].bars for r in res)   # every rank computes the same picture
    assert res[1][1].mesh_axes == ("replicate", "shard")


def test_describe_jax_groups_devices_that_hold_the_same_block():
    import course_lib
    course_lib.setup_jax(8)
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tree = {"w": jax.device_put(np.zeros((8, 6), np.float32), NamedSharding(mesh, P("data", None))),
            "v": jax.device_put(np.zeros((8, 6), np.float32), NamedSharding(mesh, P("data", "model"))),
            "b": jax.device_put(np.zeros((6,), np.float32), NamedSharding(mesh, P()))}
    spec = describe.describe_jax(tree)
    assert spec.source == "jax" and spec.mesh_shape == (4, 2) and spec.mesh_axes == ("data", "model")
    ids = [d.id for d in mesh.devices.flat]
    w, v, b = spec.bar("w"), spec.bar("v"), spec.bar("b")
    assert [s.owners for s in w.slices] == [tuple(sorted(ids[2 * i:2 * i + 2])) for i in range(4)]
    assert [s.where for s in w.slices][1] == ((2, 4), (0, 6))
    assert len(v.slices) == 8 and v.slices[1].where == ((0, 2), (3, 6))
    assert b.slices[0].owners == tuple(sorted(ids)) and len(b.slices) == 1
    for bar in (w, v, b):
        _tiles(bar)
    assert {m.params for m in spec.memory()} == {(12 + 6 + 6) * 4}   # w: 2x6, v: 2x3, b: all 6
