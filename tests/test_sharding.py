"""Sharding maths: padding, shard bounds, flat (FSDP1) and dim-0 (FSDP2) layouts, on awkward sizes."""
import doctest
import math

import pytest

from course_lib.maths import sharding
from course_lib.maths.sharding import dim0_layout, flat_layout, padded_size, shard_bounds


def test_docstrings_run():
    assert doctest.testmod(sharding).failed == 0


@pytest.mark.parametrize("n, world, expected", [
    (0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (17 * 257, 4, 4372), (12, 8, 16), (3, 8, 8), (7, 1, 7),
])
def test_padded_size(n, world, expected):
    assert padded_size(n, world) == expected
    assert expected % world == 0 and 0 <= expected - n < world


@pytest.mark.parametrize("bad", [dict(n=-1, world=4), dict(n=4, world=0), dict(n=4, world=2.0)])
def test_padded_size_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="must be"):
        padded_size(**bad)


def test_shard_bounds_17x257_over_4():
    n = 17 * 257  # 4369 = 4 * 1092 + 1: padded to 4372, shards of 1093, 3 padding elements on rank 3
    shards = [shard_bounds(n, 4, r) for r in range(4)]
    assert [(s.start, s.stop) for s in shards] == [(0, 1093), (1093, 2186), (2186, 3279), (3279, 4372)]
    assert [s.real for s in shards] == [1093, 1093, 1093, 1090]
    assert [s.padding for s in shards] == [0, 0, 0, 3]
    assert sum(s.real for s in shards) == n and {s.size for s in shards} == {1093}


def test_shard_bounds_tensor_smaller_than_world():
    shards = [shard_bounds(3, 8, r) for r in range(8)]  # 3 elements over 8 ranks: one each, 5 ranks all padding
    assert [s.real for s in shards] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert [s.padding for s in shards] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_shard_bounds_rejects_rank_out_of_range():
    with pytest.raises(ValueError, match=r"rank=4 must be an int in \[0, world=4\)"):
        shard_bounds(10, 4, 4)


def _rebuild_flat(layout, numels):
    """Put every rank's pieces back: each element of each tensor must be covered exactly once."""
    seen = [[0] * n for n in numels]
    for shard in layout.shards:
        used = 0
        for p in shard.pieces:
            assert p.shard_start == used, "pieces are contiguous from the start of the shard"
            for k in range(p.tensor_start, p.tensor_stop):
                seen[p.tensor][k] += 1
            used += p.numel
        assert used + shard.padding == shard.size == layout.shard_size
    assert all(c == 1 for tensor in seen for c in tensor)


def test_flat_layout_two_tensors_cut_across_ranks():
    numels = [17 * 257, 257]  # a weight and its bias: 4626 -> padded 4628, shards of 1157
    layout = flat_layout(numels, 4)
    assert layout.offsets == (0, 4369) and layout.padded_numel == 4628 and layout.padding == 2
    assert [s.padding for s in layout.shards] == [0, 0, 0, 2]
    r3 = layout.shards[3]  # [3471, 4628): the weight's tail, then the whole bias, then 2 padding
    assert [(p.tensor, p.tensor_start, p.tensor_stop, p.shard_start) for p in r3.pieces] == [
        (0, 3471, 4369, 0), (1, 0, 257, 898)]
    _rebuild_flat(layout, numels)


@pytest.mark.parametrize("numels, world", [([5, 2], 3), ([3], 8), ([0, 4, 0, 1], 2), ([], 4), ([12 * 3, 7, 1], 8)])
def test_flat_layout_covers_every_element_once(numels, world):
    layout = flat_layout(numels, world)
    assert layout.numel == sum(numels) and layout.padded_numel == padded_size(sum(numels), world)
    assert sum(s.padding for s in layout.shards) == layout.padding
    _rebuild_flat(layout, numels)


def test_flat_layout_rejects_negative_numel():
    with pytest.raises(ValueError, match=r"numels\[1\]=-3"):
        flat_layout([4, -3], 2)


def test_dim0_layout_12_rows_over_8_leaves_two_ranks_empty():
    layout = dim0_layout((12, 5), 8)  # torch.chunk: 6 chunks of 2 rows; ranks 6, 7 get none
    assert layout.chunk_rows == 2
    assert [s.rows for s in layout.shards] == [2, 2, 2, 2, 2, 2, 0, 0]
    assert [s.padding_rows for s in layout.shards] == [0, 0, 0, 0, 0, 0, 2, 2]
    assert layout.padded_numel == 16 * 5 and layout.shard_numel == 10 and layout.padding == 20


def test_dim0_layout_17x257_over_4():
    layout = dim0_layout((17, 257), 4)
    assert [(s.row_start, s.row_stop) for s in layout.shards] == [(0, 5), (5, 10), (10, 15), (15, 17)]
    assert layout.padded_numel == 20 * 257 and layout.padding == 3 * 257


@pytest.mark.parametrize("shape, world", [((12, 5), 8), ((17, 257), 4), ((3,), 8), ((10, 2, 3), 4), ((5, 1), 4), ((0, 3), 2)])
def test_dim0_layout_matches_torch_chunk(shape, world):
    torch = pytest.importorskip("torch")
    chunks = torch.chunk(torch.empty(shape), world, dim=0)
    rows = [c.shape[0] for c in chunks] + [0] * (world - len(chunks))  # FSDP2 appends empty chunks
    layout = dim0_layout(shape, world)
    assert [s.rows for s in layout.shards] == rows
    assert layout.padded_numel == math.ceil(shape[0] / world) * world * math.prod(shape[1:])


def test_dim0_layout_rejects_scalar():
    with pytest.raises(ValueError, match=r"reshape it to \(1,\)"):
        dim0_layout((), 4)
