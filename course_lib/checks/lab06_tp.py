"""Lab 06's PyTorch tensor-parallel exercise: the 2-D layout of FSDP × TP for a cluster and its TP plan.

``tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node) -> (mesh_shape, mesh_dim_names, plan)``: the mesh for
``init_device_mesh`` and the plan ``parallelize_module`` applies to each block. Pure: the check inspects what
is returned (the ParallelStyle of each Linear and the layouts it declares) on clusters chosen so that each
classic mistake shows -- no ranks needed. The lab then trains with the learner's plan on 4 gloo ranks.
"""
from __future__ import annotations

from course_lib import checks
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "check_tp_plan", "reference_tp_plan"]

HINTS = {
    "tp_plan": [
        "Megatron's pairing: a Linear whose input is the whole activation cuts its *output* features; the "
        "Linear after it then gets exactly the slice it needs as its *input* features, and one all-reduce "
        "makes its output whole again. The mesh has two dims, and TP's many small all-reduces want the "
        "fastest link: which ranks share a node decides where a tensor group may go.",
        "q, k, v and the MLP's fc take the whole activation; attn.proj and mlp.proj take a slice. Each rank "
        "must compute whole heads and an equal slice of d_ff. A tensor group must not leave a node: on a mesh "
        "(dp_shard, tp), rank = dp_index·tp + tp_index, so the tp ranks of a group are consecutive -- one node's "
        "when 'tp' is the last dimension and tp divides gpus_per_node. Refuse the rest with ValueError.",
        "check n_heads % tp, d_ff % tp, gpus_per_node % tp; return (nodes * gpus_per_node // tp, tp), "
        "('dp_shard', 'tp'), {'attn.q': ColwiseParallel(), ..., 'attn.proj': RowwiseParallel(), "
        "'mlp.fc': ColwiseParallel(), 'mlp.proj': RowwiseParallel()}",
    ],
}

COLUMN = ("attn.q", "attn.k", "attn.v", "mlp.fc")     # input: the whole activation -> cut the outputs
ROW = ("attn.proj", "mlp.proj")                       # input: a slice -> partial sums, all-reduced
PAIRS = {"attn.q": "attn.proj", "attn.k": "attn.proj", "attn.v": "attn.proj", "mlp.fc": "mlp.proj"}

#: (n_heads, d_ff, tp, nodes, gpus_per_node, what must happen)
CASES = [
    (6, 198, 2, 2, 2, "ok"), (32, 14336, 8, 4, 8, "ok"), (16, 4096, 4, 2, 8, "ok"), (6, 198, 1, 1, 4, "ok"),
    (6, 200, 4, 2, 4, "heads"), (8, 198, 4, 2, 4, "d_ff"), (8, 4096, 8, 4, 4, "node"), (8, 4096, 4, 2, 6, "node"),
]


def reference_tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node):
    """The answer: Megatron's plan; the mesh (data parallel, tensor parallel) with TP inside a node."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if n_heads % tp or d_ff % tp:
        raise ValueError(f"tp({tp}) must divide n_heads({n_heads}) and d_ff({d_ff})")
    if gpus_per_node % tp:
        raise ValueError(f"tp({tp}) must divide gpus_per_node({gpus_per_node}): a tensor group stays in a node")
    plan = {m: ColwiseParallel() for m in COLUMN} | {m: RowwiseParallel() for m in ROW}
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan


def _style_mistake(plan: dict) -> str | None:
    """What is wrong with a block plan, or None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if not isinstance(plan, dict):
        return f"the plan is a {type(plan).__name__}: a dict from each Linear's name in the block to its ParallelStyle"
    missing = [m for m in COLUMN + ROW if m not in plan]
    if missing:
        return (f"the plan has no entry for {missing}: every Linear of the block must be cut, or its weights are "
                "whole on every rank and its input is the wrong size (the block's attention is split into separate "
                "q, k, v Linears by tpt.split_attention_ before the plan is applied: name those three)")
    for m in COLUMN:
        if isinstance(plan[m], RowwiseParallel):
            return (f"{m} is row-wise, but its input is the whole activation (every rank has all of it): cut its "
                    "output features (column-wise), so that each rank computes whole heads / its slice of d_ff")
    for m in ROW:
        if isinstance(plan[m], ColwiseParallel):
            return (f"{m} is column-wise, but its input arrives cut (the slice the layer before produced): it must "
                    "cut its input features (row-wise) and all-reduce the partial sums")
    for m in COLUMN + ROW:
        if not isinstance(plan[m], (ColwiseParallel, RowwiseParallel)):
            return f"{m} is {type(plan[m]).__name__}: use ColwiseParallel or RowwiseParallel"
    for col, row in PAIRS.items():
        out, inp, local = plan[col].output_layouts, plan[row].input_layouts, plan[col].use_local_output
        if tuple(out) != (Shard(-1),) or tuple(inp) != (Shard(-1),) or not local:
            return (f"{col} hands its output on as {tuple(out)} (use_local_output={local}) but {row} expects its input "
                    f"as {tuple(inp)}: the layout one layer produces must be the one the next consumes (the defaults "
                    "of the two styles match: the last dimension cut, plain tensors in between)")
    return None


