"""Lab 10's classic mistakes (the other dimensions): the 1F1B order of one stage, the bubble fraction, the
ring-attention merge and the all-to-all dispatch counts."""
from wrong_answers import Right, Wrong

ORDER = "lab10.check_one_f_one_b(one_f_one_b)"
BUBBLE = "lab10.check_bubble_fraction(bubble_fraction)"
MERGE = "lab10.check_ring_merge(ring_merge)"
COUNTS = "lab10.check_dispatch_counts(dispatch_counts)"


def _order(warmup: str = "min(p - stage - 1, m)", steady: str = '[("F", w + i), ("B", i)]') -> str:
    return f"""\
def one_f_one_b(stage, p, m):
    w = {warmup}
    ops = [("F", i) for i in range(w)]
    for i in range(m - w):
        ops += {steady}
    return ops + [("B", i) for i in range(m - w, m)]
"""


def _merge(body: str) -> str:
    return "import torch\n\n\ndef ring_merge(o_a, lse_a, o_b, lse_b):\n" + body


def _counts(body: str) -> str:
    return "import torch\n\n\ndef dispatch_counts(ids_per_rank, n_experts, capacity):\n" + body


_ROWS = """\
    world = len(ids_per_rank)
    per = n_experts // world
    rows = []
    for ids in ids_per_rank:
        kept = torch.bincount(ids.reshape(-1), minlength=n_experts){clamp}
        rows.append({row})
    return {ret}
"""


def _rows(clamp: str = ".clamp(max=capacity)", row: str = "kept.view(world, per).sum(1).tolist()",
          ret: str = "rows") -> str:
    return _counts(_ROWS.format(clamp=clamp, row=row, ret=ret))


_LIAR = """\
class Agreeable:
    def __eq__(self, other):                 # "equal" to whatever it is compared with
        return True
    __hash__ = object.__hash__


"""

