"""Lab 08's exercise checks: right answers pass, stubs are "not implemented yet", and at least four plausible
wrong answers per exercise are rejected with the right diagnosis."""
from __future__ import annotations

import math

import pytest

from course_lib.checks import CheckFailed, lab08
from course_lib.maths import planner


# -- exercise 1: step_seconds ------------------------------------------------------------------------------
def right_step(strategy, cost, flops, compute, comm, gamma):
    return lab08.reference_step_seconds(strategy, cost, flops, compute, comm, gamma)


def stub_step(*args):
    raise NotImplementedError("Exercise not done yet: add compute, γ and every collective's α-β time")


def _ab(comm, o):
    return comm.alpha_beta(o.op, o.group_size)


def _fw(cost, gamma):
    return gamma * sum(o.count for o in cost.ops if o.op in ("all_gather", "reduce_scatter"))


def no_alpha(strategy, cost, flops, compute, comm, gamma):
    fw = _fw(cost, gamma)
    return compute.seconds(flops) + fw + sum(_ab(comm, o).beta_s_per_byte * o.wire_bytes for o in cost.ops)


def alpha_once(strategy, cost, flops, compute, comm, gamma):
    fw = _fw(cost, gamma)
    return compute.seconds(flops) + fw + sum(_ab(comm, o).alpha_s + _ab(comm, o).beta_s_per_byte * o.wire_bytes
                                             for o in cost.ops)


def payload_bytes(strategy, cost, flops, compute, comm, gamma):
    fw = _fw(cost, gamma)
    return compute.seconds(flops) + fw + sum(o.count * _ab(comm, o).alpha_s + _ab(comm, o).beta_s_per_byte
                                             * o.payload_bytes for o in cost.ops)


def one_fit(strategy, cost, flops, compute, comm, gamma):
    fw = _fw(cost, gamma)
    ar = lambda g: comm.alpha_beta("all_reduce", g)  # noqa: E731
    return compute.seconds(flops) + fw + sum(o.count * ar(o.group_size).alpha_s
                                             + ar(o.group_size).beta_s_per_byte * o.wire_bytes for o in cost.ops)


def no_compute(strategy, cost, flops, compute, comm, gamma):
    return right_step(strategy, cost, flops, compute, comm, gamma) - compute.seconds(flops)


def no_gamma(strategy, cost, flops, compute, comm, gamma):
    return compute.seconds(flops) + sum(comm.seconds(o) for o in cost.ops)


def gamma_everywhere(strategy, cost, flops, compute, comm, gamma):
    return compute.seconds(flops) + gamma * sum(o.count for o in cost.ops) + sum(comm.seconds(o) for o in cost.ops)


def milliseconds(*args):
    return 1e3 * right_step(*args)


def test_step_seconds_right_and_stub(capsys):
    assert lab08.check_step_seconds(right_step) is True
    assert "✅ step_seconds: 4 configurations" in capsys.readouterr().out
    assert lab08.check_step_seconds(stub_step) is False
    assert "⏳ step_seconds: not implemented yet — add compute" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (no_alpha, "left out α"), (alpha_once, "α is per *call*"), (payload_bytes, "*wire* bytes"),
    (one_fit, "each op has its own α and β"), (no_compute, "left out compute"),
    (no_gamma, "left out the framework term"), (gamma_everywhere, "charged γ on all-reduces"), (milliseconds, "got"),
])
def test_step_seconds_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab08.check_step_seconds(wrong)
    assert says in str(err.value) and str(err.value).startswith("❌ step_seconds:")


# -- exercise 2: compute_bound_batch -----------------------------------------------------------------------
def right_batch(model, cluster, strategy, seq_len, checkpointing):
    for b in range(1, lab08.LIMIT + 1):
        if planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing).compute_bound:
            return b
    return None


def closed_form(model, cluster, strategy, seq_len, checkpointing):
    """The crossing point as a fraction (compute and comm are linear in b when comm has no α... nearly)."""
    p = planner.plan(model, cluster, strategy, 1, seq_len=seq_len, checkpointing=checkpointing)
    return p.comm_s / p.compute_s


def off_by_one(*args):
    return right_batch(*args) - 1


def in_tokens(model, cluster, strategy, seq_len, checkpointing):
    return right_batch(model, cluster, strategy, seq_len, checkpointing) * seq_len


def global_batch(model, cluster, strategy, seq_len, checkpointing):
    return right_batch(model, cluster, strategy, seq_len, checkpointing) * cluster.world


def exposed_not_comm(model, cluster, strategy, seq_len, checkpointing):
    """Compares compute with the *exposed* communication: almost always 1."""
    for b in range(1, lab08.LIMIT + 1):
        p = planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing)
        if p.compute_s >= p.exposed_comm_s:
            return b


def test_compute_bound_batch_right(capsys):
    assert lab08.check_compute_bound_batch(right_batch) is True
    assert lab08.check_compute_bound_batch(lab08.reference_compute_bound_batch) is True
    assert "✅ compute_bound_batch:" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (off_by_one, "off by one"), (in_tokens, "that is tokens"), (global_batch, "the global batch"),
    (closed_form, "round the crossing point up"), (exposed_not_comm, "too small"),
])
def test_compute_bound_batch_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab08.check_compute_bound_batch(wrong)
    assert says in str(err.value)


