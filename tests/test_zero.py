"""ZeRO stages 1-3 (course_lib.strategies.zero.torch) and measured memory (course_lib.measure.memory), on real gloo ranks.

Awkward sizes (17x257, 257x5 without bias...) so that the flat units pad at N = 3 and 4. Each stage must:
average gradients exactly like all_reduce(grad)/N, train like data parallel with the same Adam, hold
exactly memory.state_bytes(stage, Ψpad, N) per rank (plus Adam's one-element step counters), and send
exactly costs.step_cost(f"zero{stage}", units, N) per step.
"""
from __future__ import annotations

import pytest
import torch

from course_lib.maths import costs
from course_lib import launch
from course_lib.maths import memory
from course_lib.measure import memory as memory_meter
from course_lib.strategies.zero import torch as zero
from course_lib.maths.sharding import padded_size

LR, STEPS = 1e-2, 3


class _Net(torch.nn.Module):
    """Three units' worth of awkward layers: 17x257 (+257 bias), 257x5 (no bias), 5x3 (+3)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(17, 257), torch.nn.Linear(257, 5, bias=False), torch.nn.Linear(5, 3)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _data(rank, world, step, rows=12):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(rows, 17, generator=g), torch.randn(rows, 3, generator=g)
    sl = slice(rank * rows // world, (rank + 1) * rows // world)
    return x[sl], y[sl]


def _train(strategy, units_kind):
    """On a rank: STEPS Adam steps; per step the averaged-gradient check, measured state; final weights."""
    import torch.distributed as dist

    from course_lib.strategies.dp import torch as dp
    from course_lib.strategies.zero import torch as zero
    from course_lib.comm import torch_ledger as lt
    from course_lib.measure import memory as mm
    r, n = dist.get_rank(), dist.get_world_size()
    model = _Net()
    if strategy == "dp":
        dp.NaiveDataParallel(model)
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        units = [[tuple(p.shape) for p in model.parameters()]]
    else:
        unit_mods = {"one": None, "layers": [model.a, model.b, model]}[units_kind]
        z = zero.ZeRO(model, int(strategy[-1]), units=unit_mods, lr=LR)
        units = z.unit_shapes()
    out = {"grad_errors": [], "states": [], "units": units}
    names = {id(p): k for k, p in model.named_parameters()}
    for step in range(STEPS):
        lt.set_step(step)
        x, y = _data(r, n, step)
        if strategy in ("zero2", "zero3"):          # reference: all_reduce(grad)/N of a plain copy
            with lt.paused():
                shadow = _Net()
                shadow.load_state_dict(_weights(model, z))
                torch.nn.functional.mse_loss(shadow(x), y).backward()
                for p in shadow.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= n
                ref_grads = {k: p.grad for k, p in shadow.named_parameters()}
        torch.nn.functional.mse_loss(model(x), y).backward()
        if strategy in ("zero2", "zero3"):          # reduce-scattered in backward: compare shard by shard
            errs = []
            for u in z.units:
                flat = torch.zeros(u.layout.padded_numel)
                for p, off in zip(u.params, u.layout.offsets):
                    flat[off:off + p.numel()] = ref_grads[names[id(p)]].reshape(-1)
                S = u.layout.shard_size
                errs.append(float((u.grad_shard - flat[r * S:(r + 1) * S]).abs().max()))
            out["grad_errors"].append(max(errs))
        (opt if strategy == "dp" else z).step()
        out["states"].append(mm.model_state(model, opt) if strategy == "dp" else mm.measure_state(**z.state_tensors()))
        (opt if strategy == "dp" else z).zero_grad()
    lt.set_step(None)
    with lt.paused():
        out["weights"] = _weights(model, z if strategy != "dp" else None)
    return out


def _weights(model, z):
    """Full weights by name; a ZeRO-3 model's units are gathered for the copy and freed again."""
    three = z is not None and z.stage == 3
    if three:
        for u in z.units:
            u.gather_()
    w = {k: v.detach().clone() for k, v in model.named_parameters()}
    if three:
        for u in z.units:
            u.free_()
    return w


