"""The synthetic Markov token task: determinism, rank slices, the shift, errors, the entropy floor."""
import math

import numpy as np
import pytest

from course_lib.models.data import TokenTask

TASK = TokenTask(vocab_size=67, seq_len=30, seed=0)


def test_batches_are_deterministic_in_seed_and_step():
    x1, y1 = TASK.global_batch(step=5, batch_size=12)
    x2, y2 = TokenTask(67, 30, seed=0).global_batch(step=5, batch_size=12)  # a fresh object, same numbers
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert not np.array_equal(x1, TASK.global_batch(step=6, batch_size=12)[0])
    assert not np.array_equal(x1, TokenTask(67, 30, seed=1).global_batch(step=5, batch_size=12)[0])


def test_shapes_dtypes_and_range():
    x, y = TASK.global_batch(step=0, batch_size=7)
    assert x.shape == y.shape == (7, 30) and x.dtype == y.dtype == np.int64
    assert x.min() >= 0 and max(x.max(), y.max()) < 67


def test_y_is_x_shifted_by_one():
    x, y = TASK.global_batch(step=3, batch_size=9)
    assert np.array_equal(x[:, 1:], y[:, :-1])


def test_every_transition_is_allowed_by_the_chain():
    x, y = TASK.global_batch(step=0, batch_size=64)
    assert (TASK.transition_matrix()[x, y] > 0).all()


@pytest.mark.parametrize("world_size", [1, 2, 3, 6])
def test_rank_slices_concatenate_to_the_global_batch(world_size):
    gx, gy = TASK.global_batch(step=2, batch_size=12)
    parts = [TASK.rank_batch(step=2, batch_size=12, rank=r, world_size=world_size) for r in range(world_size)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), gx)
    assert np.array_equal(np.concatenate([p[1] for p in parts]), gy)


def test_bad_batch_size_names_both_values_and_the_fix():
    with pytest.raises(ValueError, match=r"batch_size\(10\) % world_size\(4\) = 2.*use batch_size 8 or 12"):
        TASK.rank_batch(step=0, batch_size=10, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"batch_size\(3\) % world_size\(4\) = 3.*use batch_size 4$"):
        TASK.rank_batch(step=0, batch_size=3, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"rank\(4\) must be in \[0, world_size\(4\)\)"):
        TASK.rank_batch(step=0, batch_size=8, rank=4, world_size=4)
    with pytest.raises(ValueError, match=r"vocab_size=2"):
        TokenTask(vocab_size=2, seq_len=30)


def test_chain_is_sparse_and_rows_sum_to_one():
    P = TASK.transition_matrix()
    np.testing.assert_allclose(P.sum(axis=1), 1.0)
    assert set((P > 0).sum(axis=1)) == {2, 3}


def test_entropy_floor_is_below_chance_and_matches_sampled_loss():
    floor = TASK.entropy_floor()
    assert 0.3 < floor < math.log(67) - 2, floor  # far below chance: there is something to learn
    x, y = TASK.global_batch(step=0, batch_size=2048)
    sampled = -np.log(TASK.transition_matrix()[x, y]).mean()  # the loss of a model that knows the chain
    assert abs(sampled - floor) < 0.02, (sampled, floor)


def test_task_is_a_value():
    assert TokenTask(67, 30, 0) == TASK and hash(TokenTask(67, 30, 0)) == hash(TASK)
    with pytest.raises(ValueError):  # the chain is read-only: nobody edits it by accident
        TASK.probs[0, 0] = 1.0
