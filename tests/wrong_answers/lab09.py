"""Lab 09's classic mistakes (when it breaks): reading a hang from every rank's stack, finding the rank that drifted
with one collective, finding where a NaN was born, and the momentum sharding that stops XLA resharding every step."""
from wrong_answers import Wrong

HANG = "lab09.check_hang_report(hang_report)"
DRIFT = "lab09.check_diverged_ranks(diverged_ranks)"
NAN = "lab09.check_first_nonfinite(first_nonfinite)"
SPEC = "lab09.check_spec_fix(spec_fix)"


def _hang(pick: str, missing: str = "sorted(r for r, o in ops.items() if o != op)") -> str:
    return f"""\
import re
from collections import Counter


def hang_report(stacks):
    ops = {{}}
    for rank, text in stacks.items():
        frames = re.findall(r'File "([^"]+)", line \\d+, in (\\w+)', text)
        ops[rank] = {pick}
    op = Counter(o for o in ops.values() if o).most_common(1)[0][0]
    return {{"op": op, "missing": {missing}}}
"""


OUTER_C10D = "next((fn for path, fn in frames if path.endswith(lab09.C10D)), None)"
_DRIFT_HEAD = """\
import torch
import torch.distributed as dist
from course_lib.measure import fingerprint


def diverged_ranks(model):
    names = [n for n, _ in model.named_parameters()]
"""
_DRIFT_FIRST = """\
    bad = table != table[0]
    for j, name in enumerate(names):
        if bool(bad[:, j].any()):
            return name, int(bad[:, j].nonzero()[0, 0])
    return None
"""
_GATHER = """\
    table = torch.empty(dist.get_world_size(), len(fps), dtype=fps.dtype)
    dist.all_gather(list(table), fps)
"""
_FPS = "    fps = fingerprint.fingerprints(model)[1]\n"


def _nan(body: str) -> str:
    return "def first_nonfinite(records):\n" + body


def _spec(body: str) -> str:
    return "from jax.sharding import PartitionSpec as P\n\n\ndef spec_fix(params):\n" + body


