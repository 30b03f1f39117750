"""Measured memory counts what a rank really holds: an FSDP2 DTensor parameter is only its local shard."""
from course_lib import run


def _fsdp2_param_bytes():
    import torch
    from torch.distributed.fsdp import fully_shard
    from course_lib.measure import memory as mm
    torch.manual_seed(0)
    model = torch.nn.Linear(17, 257, bias=False)   # 257 rows over 4 ranks: 65, 64, 64, 64 rows
    fully_shard(model)
    return mm.model_state(model).params


def test_dtensor_parameters_count_their_local_shard():
    out = run(_fsdp2_param_bytes, world_size=4)
    # FSDP2 pads dim 0 to a multiple of N and each rank allocates ceil(257/4) = 65 rows of 17 floats
    assert list(out) == [65 * 17 * 4] * 4