@pytest.fixture(scope="module", params=[4, 3], ids=["N=4", "N=3"])
def runs(request):
    n = request.param
    out = {"n": n}
    for s in ("dp", "zero1", "zero2", "zero3"):
        for kind in (("one",) if s == "dp" else ("one", "layers")):
            out[(s, kind)] = launch.run(_train, s, kind, world_size=n, timeout=60)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["one", "layers"])
def test_stage_trains_like_dp_with_the_same_adam(runs, stage, kind):
    res, ref = runs[(f"zero{stage}", kind)], runs[("dp", "one")]
    for r in range(runs["n"]):
        for k, v in ref[r]["weights"].items():
            torch.testing.assert_close(res[r]["weights"][k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["one", "layers"])
def test_stages_are_bit_identical_to_each_other(runs, kind):
    w1 = runs[("zero1", kind)][0]["weights"]
    for stage in (2, 3):
        wk = runs[(f"zero{stage}", kind)][0]["weights"]
        assert all(torch.equal(wk[k], w1[k]) for k in w1)


@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_shard_is_all_reduce_over_n(runs, stage):
    res = runs[(f"zero{stage}", "layers")]
    assert max(e for r in range(runs["n"]) for e in res[r]["grad_errors"]) < 1e-6


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["one", "layers"])
def test_measured_state_is_the_formula_with_padding(runs, stage, kind):
    n, res = runs["n"], runs[(f"zero{stage}", kind)]
    units = res[0]["units"]
    psi_pad = costs.padded_numel(units, n, "flat")
    assert psi_pad > sum(p.numel() for p in _Net().parameters())          # the sizes really pad
    formula = memory.state_bytes(f"zero{stage}", psi_pad, n)
    for r in range(n):
        st = res[r]["states"][-1]
        assert st.params == formula.params and st.grads == formula.grads
        assert st.optimizer == formula.optimizer + 4 * len(units)          # + one float32 step counter per shard
        assert st.total / formula.total <= 1.01


def test_dp_measured_state_is_16_bytes_per_parameter(runs):
    psi = sum(p.numel() for p in _Net().parameters())
    st = runs[("dp", "one")][0]["states"][-1]
    n_tensors = len(list(_Net().parameters()))
    assert (st.params, st.grads, st.optimizer) == (4 * psi, 4 * psi, 8 * psi + 4 * n_tensors)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", ["one", "layers"])
def test_ledger_bytes_per_step_match_the_analytic_cost(runs, stage, kind):
    n, res = runs["n"], runs[(f"zero{stage}", kind)]
    analytic = costs.step_cost(f"zero{stage}", res[0]["units"], n)
    for step in range(STEPS):
        measured = costs.ledger_wire_bytes(res.ledger.filter(rank=0, step=step))
        assert measured == pytest.approx(analytic.wire_bytes, rel=1e-12)
        counts = res.ledger.filter(rank=0, step=step).counts()
        k = len(res[0]["units"])
        assert counts == ({"reduce_scatter": k, "all_gather": 2 * k} if stage == 3 else
                          {"reduce_scatter": k, "all_gather": k})


def test_zero3_sends_one_and_a_half_times_dp(runs):
    n = runs["n"]
    dp_b = costs.ledger_wire_bytes(runs[("dp", "one")].ledger.filter(rank=0, step=1))
    z3_b = costs.ledger_wire_bytes(runs[("zero3", "one")].ledger.filter(rank=0, step=1))
    psi = sum(p.numel() for p in _Net().parameters())
    assert z3_b / dp_b == pytest.approx(1.5 * padded_size(psi, n) / psi, rel=1e-12)