WRONG = [
    # -- hang_report -------------------------------------------------------------------------------------------------
    Wrong("09", "hang_report", "value", "outermost frame", _hang("frames[0][1]"), HANG,
          "reads the first frame printed: the launcher's"),
    Wrong("09", "hang_report", "value", "innermost frame",
          _hang("next((fn for path, fn in reversed(frames) if path.endswith(lab09.C10D)), None)"), HANG,
          "the innermost torch frame: all_gather inside all_gather_object"),
    Wrong("09", "hang_report", "value", "a frame of the program",
          _hang("next((fn for path, fn in reversed(frames) if 'site-packages' not in path), None)"), HANG,
          "the learner's own innermost line: train_step, not the collective"),
    Wrong("09", "hang_report", "value", "the waiting ranks",
          _hang(OUTER_C10D, missing="sorted(r for r, o in ops.items() if o == op)"), HANG, "names the ranks that wait"),
    Wrong("09", "hang_report", "value", "idle ranks only",
          _hang(OUTER_C10D, missing="sorted(r for r, o in ops.items() if o is None and 'conn.recv' in stacks[r])"),
          HANG, "only ranks that returned count as missing"),
    Wrong("09", "hang_report", "value", "not a dict", _hang(OUTER_C10D).replace(
        'return {"op": op, "missing": sorted(r for r, o in ops.items() if o != op)}',
        'return op, sorted(r for r, o in ops.items() if o != op)'), HANG, "a tuple instead of the dict"),
    Wrong("09", "hang_report", "crash", "crash", _hang(OUTER_C10D).replace(
        "op = Counter(o for o in ops.values() if o).most_common(1)[0][0]", "op = max(ops.values())"),
          HANG, "max() over names and None", ("TypeError",)),

    # -- diverged_ranks ----------------------------------------------------------------------------------------------
    Wrong("09", "diverged_ranks", "value", "float sum", _DRIFT_HEAD + """\
    fps = torch.stack([p.detach().double().sum() for p in model.parameters()])   # a float sum per parameter
""" + _GATHER + _DRIFT_FIRST, DRIFT, "a float sum as the checksum"),
    Wrong("09", "diverged_ranks", "value", "not the first parameter", _DRIFT_HEAD + _FPS + _GATHER + """\
    bad = table != table[0]
    for r in range(1, dist.get_world_size()):         # rank first, then parameter
        for j, name in enumerate(names):
            if bool(bad[r, j]):
                return name, r
    return None
""", DRIFT, "walks ranks first, then parameters"),
    Wrong("09", "diverged_ranks", "value", "rank 0 named", _DRIFT_HEAD + _FPS + _GATHER + """\
    bad = table != table[0]
    for j, name in enumerate(names):
        if bool(bad[:, j].any()):
            return name, 0                              # "rank 0 disagrees with someone"
    return None
""", DRIFT, "names the reference rank"),
    Wrong("09", "diverged_ranks", "value", "only rank 0 knows", _DRIFT_HEAD + _FPS + """\
    table = [torch.empty_like(fps) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(fps, table, dst=0)                      # only rank 0 sees the table
    if dist.get_rank() != 0:
        return None
    table = torch.stack(table)
""" + _DRIFT_FIRST, DRIFT, "gather to rank 0 instead of all-gather"),
    Wrong("09", "diverged_ranks", "value", "false alarm", _DRIFT_HEAD + """\
    fps = torch.stack([p.detach().double().sum() + dist.get_rank() * 1e-12 for p in model.parameters()])
""" + _GATHER + _DRIFT_FIRST, DRIFT, "a rank-dependent value creeps into the checksum"),
    Wrong("09", "diverged_ranks", "argument", "some ranks only", _DRIFT_HEAD + _FPS + _GATHER.replace(
        "dist.get_world_size()", "2").replace("dist.all_gather(list(table), fps)",
                                              "dist.all_gather(list(table) + [torch.empty_like(fps)] * "
                                              "(dist.get_world_size() - 2), fps)") + _DRIFT_FIRST,
          DRIFT, "compares rank 0 with rank 1 only: the world size ignored"),
    Wrong("09", "diverged_ranks", "cost", "a collective per parameter", _DRIFT_HEAD + """\
    for name, p in model.named_parameters():            # one all-gather per parameter
        mine = torch.tensor([fingerprint.fingerprint(p)])
        every = torch.empty(dist.get_world_size(), dtype=torch.int64)
        dist.all_gather(list(every.view(-1, 1)), mine)
        if bool((every != every[0]).any()):
            return name, int((every != every[0]).nonzero()[0, 0])
    return None
""", DRIFT, "one all-gather per parameter"),
    Wrong("09", "diverged_ranks", "crash", "crash", _DRIFT_HEAD + _FPS + """\
    table = torch.empty(dist.get_world_size(), len(fps), dtype=fps.dtype)
    dist.all_gather_into_tensor(table, fps)             # gloo wants a flat output
""" + _DRIFT_FIRST, DRIFT, "a 2-D output for all_gather_into_tensor", ("on rank",)),

    # -- first_nonfinite ---------------------------------------------------------------------------------------------
    Wrong("09", "first_nonfinite", "value", "list order", _nan("""\
    bad = [r for r in records if r["nan"] or r["inf"]]
    return (bad[0]["rank"], bad[0]["step"], bad[0]["module"]) if bad else None     # the order they arrived
"""), NAN, "the first bad record in arrival order"),
    Wrong("09", "first_nonfinite", "value", "NaN only", _nan("""\
    bad = [r for r in records if r["nan"]]                                         # an inf is not a NaN...
    first = min(bad, key=lambda r: (r["step"], r["call"], r["rank"])) if bad else None
    return (first["rank"], first["step"], first["module"]) if first else None
"""), NAN, "isnan only"),
    Wrong("09", "first_nonfinite", "value", "later in the forward", _nan("""\
    bad = [r for r in records if r["nan"] or r["inf"]]
    first = min(bad, key=lambda r: (r["step"], r["rank"], r["module"])) if bad else None   # alphabetical modules
    return (first["rank"], first["step"], first["module"]) if first else None
"""), NAN, "modules sorted by name, not by when they ran"),
    Wrong("09", "first_nonfinite", "value", "rank order", _nan("""\
    bad = [r for r in records if r["nan"] or r["inf"]]
    first = min(bad, key=lambda r: (r["step"], r["rank"], r["call"])) if bad else None
    return (first["rank"], first["step"], first["module"]) if first else None
"""), NAN, "lowest rank first within a step"),
    Wrong("09", "first_nonfinite", "value", "false alarm", _nan("""\
    first = min(records, key=lambda r: (r["step"], r["call"], r["rank"]))         # forgot to keep the bad ones
    return first["rank"], first["step"], first["module"]
"""), NAN, "the first record, bad or not"),
    Wrong("09", "first_nonfinite", "value", "not a triple", _nan("""\
    bad = [r for r in records if r["nan"] or r["inf"]]
    return min(bad, key=lambda r: (r["step"], r["call"], r["rank"])) if bad else None   # the whole record
"""), NAN, "returns the record dict"),
    Wrong("09", "first_nonfinite", "crash", "crash", _nan("""\
    bad = [r for r in records if r["nan"] or r["inf"]]
    first = min(bad, key=lambda r: (r["step"], r["call"]))                          # min() of an empty list
    return first["rank"], first["step"], first["module"]
"""), NAN, "no None for a healthy run", ("ValueError",)),

    # -- spec_fix ----------------------------------------------------------------------------------------------------
    Wrong("09", "spec_fix", "cost", "replicated state", _spec("""\
    specs = {k: p.sharding.spec for k, p in params.items()}
    specs["w1"] = P()                                   # "the big one: keep a full copy, it is simpler"
    return specs
"""), SPEC, "one momentum replicated"),
    Wrong("09", "spec_fix", "cost", "one spec for all", _spec("""\
    return {k: P() for k in params}                     # jnp.zeros(shape): replicated everywhere
"""), SPEC, "every momentum replicated"),
    Wrong("09", "spec_fix", "value", "another dim", _spec("""\
    specs = {k: p.sharding.spec for k, p in params.items()}
    specs["w1"] = P(None, "fsdp")                       # transposed
    return specs
"""), SPEC, "a momentum cut along the other dim"),
    Wrong("09", "spec_fix", "argument", "one spec for all", _spec("""\
    return {k: P("fsdp") for k in params}               # FSDP cuts dim 0: every state the same
"""), SPEC, "ignores each parameter's own spec"),
    Wrong("09", "spec_fix", "argument", "sharded a replicated parameter", _spec("""\
    specs = {k: p.sharding.spec for k, p in params.items()}
    specs["b1"] = P("fsdp")                             # shard everything that divides
    return specs
"""), SPEC, "cuts the replicated bias's momentum"),
    Wrong("09", "spec_fix", "value", "not specs", _spec("""\
    return {k: p.sharding for k, p in params.items()}   # NamedShardings, not PartitionSpecs
"""), SPEC, "returns shardings"),
    Wrong("09", "spec_fix", "crash", "crash", _spec("""\
    return {k: p.spec for k, p in params.items()}       # arrays have .sharding.spec
"""), SPEC, "an attribute arrays do not have", ("AttributeError",)),
]