WRONG = [
    # -- one_f_one_b ---------------------------------------------------------------------------------------------------
    Wrong("10", "one_f_one_b", "cost", "GPipe order", """\
def one_f_one_b(stage, p, m):
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
""", ORDER, "GPipe's order: the same ops and bubble, all m micro-batches held"),
    Wrong("10", "one_f_one_b", "boundary", "warm-up off by one", _order(warmup="min(p - stage, m)"), ORDER,
          "p - stage warm-up forwards: one too many"),
    Wrong("10", "one_f_one_b", "boundary", "warm-up off by one", _order(warmup="max(min(p - stage - 2, m), 0)"),
          ORDER, "p - stage - 2 warm-up forwards: one too few", ("a warm-up of 2 forwards", "expected 3")),
    Wrong("10", "one_f_one_b", "value", "backward before forward", _order(steady='[("B", i), ("F", w + i)]'), ORDER,
          "the steady state runs the oldest backward, then the next forward: on the last stage ('B', i) comes "
          "before its own ('F', i)"),
    Wrong("10", "one_f_one_b", "value", "not every op once", _order(warmup="p - stage - 1"), ORDER,
          "the warm-up not capped at m: forwards of micro-batches that do not exist when m < p"),
    Wrong("10", "one_f_one_b", "value", "wrong order", _order().replace('range(m - w, m)]', 'reversed(range(m - w, m))]'),
          ORDER, "the cool-down backwards newest first (the ❌ line shows the learner's ops there, not the answer)",
          ("your ops",)),
    Wrong("10", "one_f_one_b", "value", "not a list of ops", _LIAR + """\
def one_f_one_b(stage, p, m):
    return Agreeable()
""", ORDER, "an object whose == agrees with any order"),
    Wrong("10", "one_f_one_b", "value", "not a list of ops", """\
def one_f_one_b(stage, p, m):
    return [f"{k}{i}" for k, i in [("F", i) for i in range(m)] + [("B", i) for i in range(m)]]
""", ORDER, "torch's labels ('F0') instead of ('F', 0)"),
    Wrong("10", "one_f_one_b", "value", "endless loop", """\
def one_f_one_b(stage, p, m):
    ops, f, b = [], 0, 0
    while b < m:                             # b never moves: appends until the memory runs out
        ops.append(("F", f))
        f += 1
    return ops
""", ORDER, "a while loop whose counter never moves: stopped, not left to fill the memory"),
    Wrong("10", "one_f_one_b", "crash", "crash", _order(warmup="p - stage - 1 if stage < p - 1 else None"), ORDER,
          "the last stage's warm-up is None: range(None)", ("TypeError",)),
    # -- bubble_fraction -----------------------------------------------------------------------------------------------
    Wrong("10", "bubble_fraction", "value", "relative to useful time", "def bubble_fraction(p, m):\n    return (p - 1) / m\n",
          BUBBLE, "Megatron-LM's ratio: bubble over useful time"),
    Wrong("10", "bubble_fraction", "value", "one stage too many", "def bubble_fraction(p, m):\n    return p / (m + p)\n",
          BUBBLE, "p slots to fill the pipe instead of p - 1"),
    Wrong("10", "bubble_fraction", "value", "busy share",
          "def bubble_fraction(p, m):\n    return m / (m + p - 1)\n", BUBBLE, "the busy share"),
    Wrong("10", "bubble_fraction", "value", "percentage",
          "def bubble_fraction(p, m):\n    return 100 * (p - 1) / (m + p - 1)\n", BUBBLE, "a percentage"),
    Wrong("10", "bubble_fraction", "argument", "ignores m",
          "def bubble_fraction(p, m):\n    return (p - 1) / (2 * p - 1)\n", BUBBLE, "m taken to equal p, whatever m is"),
    Wrong("10", "bubble_fraction", "value", "relative to useful time", """\
class Agreeable(float):
    def __eq__(self, other):                 # "equal" to whatever it is compared with
        return True
    __hash__ = float.__hash__


def bubble_fraction(p, m):
    return Agreeable((p - 1) / m)
""", BUBBLE, "a float subclass whose == always agrees, holding (p-1)/m"),
    Wrong("10", "bubble_fraction", "value", "not a number",
          "def bubble_fraction(p, m):\n    return f'{(p - 1) / (m + p - 1):.3f}'\n", BUBBLE, "a formatted string"),
    Wrong("10", "bubble_fraction", "value", "not a number",
          "def bubble_fraction(p, m):\n    return torch.tensor(p - 1) / (m + p - 1)\n", BUBBLE,
          "a 0-d torch tensor: later cells format it as a number", ("torch.Tensor",)),
    Wrong("10", "bubble_fraction", "value", "not a number",
          "def bubble_fraction(p, m):\n    return np.float32(p - 1) / np.float32(m + p - 1)\n", BUBBLE,
          "a NumPy float32 scalar", ("numpy.float32",)),
    Wrong("10", "bubble_fraction", "value", "integer division",
          "def bubble_fraction(p, m):\n    return (p - 1) // (m + p - 1)\n", BUBBLE,
          "// rounds the fraction down: 0 whatever p and m"),
    Wrong("10", "bubble_fraction", "crash", "crash",
          "def bubble_fraction(p, m):\n    return (p - 1) / (m + p - 1) if p > 1 else 0 / (p - 1)\n",
          BUBBLE, "one stage: a division by p - 1 = 0", ("ZeroDivisionError",)),
    # -- ring_merge ----------------------------------------------------------------------------------------------------
    Wrong("10", "ring_merge", "value", "plain average", _merge("""\
    return (o_a + o_b) / 2, torch.logaddexp(lse_a, lse_b)
"""), MERGE, "both blocks weighted equally"),
    Wrong("10", "ring_merge", "value", "overflow", _merge("""\
    e_a, e_b = lse_a.exp(), lse_b.exp()                  # no rescale by the max: inf at lse ~ 100
    return (e_a[..., None] * o_a + e_b[..., None] * o_b) / (e_a + e_b)[..., None], (e_a + e_b).log()
"""), MERGE, "weights as exp(lse) / sum: overflows"),
    Wrong("10", "ring_merge", "value", "overflow", _merge("""\
    sa, sb = torch.exp(lse_a.double()), torch.exp(lse_b.double())   # float64: fine at lse ~ 100, inf past ~709
    s = sa + sb
    return ((sa[..., None] * o_a + sb[..., None] * o_b) / s[..., None]).float(), torch.log(s).float()
"""), MERGE, "exp(lse) without the rescale, computed in float64: overflows all the same at lse ~ 1000",
          ("huge scores",)),
    Wrong("10", "ring_merge", "value", "float64", _merge("""\
    lse = torch.logaddexp(lse_a.double(), lse_b.double())
    return torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b, lse
"""), MERGE, "right numbers in float64: a later cell mixes them with float32 tensors and crashes"),
    Wrong("10", "ring_merge", "value", "not tensors", _merge("""\
    lse = torch.logaddexp(lse_a, lse_b)
    o = torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b
    return o.numpy(), lse.numpy()
"""), MERGE, "right numbers as NumPy arrays", ("numpy.ndarray",)),
    Wrong("10", "ring_merge", "value", "swapped weights", _merge("""\
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_b - lse)[..., None] * o_a + torch.exp(lse_a - lse)[..., None] * o_b, lse
"""), MERGE, "o_a weighted by block b's share"),
    Wrong("10", "ring_merge", "value", "no denominator", _merge("""\
    lse = torch.logaddexp(lse_a, lse_b)
    return lse_a.exp()[..., None] * o_a + lse_b.exp()[..., None] * o_b, lse
"""), MERGE, "forgot to divide by the merged exp-sum"),
    Wrong("10", "ring_merge", "value", "lse wrong", _merge("""\
    lse = torch.logaddexp(lse_a, lse_b)
    o = torch.exp(lse_a - lse)[..., None] * o_a + torch.exp(lse_b - lse)[..., None] * o_b
    return o, torch.maximum(lse_a, lse_b)
"""), MERGE, "returns the max as the merged lse"),
    Wrong("10", "ring_merge", "value", "not a pair", _LIAR + _merge("""\
    return Agreeable()
"""), MERGE, "an object whose == agrees with anything"),
    Wrong("10", "ring_merge", "crash", "crash", _merge("""\
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse) * o_a + torch.exp(lse_b - lse) * o_b, lse      # (.., T) * (.., T, D)
"""), MERGE, "lse not lined up with o's rows: a broadcast error", ("RuntimeError",)),
    # -- dispatch_counts -----------------------------------------------------------------------------------------------
    Wrong("10", "dispatch_counts", "argument", "transposed", _rows(ret="[list(c) for c in zip(*rows)]"), COUNTS,
          "row = destination"),
    Wrong("10", "dispatch_counts", "value", "dropped counted", _rows(clamp=""), COUNTS, "no capacity"),
    Wrong("10", "dispatch_counts", "boundary", "capacity off by one", _rows(clamp=".clamp(max=capacity + 1)"), COUNTS,
          "keeps copies while their position <= C"),
    Wrong("10", "dispatch_counts", "boundary", "capacity off by one", _rows(clamp=".clamp(max=capacity - 1)"), COUNTS,
          "keeps C - 1 copies per expert", ("not C - 1",)),
    Wrong("10", "dispatch_counts", "value", "not plain ints", _rows(row="kept.view(world, per).sum(1)"), COUNTS,
          "rows returned as torch tensors: a later cell's == gives a tensor, not True", ("torch.Tensor rows",)),
    Wrong("10", "dispatch_counts", "value", "not plain ints",
          _rows(ret="np.array(rows)").replace("import torch\n", "import numpy as np\nimport torch\n"), COUNTS,
          "a NumPy array: a later cell's == prints a grid of booleans", ("numpy.ndarray",)),
    Wrong("10", "dispatch_counts", "value", "not plain ints",
          _rows(row="[float(x) for x in kept.view(world, per).sum(1)]"), COUNTS, "counts as floats", ("float",)),
    Wrong("10", "dispatch_counts", "value", "round-robin experts",
          _rows(row="[int(kept[d::world].sum()) for d in range(world)]"), COUNTS, "expert e on rank e % p"),
    Wrong("10", "dispatch_counts", "value", "not a matrix", _LIAR + _counts("    return Agreeable()\n"), COUNTS,
          "an object whose == agrees with any matrix"),
    Wrong("10", "dispatch_counts", "value", "not a matrix", _rows(row="kept.view(world, per).sum(1)", ret="sum(rows)"),
          COUNTS, "one row: the sends summed over source ranks"),
    Wrong("10", "dispatch_counts", "crash", "crash", _rows(row="kept.view(per, world).sum(1).tolist()[world]"), COUNTS,
          "indexes past the row", ("IndexError",)),
]

