"""Cost model: ring wire bytes, analytic per-step cost by strategy, ledgers compared with it, alpha-beta fit."""
import doctest
import math

import pytest

from course_lib.maths import costs
from course_lib.maths import sharding
from course_lib.maths.costs import (AlphaBeta, fit_alpha_beta, ledger_wire_bytes, padded_numel, ratio,
                              record_wire_bytes, step_cost, wire_bytes)
from course_lib.comm.ledger import CollectiveRecord, Ledger


def test_docstrings_run():
    assert doctest.testmod(costs).failed == 0


@pytest.mark.parametrize("op, expected", [
    ("all_gather", 3 / 4 * 1000), ("reduce_scatter", 750), ("all_reduce", 1500), ("broadcast", 750),
    ("all_to_all", 750), ("collective_permute", 1000), ("barrier", 0), ("reduce", 750),
    ("gather", 3 / 16 * 1000), ("send", 1000), ("recv", 0),
])
def test_wire_bytes_ring_formulas(op, expected):
    assert wire_bytes(op, 1000, 4) == pytest.approx(expected)


@pytest.mark.parametrize("op", ["all_gather", "all_reduce", "collective_permute", "broadcast"])
def test_wire_bytes_single_rank_is_zero(op):
    assert wire_bytes(op, 1 << 20, 1) == 0


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    assert wire_bytes("all_reduce", 4096, 8) == wire_bytes("reduce_scatter", 4096, 8) + wire_bytes("all_gather", 4096, 8)


def test_wire_bytes_rejects_unknown_op():
    with pytest.raises(ValueError, match="'allgather' is not a known collective"):
        wire_bytes("allgather", 10, 2)


def test_record_and_ledger_wire_bytes():
    ag = CollectiveRecord(op="all_gather", nbytes=800, dtype="float32", group_size=8)
    ar = CollectiveRecord(op="all_reduce", nbytes=800, dtype="float32", group_size=8)
    assert record_wire_bytes(ag) == 700 and record_wire_bytes(ar) == 1400
    assert ledger_wire_bytes(Ledger([ag, ar, CollectiveRecord(op="barrier", nbytes=0, dtype="", group_size=8)])) == 2100


def test_ratio():
    assert ratio(150, 100) == 1.5 and ratio(0, 0) == 1.0 and ratio(1, 0) == math.inf


# -- analytic step cost ----------------------------------------------------------------------------
UNIT = [(17, 257), (257,)]          # Ψ = 4369 + 257 = 4626
MODEL = [UNIT, [(12, 5)], [(3,)]]   # three FSDP units, Ψ = 4626 + 60 + 3 = 4689


def test_padded_numel_flat_dim0_none():
    # flat: per unit ceil(Σ/N)*N: 4628 + 60 + 4 ; dim0: per param ceil(d0/N)*N*rest: 20*257 + 260 + 60 + 4
    assert padded_numel(MODEL, 4, "none") == 4689
    assert padded_numel(MODEL, 4, "flat") == 4628 + 60 + 4
    assert padded_numel(MODEL, 4, "dim0") == 20 * 257 + 260 + 12 * 5 + 4
    assert padded_numel(UNIT, 4, "flat") == 4628  # a bare list of shapes is one unit


def test_dp_is_all_reduce_of_unpadded_grads():
    c = step_cost("dp", MODEL, 4)
    assert [(o.op, o.payload_bytes) for o in c.ops] == [("all_reduce", 4689 * 4)]
    assert c.wire_bytes == pytest.approx(2 * 3 / 4 * 4689 * 4)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_zero12_moves_what_dp_moves_plus_padding(strategy):
    c = step_cost(strategy, MODEL, 4, padding="none")
    assert c.wire_bytes == pytest.approx(step_cost("dp", MODEL, 4).wire_bytes)
    padded = step_cost(strategy, MODEL, 4, padding="flat")
    assert padded.wire_bytes == pytest.approx(2 * 3 / 4 * 4692 * 4)
    assert {o.op for o in padded.ops} == {"reduce_scatter", "all_gather"}


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_fsdp_is_three_halves_of_dp(strategy):
    c = step_cost(strategy, MODEL, 8, padding="none")
    assert c.wire_bytes == pytest.approx(1.5 * step_cost("dp", MODEL, 8).wire_bytes)
    pad = padded_numel(MODEL, 8, "dim0")
    c = step_cost(strategy, MODEL, 8, padding="dim0")
    assert c.psi_padded == pad and c.wire_bytes == pytest.approx(3 * 7 / 8 * pad * 4)
    assert [(o.op, o.phase, o.count) for o in c.ops] == [
        ("all_gather", "forward", 3), ("all_gather", "backward", 3), ("reduce_scatter", "backward", 3)]


