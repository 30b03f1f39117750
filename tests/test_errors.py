"""The one walk of an error's insides (course_lib.runtime.errors), on DCP's real CheckpointException."""
import errno

from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from course_lib.runtime.errors import inner_errors, rank_failures, root_cause


def _raised(exc):
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return _wrap_exception(e)


def test_rank_failures_unwraps_dcp_in_rank_order():
    full, gone = OSError(errno.ENOSPC, "No space left on device"), ConnectionError("peer closed")
    e = CheckpointException("save failed", {3: _raised(gone), 1: _raised(full)})
    got = rank_failures(e)
    assert list(got) == [1, 3] and got[1][0] is full and got[3][0] is gone
    assert got[1][1] and got[1][1][-1].name == "_raised"          # the rank's own frames
    assert rank_failures(ValueError("plain")) == {}


def test_inner_errors_walks_causes_groups_and_failures_once():
    leaf = OSError(errno.EDQUOT, "quota")
    ck = CheckpointException("x", {0: _raised(leaf)})
    try:
        raise RuntimeError("outer") from ck
    except RuntimeError as e:
        outer = e
    group = ExceptionGroup("g", [outer, ValueError("v")])
    found = list(inner_errors(group))
    assert leaf in found and ck in found and outer in found and len(found) == len({id(x) for x in found})
    assert leaf not in list(inner_errors(group, failures=False))


def test_context_only_when_asked():
    try:
        try:
            raise NotImplementedError("stub")
        except NotImplementedError:
            raise KeyError("while handling")
    except KeyError as e:
        err = e
    assert not any(isinstance(x, NotImplementedError) for x in inner_errors(err))
    assert any(isinstance(x, NotImplementedError) for x in inner_errors(err, context=True))


def test_root_cause_and_a_cycle_ends():
    a, b = ValueError("a"), TypeError("b")
    b.__cause__ = a
    assert root_cause(b) is a and root_cause(a) is a
    a.__cause__ = b                                               # a cycle: the walk still ends
    assert root_cause(b) in (a, b)
    assert len(list(inner_errors(b))) == 2
