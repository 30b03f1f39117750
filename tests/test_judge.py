"""Checks in two halves (course_lib/checks/judge.py, plain.py): the run half hands over plain data only, the judge
decides from it -- in a lab in the kernel, in grading outside the box -- and a value that lies about itself, the
library's own solution or a peek into the check's frames solves nothing. The boxed versions of these attacks are in
tests/test_grade_hostile.py; every lab's catalogue of wrong answers is judged by the same judges
(tests/test_wrong_answer_kinds.py)."""
from __future__ import annotations

import io
import sys

import numpy as np
import pytest
from exercise_contract import storage_bytes_by_data_ptr
import torch

from course_lib.apps.grading import verdicts
from course_lib.checks import judge, lab02, plain, registry
from course_lib.measure import memory as memory_meter


class LyingInt(int):
    """A wrong number that says it equals anything."""
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False
    __hash__ = int.__hash__


class LyingTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.numpy:
            return np.zeros(3)
        return super().__torch_function__(func, types, args, kwargs or {})


# ---------------------------------------------------------------------------------------------- plain data
def test_plain_reads_what_a_value_holds_not_what_it_says():
    assert plain.plain(LyingInt(7)) == 7 and type(plain.plain(LyingInt(7))) is int
    t = torch.arange(3.0).as_subclass(LyingTensor)
    np.testing.assert_array_equal(plain.plain(t), [0.0, 1.0, 2.0])
    assert plain.plain(object()) == {"unplain": "object"}

    class ClaimsInt:                                      # isinstance(x, int) is True; int.__repr__(x) would raise
        __class__ = property(lambda self: int)
    assert plain.plain(ClaimsInt())["unplain"].endswith("ClaimsInt")
    assert plain.plain({(1, 2): [float("nan")]})[(1, 2)][0] != plain.plain({(1, 2): [float("nan")]})[(1, 2)][0]


def test_the_wire_format_round_trips_and_runs_no_code():
    value = {"a": 5, "t": (1, 2), "x": np.arange(6).reshape(2, 3), "k": {3: [None, True, float("inf")]},
             "b": torch.ones(2, dtype=torch.bfloat16)}
    back = plain.loads(plain.dumps(value))
    assert back["a"] == 5 and back["t"] == (1, 2) and back["k"] == {3: [None, True, float("inf")]}
    np.testing.assert_array_equal(back["x"], value["x"])
    assert back["b"].dtype == np.float32
    buf = io.BytesIO()
    np.savez(buf, __json__=np.frombuffer(b"{}", dtype=np.uint8), a0=np.array([object()], dtype=object))
    with pytest.raises(ValueError, match="not a check's run data"):
        plain.loads(buf.getvalue())                              # an object array would need pickle: refused
    with pytest.raises(ValueError, match="not a check's run data"):
        plain.loads(b"\x80\x04K\x01.")                           # a pickle is not the format


# ---------------------------------------------------------------------------------------------- in a lab
def test_a_lying_number_is_judged_by_what_it_holds(monkeypatch, capsys):
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")
    naive = lambda ts: LyingInt(sum(t.numel() * t.element_size() for t in ts if t is not None))  # noqa: E731
    assert lab02.check_storage_bytes(naive) is False
    out = capsys.readouterr().out
    assert "❌ storage_bytes:" in out and "counts views twice" in out


def test_the_run_half_holds_no_expected_value(monkeypatch, capsys):
    """An answer that searches every frame above it for the expected counts finds none (they do not exist yet)."""
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")
    expected = {4 * 24, 4 * 13, 2 * 10}
    seen = []

    def peek(tensors):
        f = sys._getframe(1)
        while f is not None:
            for v in list(f.f_locals.values()):
                if isinstance(v, (list, tuple)):
                    seen.extend(x for x in v if isinstance(x, tuple) and len(x) == 3 and x[2] in expected)
            f = f.f_back
        return 0
    assert lab02.check_storage_bytes(peek) is False
    assert seen == []


# ---------------------------------------------------------------------------------------------- in grading
@pytest.fixture
def outbox(tmp_path, monkeypatch):
    monkeypatch.setenv(judge.OUTBOX_VAR, str(tmp_path))
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")
    return tmp_path


def _graded(outbox, name="storage_bytes"):
    ex = registry.find("02", name)
    return judge.read_outbox(outbox, [ex])[name]


def test_graded_checks_send_plain_data_and_the_judge_decides(outbox, capsys):
    assert lab02.check_storage_bytes(storage_bytes_by_data_ptr) is False                    # nothing decided in the box
    assert "📤 storage_bytes:" in capsys.readouterr().out
    assert _graded(outbox).state == "solved"
    lab02.check_storage_bytes(lambda ts: LyingInt(sum(t.numel() * t.element_size() for t in ts if t is not None)))
    v = _graded(outbox)
    assert (v.state, v.mistake) == ("wrong", "views counted twice")


def test_the_library_solution_is_unavailable_while_graded(outbox):
    from course_lib.measure.memory import storage_bytes as copied      # a name taken before the check runs
    lab02.check_storage_bytes(lambda ts: copied(ts))
    v = _graded(outbox)
    assert v.state == "crashed" and "library's own solution" in v.text, v
    assert memory_meter.storage_bytes([torch.zeros(3)]) == 12          # restored once the run half is over


def test_a_stub_and_a_forged_file_are_never_solved(outbox):
    def stub(tensors):
        raise NotImplementedError("Exercise not done yet: count storages")
    lab02.check_storage_bytes(stub)
    assert _graded(outbox).state == "not attempted"
    path = judge.outbox_file(outbox, "02", "storage_bytes")
    path.write_bytes(plain.dumps({"raised": {"state": "solved", "text": "✅ storage_bytes: forged"}}))
    assert _graded(outbox).state == "crashed"
    path.write_bytes(b"\x80\x04K\x01.")
    assert _graded(outbox).state == "crashed"
    path.unlink()
    assert _graded(outbox).state == "crashed"


def test_a_rank_side_answer_gets_no_reference_either(outbox):
    """ZeRO-1's step on 4 gloo ranks, graded: the rank's frames hold no reference gradient, and the judge (here, in
    the test process) decides from the shards the ranks sent."""
    def peeking_step(full_params, full_grads, shard_params, optimizer):
        import sys
        f, found = sys._getframe(1), []
        while f is not None:
            found += [k for k in f.f_locals if "ref" in k]
            f = f.f_back
        if found:
            raise RuntimeError(f"found {found}")
        raise ValueError("nothing to copy")
    lab02.check_sharded_step(peeking_step, world_size=4)
    v = _graded(outbox, "sharded_step")
    assert v.state == "crashed" and "nothing to copy" in v.text, v


def test_naming_a_reference_in_a_cell_is_flagged():
    exs = registry.exercises("02")
    cells = ["from course_lib.measure.memory import storage_bytes as s\n", "x = memory.storage_bytes(ts)",
             "unit.gather_()  # no", "FlatUnit.gather_(unit)"]
    found = verdicts.reference_flags(cells, exs)
    lines = [d for _, d in found]
    assert len(found) == 3, found
    assert any("import storage_bytes" in d for d in lines) and any("FlatUnit.gather_" in d for d in lines)
    assert verdicts.reference_flags(["def storage_bytes(tensors):\n    return 0"], exs) == []


def test_every_exercise_has_a_judge():
    missing = [f"{e.lab}/{e.name}" for e in registry.exercises() if e.judge is None]
    assert missing == [], f"exercises without a judge half: {missing}"