def _layout_mistake(got, n_heads, d_ff, tp, nodes, gpn) -> str | None:
    shape, names = tuple(got[0]), tuple(got[1])
    world = nodes * gpn
    if sorted(names) != ["dp_shard", "tp"] or len(shape) != 2:
        return f"mesh_dim_names {names} with shape {shape}: two dims, named 'dp_shard' and 'tp'"
    if shape[names.index("tp")] != tp or shape[0] * shape[1] != world:
        return (f"mesh {dict(zip(names, shape))} for {nodes} nodes × {gpn} GPUs and tp={tp}: the 'tp' dim has tp ranks "
                f"and the product is the world size {world}")
    if names[-1] != "tp":
        return (f"mesh_dim_names {names}: 'tp' is the first dim, so a tensor group is ranks {list(range(0, world, shape[1]))[:tp]}"
                f" -- on different nodes: TP over the inter-node link. Rank d·T + t: put 'tp' last, so a tensor "
                "group is consecutive ranks, one node")
    return None


@exercise("06", "tp_plan", cell="def tp_plan(", hints=HINTS["tp_plan"],
          tests="8 clusters: Megatron's plan (q, k, v, fc column-wise; both projections row-wise, layouts that "
                "chain), the mesh (dp_shard, tp) with TP inside a node, and a ValueError when tp does not divide "
                "the heads, d_ff or a node's GPUs",
          mistakes={"row-wise where column-wise belongs": "is row-wise, but its input is the whole activation",
                    "column-wise where row-wise belongs": "is column-wise, but its input arrives cut",
                    "layouts that do not chain": "the layout one layer produces must be the one the next consumes",
                    "heads not divisible by tp": "whole heads",
                    "TP over the inter-node link": "TP over the inter-node link",
                    "d_ff not divisible by tp": "every rank's slice must be the same size",
                    "missing entry": "the plan has no entry for", "mesh is not the cluster": "the product is the world size",
                    "refuses a layout that works": "but this layout works", "ValueError expected": "expects ValueError",
                    "not three things": "return the three things"},
          guards=("argument", "boundary"))
def check_tp_plan(fn, name: str = "tp_plan") -> bool:
    with checks.check(name, tests=check_tp_plan.exercise.tests) as c:
        for heads, d_ff, tp, nodes, gpn, want in CASES:
            where = f"tp_plan(n_heads={heads}, d_ff={d_ff}, tp={tp}, nodes={nodes}, gpus_per_node={gpn})"
            try:
                got = fn(heads, d_ff, tp, nodes, gpn)
            except ValueError as e:
                if want != "ok":
                    continue
                raise AssertionError(f"{where} raised ValueError({e}), but this layout works\n   likely mistake: "
                                     "refuse only what cannot work (tp not dividing the heads, d_ff or a node)") from None
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - a refusal of the wrong kind, or a crash: say which
                if want == "ok":
                    raise
                said = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise AssertionError(f"{where} raised {type(e).__name__}({said}); this layout must be refused, and the "
                                     "check expects ValueError (raise ValueError(...) naming the values), not an "
                                     "assert or another exception") from None
            if want == "heads":
                why = (f"n_heads({heads}) % tp({tp}) = {heads % tp}: each rank must compute whole heads (q's output "
                       "is cut by heads); raise ValueError naming n_heads and tp")
            elif want == "d_ff":
                why = (f"d_ff({d_ff}) % tp({tp}) = {d_ff % tp}: fc's output slice is mlp.proj's input, and every "
                       "rank's slice must be the same size; raise ValueError naming d_ff and tp")
            elif want == "node":
                why = (f"tp({tp}) does not fit in one node of {gpn} GPUs: a tensor group would span nodes -- TP over the "
                       "inter-node link, where its many small all-reduces are slowest; raise ValueError")
            else:
                three = isinstance(got, (tuple, list)) and len(got) == 3
                why = (_layout_mistake(got, heads, d_ff, tp, nodes, gpn) if three
                       else f"returned a {type(got).__name__}: return the three things (mesh_shape, mesh_dim_names, plan)")
                why = why or _style_mistake(got[2])
            if why:
                shown = tuple(got[:2]) if isinstance(got, (tuple, list)) else type(got).__name__
                raise AssertionError(f"{where}: returned {shown!r}\n   likely mistake: {why}")
        c.ok(f"{len(CASES)} clusters: q, k, v, fc column-wise and both projections row-wise, 'tp' inside a node, "
             "impossible layouts refused")
    return bool(c.passed)
