"""Lab 08's exercise checks: right answers pass, stubs are "not implemented yet", hints are layered. The wrong
answers, by kind of mistake, are in tests/wrong_answers/lab08.py (tests/test_wrong_answer_kinds.py runs them)."""
from __future__ import annotations

import math

import pytest

from course_lib import checks
from course_lib.checks import lab08
from course_lib.maths import planner


# -- exercise 1: step_seconds ------------------------------------------------------------------------------
def right_step(strategy, cost, flops, compute, comm, gamma):
    return lab08.reference_step_seconds(strategy, cost, flops, compute, comm, gamma)


def stub_step(*args):
    raise NotImplementedError("Exercise not done yet: add compute, γ and every collective's α-β time")


def test_step_seconds_right_and_stub(capsys):
    assert lab08.check_step_seconds(right_step) is True
    assert "✅ step_seconds: 4 configurations" in capsys.readouterr().out
    assert lab08.check_step_seconds(stub_step) is False
    assert "⏳ step_seconds: not implemented yet — add compute" in capsys.readouterr().out


def test_step_seconds_two_wrong_terms_are_each_named(capsys, monkeypatch):
    """α left out *and* γ left out: neither one-mistake formula fits; the ❌ names both terms."""
    def two_wrong(strategy, cost, flops, compute, comm, gamma):
        return compute.seconds(flops) + sum(comm.alpha_beta(o.op, o.group_size).beta_s_per_byte * o.wire_bytes
                                            for o in cost.ops)
    def three_wrong(strategy, cost, flops, compute, comm, gamma):   # payload bytes, no compute, γ on every call
        return gamma * sum(o.count for o in cost.ops) + sum(
            o.count * comm.alpha_beta(o.op, o.group_size).alpha_s
            + comm.alpha_beta(o.op, o.group_size).beta_s_per_byte * o.payload_bytes for o in cost.ops)
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")        # lab mode: ❌ printed, False returned
    assert lab08.check_step_seconds(two_wrong) is False
    out = capsys.readouterr().out
    assert "more than one term is wrong" in out and "compare term by term" not in out
    assert "- framework: left out the framework term γ · calls" in out and "- communication: left out α" in out
    assert "compute:" not in out.split("more than one term")[1]
    assert lab08.check_step_seconds(three_wrong) is False
    out = capsys.readouterr().out
    for named in ("- compute: left out compute", "- framework: charged γ on all-reduces too",
                  "- communication: used payload bytes"):
        assert named in out, out


# -- exercise 2: compute_bound_batch -----------------------------------------------------------------------
def right_batch(model, cluster, strategy, seq_len, checkpointing):
    for b in range(1, lab08.LIMIT + 1):
        if planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing).compute_bound:
            return b
    return None


def test_compute_bound_batch_right(capsys):
    assert lab08.check_compute_bound_batch(right_batch) is True
    assert lab08.check_compute_bound_batch(lab08.reference_compute_bound_batch) is True
    assert "✅ compute_bound_batch:" in capsys.readouterr().out


def test_compute_bound_batch_pins_its_boundaries():
    """The check's last two cases exist for the text's two boundaries: an exact tie (">=") and 4096 itself."""
    (m, c, s, seq, ac), (m2, c2, s2, seq2, ac2) = lab08._EX2_CASES[-2:]
    b = lab08.reference_compute_bound_batch(m, c, s, seq, ac)
    p = planner.plan(m, c, s, b, seq_len=seq, checkpointing=ac)
    assert p.compute_s == p.comm_s, "the tie case no longer ties: search a new link bandwidth"
    assert lab08.reference_compute_bound_batch(m2, c2, s2, seq2, ac2) == lab08.LIMIT


# -- exercise 3: plan_70b -----------------------------------------------------------------------------------
def _plan(strategy="fsdp", batch=1, checkpointing="full", replicate=1, memory_bytes=None):
    p = planner.plan(planner.LLAMA3_70B, lab08.EX3_CLUSTER, strategy, batch, seq_len=lab08.EX3_SEQ,
                     checkpointing=checkpointing, replicate=replicate)
    return {"strategy": strategy, "batch": batch, "checkpointing": checkpointing, "replicate": replicate,
            "memory_bytes": p.total if memory_bytes is None else memory_bytes}


def test_plan_70b_right(capsys):
    assert lab08.check_plan_70b(lab08.reference_plan_70b()) is True
    assert lab08.check_plan_70b(_plan(batch=2)) is True            # the largest batch, estimated by the planner
    assert "✅ plan_70b: fsdp, batch 2" in capsys.readouterr().out
    assert lab08.check_plan_70b(lambda: (_ for _ in ()).throw(NotImplementedError("Exercise not done yet: x"))) is False


def test_hints_are_layered_and_asked_for_like_every_lab(capsys):
    from course_lib.checks import core
    assert not hasattr(lab08, "hint")             # one help API in every lab: checks.hint(name, level)
    for name in ("step_seconds", "compute_bound_batch", "plan_70b", "full_ac_cost"):
        levels = [core.hint_text(name, k) for k in (1, 2, 3)]
        assert len(set(levels)) == 3 and all(lab08.HINTS[name][k] in levels[k] for k in range(3))
    assert checks.hint("plan_70b", 3) is None and capsys.readouterr().out.count("💡 plan_70b, hint 3 of 3") == 1
    with pytest.raises(ValueError, match="exercises with hints"):
        checks.hint("nope")
    assert not math.isnan(lab08.reference_plan_70b()["memory_bytes"])


# -- exercise 4: full_ac_cost ---------------------------------------------------------------------------------
def _tps(model, cluster, batch, seq_len, ac):
    return planner.plan(model, cluster, "fsdp", batch, seq_len=seq_len, checkpointing=ac).tokens_per_s_per_gpu


def right_cost(model, cluster, batch, seq_len):
    return 1 - _tps(model, cluster, batch, seq_len, "full") / _tps(model, cluster, batch, seq_len, "selective")


def test_full_ac_cost_right_and_stub(capsys):
    assert lab08.check_full_ac_cost(right_cost) is True
    assert lab08.check_full_ac_cost(lab08.reference_full_ac_cost) is True
    out = capsys.readouterr().out
    assert "✅ full_ac_cost: Llama-3-8B 8 GPUs: 12.2% lost;" in out and ": -" not in out   # a loss, printed positive
    stub = lambda *a: (_ for _ in ()).throw(NotImplementedError("Exercise not done yet: price both plans"))  # noqa: E731
    assert lab08.check_full_ac_cost(stub) is False
    assert "⏳ full_ac_cost: not implemented yet" in capsys.readouterr().out


def test_full_ac_cost_hints_have_no_code():
    hints = lab08.HINTS["full_ac_cost"]
    assert len(hints) == 3 and hints[0].startswith("Price both")
    assert not any(token in h for h in hints for token in ("plan(", "=", "tokens_per_s_per_gpu", "lambda"))