# -- the raw pieces ----------------------------------------------------------------------------------
def _flat_unit_roundtrip(sharded):
    import torch.distributed as dist

    from course_lib.strategies.zero import torch as zero
    r, n = dist.get_rank(), dist.get_world_size()
    model = _Net()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    u = zero.FlatUnit(list(model.parameters()), r, n, sharded_params=sharded)
    freed = model.a.weight.untyped_storage().nbytes()
    if sharded:
        u.gather_()
    same = all(torch.equal(p, before[k]) for k, p in model.named_parameters())
    shard_is_view = u.shard.untyped_storage()._cdata == u.full.untyped_storage()._cdata
    return freed, same, shard_is_view, u.layout.padded_numel, u.shard.numel()


@pytest.mark.parametrize("sharded", [False, True])
def test_flat_unit_pads_frees_and_gathers(sharded):
    res = launch.run(_flat_unit_roundtrip, sharded, world_size=4)
    psi = sum(p.numel() for p in _Net().parameters())
    for freed, same, shard_is_view, padded, shard in res:
        assert padded == padded_size(psi, 4) and shard == padded // 4 and padded > psi
        assert same
        assert (freed == 0) == sharded and shard_is_view == (not sharded)


def _rs_output_is_stable():
    import torch.distributed as dist

    from course_lib.comm import shim
    n = dist.get_world_size()
    values = set()
    for _ in range(20):
        out = torch.empty(1000)
        shim.reduce_scatter_flat(torch.ones(1000 * n), out=out)
        out.div_(n)                                       # modify the output in place, as ZeRO does
        dist.all_reduce(torch.ones(8))                    # another collective, then look again
        values.add(float(out.max()))
    return values


def test_reduce_scatter_output_can_be_modified_in_place():
    """gloo's reduce-scatter output is written inside wait(), and under the recording ledger that copy may
    run again later; reduce_scatter_flat must shield its caller from it (see its docstring)."""
    assert all(v == {1.0} for v in launch.run(_rs_output_is_stable, world_size=4))


def test_zero_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stage=4"):
        zero.ZeRO.__init__(object.__new__(zero.ZeRO), _Net(), 4)


# -- memory_measure ----------------------------------------------------------------------------------
def test_storage_bytes_counts_each_storage_once_at_full_size():
    flat = torch.zeros(13)
    assert memory_meter.storage_bytes([flat[:6], flat[6:11], None, flat]) == 52
    freed = torch.zeros(8)
    view = freed[2:5]
    freed.untyped_storage().resize_(0)
    assert memory_meter.storage_bytes([view]) == 0
    assert memory_meter.storage_bytes([torch.zeros(3, dtype=torch.bfloat16)]) == 6


def test_measure_state_assigns_a_shared_storage_to_the_first_category():
    flat = torch.zeros(10)
    p, g = flat[:4], flat[4:]                    # a gradient living in the parameters' buffer
    st = memory_meter.measure_state([p], [g], [torch.zeros(2)])
    assert (st.params, st.grads, st.optimizer) == (40, 0, 8)


def test_model_state_of_a_plain_adam_is_16_bytes_per_parameter():
    model = _Net()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 17)).sum().backward()
    opt.step()
    psi = sum(p.numel() for p in model.parameters())
    st = memory_meter.model_state(model, opt)
    assert st.total == 16 * psi + 4 * len(list(model.parameters()))


def test_saved_activations_grow_linearly_and_exclude_parameters():
    model = _Net()
    sizes = []
    for rows in (4, 8, 16):
        x = torch.randn(rows, 17)
        out, saved = memory_meter.saved_activation_bytes(lambda: model(x), params=model.parameters())
        sizes.append(saved)
    assert sizes[2] - sizes[1] == 2 * (sizes[1] - sizes[0]) > 0          # linear in the rows
    assert sizes[0] < 16 * sum(p.numel() for p in model.parameters())


def test_allocated_bytes_is_none_on_cpu():
    assert memory_meter.allocated_bytes("cpu") is None
