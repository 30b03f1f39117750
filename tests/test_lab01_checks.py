"""Lab 01's exercise checks: the right answer passes, the stub says "not implemented yet", and plausible
wrong answers fail with feedback naming the mistake.

The torch checks run on real gloo ranks. The JAX checks need 4 simulated devices, set before JAX starts:
they run in a subprocess (this pytest process may already have JAX with another device count).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_lib.strategies.dp import torch as dp
from course_lib.checks import lab01
from course_lib.checks import CheckFailed

ROOT = Path(__file__).resolve().parent.parent


# -- exercise 1: average the gradients ----------------------------------------------------------------
def right(model):
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def stub(model):
    raise NotImplementedError("Exercise not done yet: all-reduce each p.grad, then divide")


def summed(model):                         # forgot ÷N
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)


def skipped(model):                        # divided, never communicated
    for p in model.parameters():
        p.grad /= 4


def averaged_twice(model):                 # ÷N twice (as with ReduceOp.AVG and then ÷N)
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size() ** 2


def stepped_too(model):                    # took the optimizer step inside
    right(model)
    import torch
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


def test_average_gradients_passes_the_right_answer(capsys):
    assert lab01.check_average_gradients(right, world_size=4) is True
    assert capsys.readouterr().out.startswith("✅ average_gradients: every rank holds the whole-batch gradient")


def test_average_gradients_accepts_the_reference():
    assert lab01.check_average_gradients(dp.average_gradients_, world_size=4) is True


def test_average_gradients_stub_is_not_implemented(capsys):
    assert lab01.check_average_gradients(stub, world_size=4) is False
    assert "⏳ average_gradients: not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (summed, "summed instead of averaging"),
    (skipped, "divided but never all-reduced"),
    (lambda model: None, "collective was skipped"),
    (averaged_twice, "averaged twice"),
    (stepped_too, "weights changed"),
])
def test_average_gradients_names_the_mistake(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab01.check_average_gradients(wrong, world_size=4)
    assert says in str(err.value)


# -- exercise 2: buckets --------------------------------------------------------------------------------
def buckets_forward(params, cap_bytes):    # forgot that backward goes last layer first: walks forward
    return dp.make_buckets(list(params)[::-1], cap_bytes)


def buckets_by_numel(params, cap_bytes):   # compared elements with a cap in bytes
    out, cur, size = [], [], 0
    for p in reversed(list(params)):
        if cur and size + p.numel() > cap_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    return out + ([cur] if cur else [])


def buckets_close_after_overflow(params, cap_bytes):   # adds the tensor first, then checks the cap
    out, cur, size = [], [], 0
    for p in reversed(list(params)):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size > cap_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def buckets_strict_cap(params, cap_bytes):   # "at most" read as "less than": >= where the text says >
    out, cur, size = [], [], 0
    for p in reversed(list(params)):
        b = p.numel() * p.element_size()
        if cur and size + b >= cap_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += b
    return out + ([cur] if cur else [])


def buckets_drop_last(params, cap_bytes):  # forgot the last, partly filled bucket
    return dp.make_buckets(params, cap_bytes)[:-1]


def test_make_buckets_passes_the_right_answer(capsys):
    assert lab01.check_make_buckets(dp.make_buckets) is True
    assert "✅ make_buckets" in capsys.readouterr().out


def test_make_buckets_stub_is_not_implemented(capsys):
    def stub_b(params, cap_bytes):
        raise NotImplementedError("Exercise not done yet: walk the parameters in reverse")
    assert lab01.check_make_buckets(stub_b) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (buckets_forward, "walk the parameters in reverse"),
    (buckets_by_numel, "exceeds cap_bytes"),
    (buckets_drop_last, "exactly one bucket"),
    (buckets_strict_cap, "may hold exactly cap_bytes"),
    (buckets_close_after_overflow, "exceeds cap_bytes"),
])
def test_make_buckets_names_the_mistake(wrong, says):
    with pytest.raises(CheckFailed) as err:
        lab01.check_make_buckets(wrong)
    assert says in str(err.value)


# -- exercises 3 and 4: JAX, in a subprocess with 4 simulated devices ------------------------------------
JAX_SCRIPT = textwrap.dedent("""
    import json, sys
    import course_lib
    course_lib.setup_jax(4)
    import jax
    from course_lib.strategies.dp import torch as dp
    from course_lib.checks import lab01
    from course_lib.checks import CheckFailed
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))

    def vg_textbook(loss_fn, p, x, y):       # grad, then pmean: N x under check_vma
        l, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.lax.pmean(l, "dp"), jax.lax.pmean(g, "dp")
    def vg_local(loss_fn, p, x, y):          # no collective at all
        return jax.value_and_grad(loss_fn)(p, x, y)
    def vg_over_n(loss_fn, p, x, y):         # pmean of the loss, then an extra / N
        l, g = dp.jax_dp_value_and_grad(loss_fn, p, x, y)
        return l, jax.tree.map(lambda a: a / 4, g)
    def vg_psum(loss_fn, p, x, y):           # psum of the loss: the SUM over devices, N x the mean
        return jax.value_and_grad(lambda q: jax.lax.psum(loss_fn(q, x, y), "dp"))(p)
    def vg_stub(loss_fn, p, x, y):
        raise NotImplementedError("Exercise not done yet: grad of pmean(loss)")
    def key_same(key):
        return key
    def key_const(key):
        return jax.random.fold_in(key, 0)
    def key_other(key):                      # differs per device, but not fold_in(key, index)
        return jax.random.fold_in(key, jax.lax.axis_index("dp") + 1)
    def key_split(key):                      # split gives 4 keys, but every device takes the same one
        return jax.random.split(key, 4)[0]
    def key_stub(key):
        raise NotImplementedError("Exercise not done yet: fold_in")

    out = {}
    for name, fn in [("vg_right", dp.jax_dp_value_and_grad), ("vg_textbook", vg_textbook),
                     ("vg_local", vg_local), ("vg_over_n", vg_over_n), ("vg_psum", vg_psum), ("vg_stub", vg_stub)]:
        try:
            out[name] = ["ok" if lab01.check_jax_dp_value_and_grad(fn, mesh) else "todo", ""]
        except CheckFailed as e:
            out[name] = ["failed", str(e)]
    for name, fn in [("key_right", dp.jax_device_key), ("key_same", key_same), ("key_const", key_const),
                     ("key_other", key_other), ("key_split", key_split), ("key_stub", key_stub)]:
        try:
            out[name] = ["ok" if lab01.check_jax_device_key(fn, mesh) else "todo", ""]
        except CheckFailed as e:
            out[name] = ["failed", str(e)]
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def jax_results():
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT "):])


@pytest.mark.parametrize("name, status, says", [
    ("vg_right", "ok", ""),
    ("vg_stub", "todo", ""),
    ("vg_textbook", "failed", "jax.grad already psums"),
    ("vg_local", "failed", "average the per-device losses"),
    ("vg_over_n", "failed", "averaged twice"),
    ("key_right", "ok", ""),
    ("key_stub", "todo", ""),
    ("key_same", "failed", "drew the same mask"),
    ("key_const", "failed", "drew the same mask"),
    ("key_other", "failed", "use exactly that"),
    ("vg_psum", "failed", "pmean, not psum"),
    ("key_split", "failed", "drew the same mask"),
])
def test_jax_checks(jax_results, name, status, says):
    got_status, text = jax_results[name]
    assert got_status == status, text
    assert says in text
