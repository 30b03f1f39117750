"""Lab 05's exercise checks: the right answer passes, a stub is "not implemented yet", and plausible
wrong answers fail with feedback that names the mistake.

The sharding-rule check only builds PartitionSpecs (no JAX computation), so it runs here. The gather-pair
check needs 8 simulated devices, which must be set before JAX starts: it runs in a subprocess (this pytest
process may already have JAX with another device count).
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from course_lib.checks import CheckFailed, lab05
from course_lib.strategies.fsdp import jax as fsdp_jax

ROOT = Path(__file__).resolve().parent.parent
P = pytest.importorskip("jax.sharding").PartitionSpec


# -- exercise 1: the sharding rule ---------------------------------------------------------------------
def right(shape, n, min_size=fsdp_jax.MIN_SIZE):
    return fsdp_jax.fsdp_spec(shape, n, min_size=min_size)


def stub(shape, n, min_size=fsdp_jax.MIN_SIZE):
    raise NotImplementedError("Exercise not done yet: replicate below min_size")


def always_dim0(shape, n, min_size=fsdp_jax.MIN_SIZE):      # the JAX/Flax NNX guide's rule: P('fsdp') for every big array
    return P() if math.prod(shape) < min_size else P("fsdp")


def no_threshold(shape, n, min_size=fsdp_jax.MIN_SIZE):     # shards biases and norms too
    return fsdp_jax.fsdp_spec(shape, n, min_size=1)


def strictly_greater(shape, n, min_size=fsdp_jax.MIN_SIZE):  # size > min_size instead of >=
    return P() if math.prod(shape) <= min_size else fsdp_jax.fsdp_spec(shape, n, min_size=0)


def dim0_or_nothing(shape, n, min_size=fsdp_jax.MIN_SIZE):   # never tries another dimension
    return P("fsdp") if math.prod(shape) >= min_size and shape[0] % n == 0 else P()


def first_dividing_dim(shape, n, min_size=fsdp_jax.MIN_SIZE):  # not the largest one
    if math.prod(shape) < min_size:
        return P()
    d = next((k for k, s in enumerate(shape) if s % n == 0), None)
    return P() if d is None else P(*[None] * d, "fsdp")


def returns_a_string(shape, n, min_size=fsdp_jax.MIN_SIZE):
    return "fsdp"


def test_right_answer_passes(capsys):
    assert lab05.check_spec_rule(right) is True
    assert "✅" in capsys.readouterr().out


def test_stub_is_not_implemented(capsys):
    assert lab05.check_spec_rule(stub) is False
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (always_dim0, "does not divide"),
    (no_threshold, "below the threshold"),
    (strictly_greater, "size >= min_size"),
    (dim0_or_nothing, "cut dim 1"),
    (first_dividing_dim, "the largest that does"),
    (returns_a_string, "return a PartitionSpec"),
])
def test_wrong_rules_fail_with_the_reason(wrong, says):
    with pytest.raises(CheckFailed, match=says):
        lab05.check_spec_rule(wrong)


def test_reference_rule_cases():
    assert fsdp_jax.fsdp_spec((66, 198), 8) == P()                 # nothing divides: replicate
    assert fsdp_jax.fsdp_spec((30, 64), 8) == P(None, "fsdp")      # dim 0 does not divide: dim 1
    assert fsdp_jax.fsdp_spec((64, 512), 8, min_size=32768) == P("fsdp")
    assert fsdp_jax.sharded_dim(P(None, "fsdp")) == 1 and fsdp_jax.sharded_dim(P()) is None


# -- exercise 2: the gather pair (8 simulated devices, in a subprocess) ---------------------------------
SCRIPT = textwrap.dedent('''
    import json, course_lib
    devices = course_lib.setup_jax(8)
    import jax
    from jax.sharding import AxisType
    from course_lib.checks import CheckFailed, lab05

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices)
    ag = lambda w, d: jax.lax.all_gather(w, "fsdp", axis=d, tiled=True)
    rs = lambda g, d: jax.lax.psum_scatter(g, "fsdp", scatter_dimension=d, tiled=True)
    def stub(*_):
        raise NotImplementedError("Exercise not done yet: one collective")
    variants = {
        "right": (ag, rs),
        "stub": (stub, rs),
        "averaged_in_bwd": (ag, lambda g, d: rs(g, d) / 8),             # the loss already carries 1/N
        "psum_in_bwd": (ag, lambda g, d: jax.lax.psum(g, "fsdp")),      # full-size gradient, not a shard
        "untiled_gather": (lambda w, d: jax.lax.all_gather(w, "fsdp", axis=d), rs),   # stacks: (8, 8, 24)
        "gather_wrong_dim": (lambda w, d: ag(w, 1 - d), rs),
        "identity_bwd": (ag, lambda g, d: g),                           # no collective at all
        "scatter_wrong_dim": (ag, lambda g, d: jax.lax.psum_scatter(g, "fsdp", scatter_dimension=1 - d, tiled=True)),
        "pmean_scatter": (ag, lambda g, d: jax.lax.psum_scatter(g, "fsdp", scatter_dimension=d, tiled=True)
                          / jax.lax.axis_size("fsdp")),                 # a "mean" habit: ÷N twice here
        "local_slice_no_sum": (ag, lambda g, d: jax.lax.dynamic_slice_in_dim(
            g, jax.lax.axis_index("fsdp") * (g.shape[d] // 8), g.shape[d] // 8, axis=d)),
    }
    out = {}
    for name, (fwd, bwd) in variants.items():
        try:
            out[name] = "pass" if lab05.check_gather_pair(fwd, bwd, mesh) else "todo"
        except CheckFailed as e:
            out[name] = "fail: " + str(e)
        except Exception as e:
            out[name] = f"error: {type(e).__name__}: {e}"
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def gather_outcomes():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, f"subprocess failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[-1][len("RESULT "):])


def test_gather_pair_right_and_stub(gather_outcomes):
    assert gather_outcomes["right"] == "pass"
    assert gather_outcomes["stub"] == "todo"


@pytest.mark.parametrize("name, says", [
    ("averaged_in_bwd", "the loss already carries the ÷N"),
    ("pmean_scatter", "the loss already carries the ÷N"),
    ("psum_in_bwd", "psum sums but does not scatter"),
    ("identity_bwd", "a device keeps only its own block of the SUM"),
    ("scatter_wrong_dim", "scattered along the wrong dimension"),
    ("untiled_gather", "tiled=True concatenates"),
    ("gather_wrong_dim", "gathered along the wrong dimension"),
    ("local_slice_no_sum", "sum over devices is missing"),
])
def test_gather_pair_wrong_answers_fail(gather_outcomes, name, says):
    outcome = gather_outcomes[name]
    assert outcome.startswith("fail: "), outcome
    assert says in outcome, outcome