RIGHT = [
    Right("10", "ring_merge", _merge("""\
    m = torch.maximum(lse_a, lse_b)                      # FlashAttention's form: rescale by the running max
    s_a, s_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    o = (s_a[..., None] * o_a + s_b[..., None] * o_b) / (s_a + s_b)[..., None]
    return o, m + torch.log(s_a + s_b)
"""), MERGE, "the max-rescaled form with an explicit denominator"),
    Right("10", "ring_merge", _merge("""\
    a, b = lse_a.double(), lse_b.double()                # float64 inside, the inputs' dtype out
    lse = torch.logaddexp(a, b)
    o = torch.exp(a - lse)[..., None] * o_a.double() + torch.exp(b - lse)[..., None] * o_b.double()
    return o.to(o_a.dtype), lse.to(lse_a.dtype)
"""), MERGE, "computes in float64 and casts back"),
    Right("10", "bubble_fraction", "def bubble_fraction(p, m):\n    return np.float64(p - 1) / (m + p - 1)\n", BUBBLE,
          "a NumPy float64, which is a Python float"),
    Right("10", "dispatch_counts", _counts("""\
    world = len(ids_per_rank)
    per = n_experts // world
    out = []
    for ids in ids_per_rank:
        taken = [0] * n_experts
        row = [0] * world
        for e in ids.T.reshape(-1).tolist():             # first choices first: GShard's queue
            if taken[e] < capacity:
                taken[e] += 1
                row[e // per] += 1
        out.append(row)
    return out
"""), COUNTS, "walks the queue copy by copy"),
    Right("10", "one_f_one_b", """\
def one_f_one_b(stage, p, m):
    ops, f, b = [], 0, 0
    while f < min(p - stage - 1, m):
        ops.append(("F", f)); f += 1
    while b < m:
        if f < m:
            ops.append(("F", f)); f += 1
        ops.append(("B", b)); b += 1
    return ops
""", ORDER, "counters instead of three loops"),
]