# -- issue 45: the holes the checks had, each closed with a wrong answer ------------------------------------------------
_DRIFT_RIGHT = _DRIFT_HEAD + _FPS + _GATHER + _DRIFT_FIRST
WRONG += [
    Wrong("09", "hang_report", "value", "format slip", """\
import re
from collections import Counter


def hang_report(stacks):
    ops = {}
    for rank, text in stacks.items():
        calls = re.findall(r"(dist\\.\\w+)\\(", text)          # the call as the code line spells it
        ops[rank] = calls[0] if calls else None
    op = Counter(o for o in ops.values() if o).most_common(1)[0][0]
    return {"op": op, "missing": sorted(r for r, o in ops.items() if o != op)}
""", HANG, "reads the code line: 'dist.all_reduce' for 'all_reduce'", ("'all_reduce'",)),
    Wrong("09", "hang_report", "value", "not sorted", _hang(OUTER_C10D, missing="{r for r, o in ops.items() if o != op}"),
          HANG, "a set of ranks where the text says sorted", ("a set",)),
    Wrong("09", "hang_report", "value", "outermost frame", _hang(OUTER_C10D).replace(
        'return {"op": op,', 'return {"op": Op(frames[0][1]),') + """

class Op(str):                                          # == says yes to anything
    def __eq__(self, other):
        return True
    __hash__ = str.__hash__
""", HANG, "the first frame printed (the launcher's), in a str whose == always says yes", ("'worker_main'",)),
    Wrong("09", "diverged_ranks", "value", "not the lowest rank", _DRIFT_RIGHT.replace(
        "int(bad[:, j].nonzero()[0, 0])", "int(bad[:, j].nonzero()[-1, 0])"), DRIFT,
          "the highest rank that differs, where two do", ("blocks.0.weight",)),
    Wrong("09", "diverged_ranks", "cost", "more than one collective", _DRIFT_RIGHT.replace(
        "    bad = table != table[0]\n",
        "    dist.all_reduce(torch.zeros(1))                    # 'make sure everyone got here'\n"
        "    bad = table != table[0]\n"), DRIFT, "the right answer plus an extra all-reduce",
          ("issued 2 collectives", "all_gather, all_reduce")),
    Wrong("09", "first_nonfinite", "value", "later in the forward", _nan("""\
    bad = [r for r in records if r["nan"] or r["inf"]]
    if not bad:
        return None
    first = min(bad, key=lambda r: (r["step"], r["call"], r["rank"]))
    # "a module's output holds its children's: if the enclosing module went bad too, it started there"
    parent = first["module"].rpartition(".")[0]
    up = next((r for r in bad if (r["rank"], r["step"], r["module"]) == (first["rank"], first["step"], parent)), None)
    first = up or first
    return first["rank"], first["step"], first["module"]
"""), NAN, "blames the enclosing module: its hook fires after its child's"),
]
