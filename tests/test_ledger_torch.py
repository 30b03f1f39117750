"""The torch ledger sees collectives at the process-group level: ours, DDP's and FSDP2's, per mesh axis."""
from course_lib import launch
from course_lib.comm.ledger import CollectiveRecord, Ledger

import pytest


def _learner_collectives():
    import torch
    import torch.distributed as dist
    from course_lib.comm import torch_ledger as lt
    r, n = dist.get_rank(), dist.get_world_size()
    with lt.phase("mine", step=3):
        dist.all_reduce(torch.ones(17, 257))
        out = torch.empty(n * 5, dtype=torch.float64)
        dist.all_gather_into_tensor(out, torch.zeros(5, dtype=torch.float64))
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3 * n))
        dist.broadcast(torch.ones(7, dtype=torch.int32), src=0)
    with lt.paused():
        dist.all_reduce(torch.ones(1))
    return r


def test_learner_collectives_recorded_with_payload_dtype_and_labels():
    out = launch.run(_learner_collectives, world_size=4)
    led = out.ledger
    assert len(led.filter(rank=0)) == 4  # the paused all-reduce is not there
    by_op = {rec.op: rec for rec in led.filter(rank=1)}
    assert by_op["all_reduce"].nbytes == 17 * 257 * 4
    assert by_op["all_gather"].nbytes == 4 * 5 * 8 and by_op["all_gather"].dtype == "float64"
    assert by_op["reduce_scatter"].nbytes == 3 * 4 * 4  # the full input, V
    assert by_op["broadcast"].dtype == "int32"
    for rec in led:
        assert rec.group_size == 4 and rec.group_ranks == (0, 1, 2, 3)
        assert rec.phase == "mine" and rec.step == 3 and rec.source == "torch"
        assert rec.start is not None and rec.start >= 0


def _ddp_step():
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from course_lib.comm import torch_ledger as lt
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 257), torch.nn.Linear(257, 3))
    ddp = DDP(model, bucket_cap_mb=0.01)  # small buckets: several all-reduces
    for _ in range(2):  # DDP rebuilds its buckets after step 1 and broadcasts the new order in step 2
        ddp(torch.randn(4, 17)).sum().backward()
    lt.recorder().reset()
    ddp(torch.randn(4, 17)).sum().backward()
    return sum(p.numel() for p in model.parameters())


def test_ddp_internal_allreduces_are_seen_and_sum_to_the_gradients():
    out = launch.run(_ddp_step, world_size=4)
    psi = out[0]
    mine = out.ledger.filter(rank=0)
    assert set(mine.counts()) == {"all_reduce"}
    assert mine.total_bytes() == psi * 4
    assert all(rec.phase == "backward" for rec in mine)


def _fsdp2_step(mesh_shape):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from course_lib.comm import torch_ledger as lt
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(17, 257), torch.nn.Linear(257, 3))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    lt.recorder().reset()
    with lt.phase("forward"):
        loss = model(torch.randn(4, 17)).sum()
    loss.backward()
    return 0


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_fsdp2_gathers_and_reduce_scatters_are_seen_per_axis(mesh_shape):
    out = launch.run(_fsdp2_step, mesh_shape, world_size=4)
    mine = out.ledger.filter(rank=0)
    f = mesh_shape[-1]
    # FSDP2 pads each parameter's dim 0 to a multiple of the shard size F
    rows = lambda d0: -(-d0 // f) * f
    unit0 = (rows(257) * 17 + rows(257)) * 4
    unit1 = (rows(3) * 257 + rows(3)) * 4
    gathers = [r.nbytes for r in mine.filter(op="all_gather")]
    assert sorted(gathers) == sorted([unit0, unit1, unit1, unit0])
    assert [r.phase for r in mine.filter(op="all_gather")] == ["forward", "forward", "backward", "backward"]
    assert sorted(r.nbytes for r in mine.filter(op="reduce_scatter")) == sorted([unit0, unit1])
    # a 1-D mesh over the whole world reuses the default group, which belongs to no mesh axis
    want_axis = "shard" if len(mesh_shape) == 2 else None
    assert {r.axis for r in mine.filter(op=("all_gather", "reduce_scatter"))} == {want_axis}
    if len(mesh_shape) == 2:  # HSDP: shards are all-reduced across replicas
        ar = mine.filter(op="all_reduce")
        assert {r.axis for r in ar} == {"replicate"} and ar.total_bytes() == (unit0 + unit1) // f
    else:
        assert mine.counts()["all_reduce"] == 0


def test_ledger_roundtrip_and_filter():
    rec = CollectiveRecord(op="all_gather", nbytes=64, dtype="float32", group_size=4, rank=1, group_ranks=(0, 1, 2, 3))
    led = Ledger.from_dicts(Ledger([rec]).to_dicts())
    assert led[0] == rec and len(led.filter(op="all_reduce")) == 0
    with pytest.raises(ValueError, match="allgather"):
        CollectiveRecord(op="allgather", nbytes=1, dtype="float32", group_size=1)