# -- exercise 3: plan_70b -----------------------------------------------------------------------------------
def _plan(strategy="fsdp", batch=1, checkpointing="full", replicate=1, memory_bytes=None):
    p = planner.plan(planner.LLAMA3_70B, lab08.EX3_CLUSTER, strategy, batch, seq_len=lab08.EX3_SEQ,
                     checkpointing=checkpointing, replicate=replicate)
    return {"strategy": strategy, "batch": batch, "checkpointing": checkpointing, "replicate": replicate,
            "memory_bytes": p.total if memory_bytes is None else memory_bytes}


def test_plan_70b_right(capsys):
    assert lab08.check_plan_70b(lab08.reference_plan_70b()) is True
    assert lab08.check_plan_70b(_plan(batch=1)) is True            # fits too: any plan that fits and is estimated
    assert "✅ plan_70b: fsdp, batch 1" in capsys.readouterr().out
    assert lab08.check_plan_70b(lambda: (_ for _ in ()).throw(NotImplementedError("Exercise not done yet: x"))) is False


STATE_ONLY = 16 * planner.LLAMA3_70B.params / 32


@pytest.mark.parametrize("wrong, says", [
    (_plan(strategy="dp"), "model state per GPU alone"),
    (_plan(batch=1, checkpointing="none"), "without checkpointing"),
    (_plan(batch=4), "activations take"),
    (_plan(strategy="hsdp", replicate=4), "model state per GPU alone"),
    (_plan(batch=2, memory_bytes=STATE_ONLY), "ignores activations"),
    (_plan(batch=2, memory_bytes=STATE_ONLY / 4), "is off"),        # "~4 GB per device"-style: fp32 weights only
    ({**_plan(batch=1), "batch": 0}, "refuses this plan"),
    ({"strategy": "fsdp", "batch": 1}, "exactly the keys"),
])
def test_plan_70b_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab08.check_plan_70b(wrong)
    assert says in str(err.value)


def test_hints_are_layered():
    for name in ("step_seconds", "compute_bound_batch", "plan_70b"):
        levels = [lab08.hint(name, k) for k in (1, 2, 3)]
        assert len(set(levels)) == 3 and all(levels)
    with pytest.raises(KeyError, match="exercises"):
        lab08.hint("nope")
    assert not math.isnan(lab08.reference_plan_70b()["memory_bytes"])


# -- exercise 4: full_ac_cost ---------------------------------------------------------------------------------
def _tps(model, cluster, batch, seq_len, ac):
    return planner.plan(model, cluster, "fsdp", batch, seq_len=seq_len, checkpointing=ac).tokens_per_s_per_gpu


def right_cost(model, cluster, batch, seq_len):
    return 1 - _tps(model, cluster, batch, seq_len, "full") / _tps(model, cluster, batch, seq_len, "selective")


def kept(*args):
    return 1 - right_cost(*args)


def percent(*args):
    return 100 * right_cost(*args)


def flipped(*args):
    return -right_cost(*args)


def from_none(model, cluster, batch, seq_len):
    return 1 - _tps(model, cluster, batch, seq_len, "full") / _tps(model, cluster, batch, seq_len, "none")


def by_hfu(model, cluster, batch, seq_len):
    hfu = lambda ac: planner.plan(model, cluster, "fsdp", batch, seq_len=seq_len, checkpointing=ac).hfu  # noqa: E731
    return 1 - hfu("full") / hfu("selective")


def by_step(model, cluster, batch, seq_len):
    step = lambda ac: planner.plan(model, cluster, "fsdp", batch, seq_len=seq_len, checkpointing=ac).step_s  # noqa: E731
    return step("full") / step("selective") - 1


def test_full_ac_cost_right_and_stub(capsys):
    assert lab08.check_full_ac_cost(right_cost) is True
    assert lab08.check_full_ac_cost(lab08.reference_full_ac_cost) is True
    assert "✅ full_ac_cost: Llama-3-8B 8 GPUs: -" in capsys.readouterr().out
    stub = lambda *a: (_ for _ in ()).throw(NotImplementedError("Exercise not done yet: price both plans"))  # noqa: E731
    assert lab08.check_full_ac_cost(stub) is False
    assert "⏳ full_ac_cost: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (kept, "fraction of throughput KEPT"), (percent, "that is a percentage"), (flipped, "the sign is flipped"),
    (from_none, "compared with no checkpointing"), (by_hfu, "you compared HFU"), (by_step, "compared step times"),
    (lambda *a: "12%", "return a float"), (lambda *a: 0.5, "compare plan(..., checkpointing='full')"),
])
def test_full_ac_cost_wrong_answers_are_named(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab08.check_full_ac_cost(wrong)
    assert says in str(err.value) and str(err.value).startswith("❌ full_ac_cost:")


def test_full_ac_cost_hints_have_no_code():
    hints = lab08.HINTS["full_ac_cost"]
    assert len(hints) == 3 and lab08.hint("full_ac_cost", 1).startswith("Price both")
    assert not any(token in h for h in hints for token in ("plan(", "=", "tokens_per_s_per_gpu", "lambda"))