def test_fsdp_mixed_precision_and_no_reshard():
    pad = padded_numel(MODEL, 4, "flat")
    c = step_cost("fsdp", MODEL, 4, param_bytes=2, reduce_bytes=4)  # bf16 gathers, fp32 reduce
    assert c.wire_bytes == pytest.approx(3 / 4 * pad * (2 + 2 + 4))
    c = step_cost("fsdp", MODEL, 4, reshard_after_forward=False)
    assert c.wire_bytes == pytest.approx(2 * 3 / 4 * pad * 4) and c.by_op().keys() == {"all_gather", "reduce_scatter"}
    c = step_cost("fsdp", MODEL, 4, root_unit=0)  # FSDP2 keeps the root unsharded after forward
    assert c.ops[1].count == 2 and c.ops[1].payload_bytes == (60 + 4) * 4


def test_hsdp_2x4():
    f = 4
    pad = padded_numel(MODEL, f, "flat")
    c = step_cost("hsdp", MODEL, 8, replicate=2)
    assert [(o.op, o.group_size) for o in c.ops] == [
        ("all_gather", 4), ("all_gather", 4), ("reduce_scatter", 4), ("all_reduce", 2)]
    assert c.wire_bytes == pytest.approx(3 * 3 / 4 * pad * 4 + 2 * 1 / 2 * pad / f * 4)
    # the extremes: replicate=1 is FSDP; replicate=n is DP on padded shards of size Ψ
    assert step_cost("hsdp", MODEL, 8, replicate=1).wire_bytes == pytest.approx(step_cost("fsdp", MODEL, 8).wire_bytes)
    assert step_cost("hsdp", MODEL, 8, replicate=8, padding="none").wire_bytes == pytest.approx(
        step_cost("dp", MODEL, 8).wire_bytes)


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="hsdp", n=8, replicate=3), r"replicate\(3\) must be an int >= 1 that divides n\(8\)"),
    (dict(strategy="fsdp", n=8, replicate=2), r"replicate=2 only applies to strategy='hsdp'"),
    (dict(strategy="zero4", n=8), "strategy='zero4' must be one of"),
    (dict(strategy="fsdp", n=8, padding="rows"), "padding='rows' must be one of"),
    (dict(strategy="fsdp", n=0), "n=0 must be an int >= 1"),
])
def test_step_cost_errors_name_the_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        step_cost(units=MODEL, **kwargs)


def test_units_must_be_shapes():
    with pytest.raises(ValueError, match="is not a list of shapes"):
        step_cost("fsdp", [[(4, 4)], 7], 2)


# -- measured (ledger) against analytic ------------------------------------------------------------
def _fsdp_ledger(model, n, *, extra_gather=False, all_reduce_grads=False):
    """The per-rank ledger a correct (or deliberately wrong) from-scratch FSDP step would record."""
    recs = []
    sizes = [sharding.padded_size(sum(math.prod(s) for s in unit), n) * 4 for unit in model]
    for v in sizes:
        recs.append(CollectiveRecord(op="all_gather", nbytes=v, dtype="float32", group_size=n, rank=0, phase="forward"))
        if extra_gather:
            recs.append(CollectiveRecord(op="all_gather", nbytes=v, dtype="float32", group_size=n, rank=0, phase="forward"))
    for v in reversed(sizes):
        recs.append(CollectiveRecord(op="all_gather", nbytes=v, dtype="float32", group_size=n, rank=0, phase="backward"))
        op = "all_reduce" if all_reduce_grads else "reduce_scatter"
        recs.append(CollectiveRecord(op=op, nbytes=v, dtype="float32", group_size=n, rank=0, phase="backward"))
    return Ledger(recs)


def test_correct_fsdp_ledger_matches_analytic():
    analytic = step_cost("fsdp", MODEL, 4).wire_bytes
    assert ratio(ledger_wire_bytes(_fsdp_ledger(MODEL, 4)), analytic) == pytest.approx(1.0)


