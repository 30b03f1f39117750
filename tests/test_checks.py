"""Exercise checks: right answers pass, plausible wrong answers get the specific feedback."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from course_lib import checks
from course_lib.checks import (
    CheckFailed, assert_close, averaged_twice, check, not_updated, parity_check, skipped_collective,
    summed_not_averaged, wrong_shard_offset,
)

N = 4
EXPECTED = np.arange(1, 17, dtype=np.float32).reshape(N, 4)   # 4 shards of one row each


class FakeRankError(RuntimeError):
    """Shaped like course_lib.launch.RankError (duck-typed by checks)."""

    def __init__(self, rank, exc_type, traceback_text):
        self.rank, self.exc_type, self.traceback_text = rank, exc_type, traceback_text
        super().__init__(f"rank {rank} raised {exc_type}")


def failure(got, expected=EXPECTED, **kw) -> str:
    kw.setdefault("rtol", 1e-5)
    kw.setdefault("atol", 1e-6)
    with pytest.raises(CheckFailed) as info:
        assert_close("grads", got, expected, **kw)
    return str(info.value)


# ---------------------------------------------------------------------------------- assert_close
@pytest.mark.parametrize("got", [
    EXPECTED.copy(), torch.tensor(EXPECTED), jnp.asarray(EXPECTED), EXPECTED.tolist(),
    EXPECTED + 1e-7,
])
def test_assert_close_accepts_right_answers_in_any_framework(got, capsys):
    assert assert_close("grads", got, EXPECTED, rtol=1e-5, atol=1e-6) is True
    assert capsys.readouterr().out.startswith("✅ grads: 16 elements match")


def test_assert_close_reports_rank_worst_element_errors_and_dtype():
    got = EXPECTED.copy()
    got[2, 3] += 0.5
    msg = failure(got, rank=2)
    assert msg.startswith("❌ grads (rank 2): 1 of 16 element(s) differ beyond rtol=1e-05, atol=1e-06")
    assert "worst at index [2, 3]: expected 12, got 12.5 (abs err 0.5" in msg
    assert "max abs err 0.5" in msg and "dtype got float32, expected float32" in msg


def test_assert_close_shape_mismatch_recognises_a_local_shard_and_padding():
    assert "shape mismatch: got (1, 4), expected (4, 4)" in failure(EXPECTED[:1])
    assert "1/4 of the elements → looks like one rank's shard" in failure(EXPECTED[:1])
    padded = np.concatenate([EXPECTED.ravel(), np.zeros(3, np.float32)])
    assert "3 extra trailing element(s) → strip the padding" in failure(padded, EXPECTED.ravel())


def test_summed_instead_of_averaged():
    msg = failure(EXPECTED * N, hint=summed_not_averaged(N))
    assert "got is 4× expected → you summed instead of averaging (forgot ÷4)" in msg
    msg = failure(EXPECTED / N, hint=[summed_not_averaged(N), averaged_twice(N)])
    assert "you averaged twice" in msg


def test_skipped_collective_names_the_rank():
    local = [EXPECTED * 0 + r for r in range(N)]          # rank r holds all r; the mean is 1.5
    expected = np.full_like(EXPECTED, 1.5)
    msg = failure(local[3], expected, rank=3, hint=skipped_collective(local))
    assert "got equals rank 3's local value → the collective was skipped" in msg


def test_wrong_shard_offset_shift_permutation_and_rank_ignored():
    detector = wrong_shard_offset(N)
    assert "shifted by 1 shard(s): shard r holds expected's shard r-1" in failure(np.roll(EXPECTED, 1, 0), hint=detector)
    perm = EXPECTED[[1, 0, 2, 3]]
    assert "shards come in the order [1, 0, 2, 3]" in failure(perm, hint=detector)
    same = np.tile(EXPECTED[:1], (N, 1))
    assert "every shard holds shard 0 → the offset ignores the rank" in failure(same, hint=detector)


def test_generic_detectors_and_static_hints():
    assert "all zeros → the output buffer was never filled" in failure(np.zeros_like(EXPECTED))
    assert "a sign flip" in failure(-EXPECTED)
    assert "got has NaN/inf" in failure(EXPECTED * np.nan)
    before = EXPECTED - 1
    assert "the update was not applied" in failure(before, hint=not_updated(before))
    assert "\n   hint: check the learning rate" in failure(EXPECTED * 3, hint="check the learning rate")
    assert "× expected everywhere → a wrong scale factor" in failure(EXPECTED * 3)


def test_one_wrong_number_is_not_called_a_scale_factor():
    """Any single wrong number has a ratio to the right one: that is no evidence of a scale factor."""
    msg = failure(np.array([7.0]), np.array([3.0]))
    assert "expected 3, got 7" in msg and "scale factor" not in msg


def test_pytrees_by_key_and_index():
    expected = {"w": EXPECTED, "b": [np.ones(2), 3.0]}
    assert assert_close("params", {"w": torch.tensor(EXPECTED), "b": [np.ones(2), 3.0]}, expected,
                        rtol=0, atol=0)
    msg = failure({"w": EXPECTED, "c": [np.ones(2), 3.0]}, expected)
    assert "keys differ; missing ['b'], unexpected ['c']" in msg
    msg = failure({"w": EXPECTED, "b": [np.ones(2), 4.0]}, expected)
    assert msg.startswith("❌ grads['b'][1]: 1 of 1 element(s) differ") and "expected 3, got 4" in msg
    assert "got 1 item(s), expected 2" in failure({"w": EXPECTED, "b": [np.ones(2)]}, expected)


def test_bf16_values_and_dtype_check():
    bf16 = torch.tensor(EXPECTED, dtype=torch.bfloat16)
    assert parity_check("bf16 logits", bf16, EXPECTED, kind="bf16")
    assert parity_check("jax bf16", jnp.asarray(EXPECTED, dtype=jnp.bfloat16), EXPECTED, kind="bf16")
    msg = failure(bf16, check_dtype=True)
    assert "dtype mismatch: got bfloat16, expected float32" in msg


# --------------------------------------------------------------------------------- parity_check
def test_parity_check_uses_the_documented_tolerances():
    assert set(checks.TOLERANCES) >= {"fp32", "cross_framework", "bf16", "exact"}
    ref = np.float32(1.0)
    assert parity_check("loss", ref * (1 + 5e-6), ref)                                  # fp32 ok
    with pytest.raises(CheckFailed, match="rtol=1e-05"):
        parity_check("loss", ref * (1 + 5e-5), ref)                                     # fp32 too far
    assert parity_check("loss", ref * (1 + 5e-5), ref, kind="cross_framework")
    with pytest.raises(ValueError, match="kind='fp16'"):
        parity_check("loss", ref, ref, kind="fp16")


# ------------------------------------------------------------------------------------- check()
def test_check_passes_with_detail(capsys):
    with check("all-reduce") as c:
        assert_close("sum", [10.0, 10.0], [10.0, 10.0], rtol=0, atol=0)
    assert c.passed is True
    assert capsys.readouterr().out == "✅ all-reduce: 2 elements, exactly equal\n"

    @check("ring cost")
    def passed():
        return "768 bytes per rank"
    assert passed is True and capsys.readouterr().out == "✅ ring cost: 768 bytes per rank\n"


def test_not_implemented_is_reported_not_raised(capsys):
    with check("average") as c:
        raise NotImplementedError("Exercise not done yet: divide by the world size")
    assert c.passed is False
    assert capsys.readouterr().out == "⏳ average: not implemented yet — divide by the world size\n"

    @check("bare", todo="write bare() above")
    def result():
        raise NotImplementedError
    assert result is False and "⏳ bare: not implemented yet — write bare() above" in capsys.readouterr().out


def test_not_implemented_on_a_rank_duck_typed(capsys):
    tb = ('Traceback (most recent call last):\n  File "<cell>", line 3, in step\n'
          'NotImplementedError: Exercise not done yet: reduce-scatter the grads\n')
    with check("fsdp step") as c:
        raise FakeRankError(2, "NotImplementedError", tb)
    assert c.passed is False
    assert capsys.readouterr().out == ("⏳ fsdp step: not implemented yet — reduce-scatter the grads "
                                       "(on rank 2)\n")
    with check("wrapped"):                         # found through the exception chain too
        try:
            raise FakeRankError(0, "NotImplementedError", "NotImplementedError\n")
        except FakeRankError as exc:
            raise RuntimeError("launch failed") from exc
    assert "⏳ wrapped: not implemented yet — fill in the code" in capsys.readouterr().out


def test_an_error_while_handling_not_implemented_is_a_real_error():
    with pytest.raises(KeyError):
        with check("fallback"):
            try:
                raise NotImplementedError("library op missing")
            except NotImplementedError:
                raise KeyError("real bug in the fallback")


def test_wrong_answers_raise_check_failed_with_the_check_name():
    with pytest.raises(CheckFailed, match=r"^❌ average: grads: 16 of 16 element"):
        with check("average"):
            assert_close("grads", EXPECTED * 2, EXPECTED, rtol=0, atol=0)
    with pytest.raises(CheckFailed, match=r"^❌ shapes: expected \(4, 4\)"):
        with check("shapes"):
            assert EXPECTED.shape == (3, 4), "expected (4, 4)"
    tb = "Traceback...\ncourse_lib.checks.CheckFailed: ❌ grads (rank 1): 3 of 16 differ\n   worst at [0]"
    with pytest.raises(CheckFailed, match=r"^❌ dp: on rank 1: grads \(rank 1\): 3 of 16 differ\n   worst"):
        with check("dp"):
            raise FakeRankError(1, "CheckFailed", tb)


def test_other_errors_propagate_unchanged():
    with pytest.raises(TypeError, match="learner bug"):
        with check("average"):
            raise TypeError("learner bug")
    with pytest.raises(FakeRankError):
        with check("average"):
            raise FakeRankError(0, "ValueError", "ValueError: bad\n")


# -- a lab (not strict): a wrong answer or a crash prints ❌ and returns False; hints come in layers ------
@pytest.fixture
def lab_mode(monkeypatch):
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")


def test_in_a_lab_a_wrong_answer_prints_and_returns_false(lab_mode, capsys):
    @checks.check("sum")
    def _():
        checks.assert_close("sum", 5.0, 6.0, rtol=0, atol=0)
    assert _ is False
    out = capsys.readouterr().out
    assert out.startswith("❌ sum:") and "uses the reference answer until this check passes" in out


def test_in_a_lab_a_crash_names_the_exception_and_folds_the_traceback(lab_mode, capsys):
    def learner():
        return [1, 2][5]
    with checks.check("index") as c:
        learner()
    assert c.passed is False
    out = capsys.readouterr().out
    assert "❌ index: your code raised IndexError: list index out of range" in out
    assert "checks.last_error()" in out and "Traceback" not in out
    assert checks.last_error() is None                   # shown once: printed, nothing returned to show again
    assert "Traceback" in capsys.readouterr().out and "IndexError" in checks.core.last_error_text()
    assert "likely cause: an index past the end" in out


@pytest.mark.parametrize("kind, message, cause", [
    ("RuntimeError", "Connection closed by peer [127.0.0.1]:29500", "another rank stopped early"),
    ("RuntimeError", "shape '[4, 17]' is invalid for input of size 70", "shape or size is not what this call expects"),
    ("RuntimeError", "expected scalar type Float but found Double", "different dtypes"),
    ("RuntimeError", "setStorage: sizes [17], strides [1], storage offset 0 out of bounds for storage of size 0",
     "a storage that was freed"),
    ("AttributeError", "'FlatParam' object has no attribute 'set_view'", "misspelt name"),
    ("ValueError", "too many values to unpack", "unpacking assumes a length"),
    ("ValueError", "min() arg is an empty sequence", "of an empty list"),
    ("TypeError", "'>' not supported between instances of 'NoneType' and 'str'", "different kinds"),
    ("OSError", "something unheard of", ""),
    ("NameError", "Found an unbound axis name: data.", "an axis name the mesh does not have"),
    ("AttributeError", "'NoneType' object has no attribute 'unshard'", "a value is None here"),
    ("TypeError", "'NoneType' object is not iterable", "a value is None here"),
    ("TypeError", "bad operand type for unary -: 'builtin_function_or_method'", "a method used without calling it"),
    ("TypeError", "f() missing 1 required positional argument: 'y'", "arguments do not match"),
])
def test_a_crash_names_its_likely_cause_from_type_and_message(kind, message, cause):
    from course_lib.checks.core import likely_cause
    got = likely_cause(kind, message)
    assert (cause in got) if cause else got == "", got


def test_under_the_tests_a_wrong_answer_raises():
    with pytest.raises(CheckFailed, match="❌ sum:"):
        with checks.check("sum"):
            checks.assert_close("sum", 5.0, 6.0, rtol=0, atol=0)


def test_the_todo_line_says_what_the_check_tests_and_offers_hints(capsys):
    checks.register_hints({"ring": ["each rank sends (N-1)/N of V", "count both halves of an all-reduce"]})
    with checks.check("ring", tests="bytes per rank for 4 collectives at 5 sizes"):
        raise NotImplementedError("Exercise not done yet: count what one rank sends")
    out = capsys.readouterr().out
    assert "⏳ ring: not implemented yet — count what one rank sends" in out
    assert "The check will test: bytes per rank for 4 collectives at 5 sizes" in out
    assert 'checks.hint("ring")' in out
    assert checks.hint("ring") is None                   # a cell shows the hint once (printed, not also returned)
    shown = capsys.readouterr().out
    assert shown.startswith("💡 ring, hint 1 of 2: each rank sends") and shown.count("💡") == 1
    assert 'checks.hint("ring", 2)' in shown
    with pytest.raises(ValueError, match="has hints 1..2"):
        checks.hint("ring", 3)
    with pytest.raises(ValueError, match="no hints for 'nope'"):
        checks.hint("nope")
