"""Lab 05's classic mistakes (FSDP in JAX: the sharding rule; the all-gather / psum-scatter pair)."""
from wrong_answers import Right, Wrong

#: What the lab's first cells define (8 simulated devices: tests/conftest.py asked for them already).
SETUP = """\
import course_lib
devices = course_lib.setup_jax(8)
import jax
from jax.sharding import AxisType, PartitionSpec as P
from course_lib.strategies.fsdp import jax as fsdp_jax
N = len(devices)
mesh = jax.make_mesh((N,), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices)
"""

SPEC = "lab05.check_spec_rule(my_fsdp_spec)"
PAIR = "lab05.check_gather_pair(gather_weight, scatter_grad, mesh)"


def spec(body: str) -> str:
    return SETUP + "\n\ndef my_fsdp_spec(shape, n, min_size=fsdp_jax.MIN_SIZE):\n" + body


def pair(gather: str, scatter: str) -> str:
    """The two functions, each body one return expression (or more lines, indented by 4)."""
    return SETUP + f"""

def gather_weight(w_shard, dim):
    {gather}


def scatter_grad(g_full, dim):
    {scatter}
"""


AG = 'return jax.lax.all_gather(w_shard, "fsdp", axis=dim, tiled=True)'
RS = 'return jax.lax.psum_scatter(g_full, "fsdp", scatter_dimension=dim, tiled=True)'

WRONG = [
    # -- exercise 1: the sharding rule ------------------------------------------------------------------
    Wrong("05", "fsdp_spec", "value", "cut that does not divide", spec("""\
    return P() if math.prod(shape) < min_size else P("fsdp")       # the guide's rule: dim 0, divisible or not
"""), SPEC, "always P('fsdp') above the threshold"),
    Wrong("05", "fsdp_spec", "value", "no threshold", spec("""\
    return fsdp_jax.fsdp_spec(shape, n, min_size=1)                 # shards biases and norms too
"""), SPEC, "no threshold at all"),
    Wrong("05", "fsdp_spec", "value", "dim 0 only", spec("""\
    return P("fsdp") if math.prod(shape) >= min_size and shape[0] % n == 0 else P()   # never another dim
"""), SPEC, "never tries another dimension"),
    Wrong("05", "fsdp_spec", "value", "not a PartitionSpec", spec("""\
    return "fsdp"
"""), SPEC, "returns the axis name, not a PartitionSpec"),
    Wrong("05", "fsdp_spec", "argument", "not the largest", spec("""\
    if math.prod(shape) < min_size:
        return P()
    d = next((k for k, s in enumerate(shape) if s % n == 0), None)   # the first that divides
    return P() if d is None else P(*[None] * d, "fsdp")
"""), SPEC, "the first dimension that divides, not dim 0 then the largest"),
    Wrong("05", "fsdp_spec", "argument", "not the largest", spec("""\
    if math.prod(shape) < min_size:
        return P()
    for d in [0] + list(range(len(shape) - 1, 0, -1)):             # dim 0, then from the last
        if shape[d] % n == 0:
            return P(*[None] * d, "fsdp")
    return P()
"""), SPEC, "dim 0, then the last dimension that divides: right only while the last is the largest"),
    Wrong("05", "fsdp_spec", "argument", "not dim 0 first", spec("""\
    if math.prod(shape) < min_size:
        return P()
    for d in sorted(range(len(shape)), key=lambda k: -shape[k]):    # the largest first, dim 0 included
        if shape[d] % n == 0:
            return P(*[None] * d, "fsdp")
    return P()
"""), SPEC, "the largest dimension first, even when dim 0 divides"),
    Wrong("05", "fsdp_spec", "argument", "n ignored", spec("""\
    return fsdp_jax.fsdp_spec(shape, 8, min_size=min_size)          # the lab's 8 devices, whatever n says
"""), SPEC, "hard-codes 8 devices"),
    Wrong("05", "fsdp_spec", "argument", "min_size ignored", spec("""\
    return fsdp_jax.fsdp_spec(shape, n, min_size=fsdp_jax.MIN_SIZE)  # the default, whatever min_size says
"""), SPEC, "ignores min_size: selective sharding shards everything"),
    Wrong("05", "fsdp_spec", "boundary", "strict threshold", spec("""\
    return P() if math.prod(shape) <= min_size else fsdp_jax.fsdp_spec(shape, n, min_size=0)   # > for >=
"""), SPEC, "size > min_size: exactly min_size stays replicated"),
    Wrong("05", "fsdp_spec", "crash", "crash", spec("""\
    if shape[0] % n == 0 and math.prod(shape) >= min_size:         # a scalar has no dim 0
        return P("fsdp")
    return fsdp_jax.fsdp_spec(shape, n, min_size=min_size)
"""), SPEC, "indexes dim 0 of a scalar's shape", ("IndexError", "at line")),

    # -- exercise 2: the gather pair --------------------------------------------------------------------
    Wrong("05", "gather_pair", "value", "psum instead of psum_scatter", pair(AG, 'return jax.lax.psum(g_full, "fsdp")'),
          PAIR, "sums, but every device keeps the whole gradient"),
    Wrong("05", "gather_pair", "value", "no collective in backward", pair(AG, "return g_full"), PAIR,
          "no collective at all in the backward"),
    Wrong("05", "gather_pair", "value", "untiled gather", pair(
        'return jax.lax.all_gather(w_shard, "fsdp", axis=dim)', RS), PAIR, "stacks the blocks on a new axis"),
    Wrong("05", "gather_pair", "value", "gathered on the wrong dim", pair(
        'return jax.lax.all_gather(w_shard, "fsdp", axis=1 - dim, tiled=True)', RS), PAIR, "the other dimension"),
    Wrong("05", "gather_pair", "value", "scattered on the wrong dim", pair(
        AG, 'return jax.lax.psum_scatter(g_full, "fsdp", scatter_dimension=1 - dim, tiled=True)'), PAIR,
          "scatters the other dimension"),
    Wrong("05", "gather_pair", "value", "divided in the backward", pair(AG, RS + " / 8"), PAIR,
          "÷N in the backward although the loss carries it"),
    Wrong("05", "gather_pair", "value", "divided in the backward", pair(AG, RS + ' / jax.lax.axis_size("fsdp")'),
          PAIR, "a pmean habit: ÷N twice"),
    Wrong("05", "gather_pair", "value", "no sum", pair(AG, """k = g_full.shape[dim] // jax.lax.axis_size("fsdp")
    return jax.lax.dynamic_slice_in_dim(g_full, jax.lax.axis_index("fsdp") * k, k, axis=dim)   # own slice, no sum"""),
          PAIR, "each device's own slice of its own gradient"),
    Wrong("05", "gather_pair", "cost", "psum then slice", pair(AG, """k = g_full.shape[dim] // jax.lax.axis_size("fsdp")
    total = jax.lax.psum(g_full, "fsdp")                            # all-reduce everything, keep a slice
    return jax.lax.dynamic_slice_in_dim(total, jax.lax.axis_index("fsdp") * k, k, axis=dim)"""),
          PAIR, "all-reduce then slice: right values, 2× the bytes"),
    Wrong("05", "gather_pair", "cost", "psum as a gather", pair("""n, i = jax.lax.axis_size("fsdp"), jax.lax.axis_index("fsdp")
    shape = list(w_shard.shape)
    shape[dim] *= n
    full = jax.numpy.zeros(shape, w_shard.dtype)
    full = jax.lax.dynamic_update_slice_in_dim(full, w_shard, i * w_shard.shape[dim], axis=dim)
    return jax.lax.psum(full, "fsdp")                                # a gather made of an all-reduce""", RS),
          PAIR, "psum of a zero-filled buffer: right values, 2× the bytes"),
    Wrong("05", "gather_pair", "argument", "dim ignored", pair(
        'return jax.lax.all_gather(w_shard, "fsdp", tiled=True)', RS), PAIR, "gathers along dim 0 whatever dim says"),
    Wrong("05", "gather_pair", "argument", "dim ignored", pair(
        AG, 'return jax.lax.psum_scatter(g_full, "fsdp", tiled=True)'), PAIR, "scatters along dim 0 whatever dim says"),
    Wrong("05", "gather_pair", "crash", "crash", pair(
        'return jax.lax.all_gather(w_shard, "fdsp", axis=dim, tiled=True)', RS), PAIR, "a typo'd axis name",
          ("NameError",)),
]