def test_wrong_implementations_give_ratio_above_one():
    analytic = step_cost("fsdp", MODEL, 4).wire_bytes
    extra = ratio(ledger_wire_bytes(_fsdp_ledger(MODEL, 4, extra_gather=True)), analytic)
    assert extra == pytest.approx(4 / 3)  # one more gather of Ψpad on top of 3
    ar = ratio(ledger_wire_bytes(_fsdp_ledger(MODEL, 4, all_reduce_grads=True)), analytic)
    assert ar == pytest.approx(4 / 3)  # all-reduce costs 2 where reduce-scatter costs 1


# -- alpha-beta ------------------------------------------------------------------------------------
def test_fit_alpha_beta_recovers_exact_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = fit_alpha_beta(sizes, [20e-6 + s / 1e9 for s in sizes])
    assert model.alpha_s == pytest.approx(20e-6) and model.beta_s_per_byte == pytest.approx(1e-9)
    assert model.bandwidth_bytes_per_s == pytest.approx(1e9)
    assert model.predict("all_reduce", 4000, 4) == pytest.approx(20e-6 + 6000 / 1e9)


def test_fit_alpha_beta_clamps_negative_values():
    x, t = [1, 2, 3], [0.5, 2.0, 3.1]  # unconstrained alpha would be < 0
    w = [1 / ti**2 for ti in t]        # weights of the relative-error fit
    through_origin = fit_alpha_beta(x, t)
    assert through_origin.alpha_s == 0
    assert through_origin.beta_s_per_byte == pytest.approx(
        sum(wi * xi * ti for wi, xi, ti in zip(w, x, t)) / sum(wi * xi * xi for wi, xi in zip(w, x)))
    t = [3.0, 2.0, 1.0]                # time falling with size: only alpha is meaningful
    flat = fit_alpha_beta(x, t)
    assert flat.beta_s_per_byte == 0
    assert flat.alpha_s == pytest.approx(sum(1 / ti for ti in t) / sum(1 / ti**2 for ti in t))


def test_fit_alpha_beta_weighs_small_messages_as_much_as_large_ones():
    """Relative error: the 4 KiB point is not sacrificed to the 4 MiB one (Lab 00's complaint)."""
    sizes = [4096 * 4**k for k in range(6)]          # 4 KiB .. 4 MiB
    exact = [5e-4 + 1e-9 * v for v in sizes]
    noisy = [t * (1.3 if i == 5 else 1.0) for i, t in enumerate(exact)]   # one slow large run
    fit = fit_alpha_beta(sizes, noisy)
    assert fit.predict("all_reduce", 0, 4) == pytest.approx(5e-4, rel=0.05)   # alpha barely moved
    assert abs(fit.alpha_s + fit.beta_s_per_byte * sizes[0] - noisy[0]) / noisy[0] < 0.05


def test_fit_alpha_beta_needs_two_sizes():
    with pytest.raises(ValueError, match="at least 2 distinct sizes"):
        fit_alpha_beta([8, 8], [1.0, 1.1])
    with pytest.raises(ValueError, match="sizes_bytes has 2 values but seconds has 1"):
        fit_alpha_beta([8, 16], [1.0])


def test_step_seconds_counts_one_alpha_per_call():
    c = step_cost("fsdp", MODEL, 4)
    m = AlphaBeta(1e-4, 1e-9)
    assert m.step_seconds(c) == pytest.approx(9 * 1e-4 + c.wire_bytes * 1e-9)


def test_regather_flags_drop_units_the_backward_never_gathers():
    units = [[(17, 8)], [(8, 8), (8,)], [(5, 8), (5,)]]
    every = costs.step_cost("fsdp", units, 4)
    some = costs.step_cost("fsdp", units, 4, regather=[False, True, True])
    ag_bwd = [o for o in some.ops if o.op == "all_gather" and o.phase == "backward"][0]
    assert ag_bwd.count == 2
    assert every.wire_bytes - some.wire_bytes == pytest.approx(3 / 4 * costs.padded_numel([units[0]], 4, "flat") * 4)
    assert costs.step_cost("fsdp", units, 4, regather=[True] * 3).wire_bytes == every.wire_bytes
    with pytest.raises(ValueError, match="regather has 2 flags for 3 units"):
        costs.step_cost("fsdp", units, 4, regather=[True, True])