# -- round 3: a collective called without the flag that makes its shapes line up (JAX raises ValueError) -------
WRONG += [
    Wrong("05", "gather_pair", "crash", "untiled scatter",
          pair(AG, 'return jax.lax.psum_scatter(g_full, "fsdp", scatter_dimension=dim)'), PAIR,
          "psum_scatter without tiled=True: JAX's ValueError names sizes, not the flag"),
    Wrong("05", "gather_pair", "crash", "untiled scatter", pair(AG, 'return jax.lax.psum_scatter(g_full, "fsdp")'),
          PAIR, "psum_scatter with neither scatter_dimension nor tiled"),
    Wrong("05", "gather_pair", "argument", "dim ignored",
          pair(AG, 'return jax.lax.psum_scatter(g_full, "fsdp", tiled=True)'), PAIR,
          "psum_scatter without scatter_dimension: always dim 0"),
    Wrong("05", "gather_pair", "argument", "dim ignored",
          pair('return jax.lax.all_gather(w_shard, "fsdp", tiled=True)', RS), PAIR, "all_gather without axis: always dim 0"),
]

RIGHT = [
    Right("05", "gather_pair", pair('return jax.lax.all_gather(w_shard, "fsdp", axis=dim, tiled=True)',
                                    'return jax.lax.psum_scatter(g_full, fsdp_jax.AXIS, scatter_dimension=dim, tiled=True)'),
          PAIR, "the axis name from the library's constant"),
    Right("05", "gather_pair", pair(
        'g = jax.lax.all_gather(w_shard, "fsdp")               # (N, *shard), untiled\n'
        '    return jax.numpy.concatenate([g[i] for i in range(g.shape[0])], axis=dim)',
        'return jax.lax.psum_scatter(g_full, "fsdp", scatter_dimension=dim, tiled=True)'),
          PAIR, "an untiled gather, concatenated along dim by hand"),
]

WRONG += [
    Wrong("05", "gather_pair", "value", "dtype changed",
          pair('return jax.lax.all_gather(w_shard.astype(jax.numpy.bfloat16), "fsdp", axis=dim, tiled=True)', RS),
          PAIR, "gathers in bfloat16 (half the bytes) and hands the layer a rounded weight"),
]

# -- issue 49: lying values (the judge sees plain data, never the learner's object) -------------------------------
WRONG += [
    Wrong("05", "fsdp_spec", "value", "not a PartitionSpec", spec("""\
    class Spec:                                      # says it is a PartitionSpec, equal to any spec
        __class__ = property(lambda self: P)
        partitions = ("fsdp",)

        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

        def __iter__(self):
            return iter(("fsdp",))
    return Spec()
"""), SPEC, "a lying value: an object that passes isinstance(P) and equals every spec", ("returned a Spec",)),
]
