"""Lab 06's PyTorch tensor-parallel exercise: the 2-D layout of FSDP × TP for a cluster and its TP plan.

``tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node) -> (mesh_shape, mesh_dim_names, plan)``: the mesh for
``init_device_mesh`` and the plan ``parallelize_module`` applies to each block. Pure: the check inspects what
is returned (the ParallelStyle of each Linear and the layouts it declares) on clusters chosen so that each
classic mistake shows -- no ranks needed. The lab then trains with the learner's plan on 4 gloo ranks.

The check is split (:mod:`course_lib.checks.judge`): the run half calls the learner's function on each cluster and
sends what came out as plain data -- a refusal (ValueError) with its text, or the mesh shape and names and, for each
Linear of the plan, its style's kind and the layouts it declares (placements as ``("Shard", -1)``); the judge half
(:func:`judge_tp_plan`) decides from the cluster itself which layouts must be refused and names the mistake.
"""
from __future__ import annotations

from course_lib.checks import plain as _plain
from course_lib.checks.judge import decide, guard as _guard
from course_lib.checks.lab05 import raise_crash, run_cases
from course_lib.checks.registry import exercise

__all__ = ["HINTS", "check_tp_plan", "reference_tp_plan", "judge_tp_plan"]

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

#: (n_heads, d_ff, tp, nodes, gpus_per_node): four layouts that work, then one refused for the heads, one for d_ff,
#: two for a node (what must happen is the judge's to say: :func:`_expected`)
CASES = [
    (6, 198, 2, 2, 2), (32, 14336, 8, 4, 8), (16, 4096, 4, 2, 8), (6, 198, 1, 1, 4),
    (6, 200, 4, 2, 4), (8, 198, 4, 2, 4), (8, 4096, 8, 4, 4), (8, 4096, 4, 2, 6),
]


def _expected(n_heads, d_ff, tp, gpus_per_node) -> str:
    """Judge half: what must happen for a cluster: "ok", or the refusal's reason ("heads", "d_ff", "node")."""
    return "heads" if n_heads % tp else "d_ff" if d_ff % tp else "node" if gpus_per_node % tp else "ok"


def reference_tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node):
    """The answer: Megatron's plan; the mesh (data parallel, tensor parallel) with TP inside a node."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if n_heads % tp or d_ff % tp:
        raise ValueError(f"tp({tp}) must divide n_heads({n_heads}) and d_ff({d_ff})")
    if gpus_per_node % tp:
        raise ValueError(f"tp({tp}) must divide gpus_per_node({gpus_per_node}): a tensor group stays in a node")
    plan = {m: ColwiseParallel() for m in COLUMN} | {m: RowwiseParallel() for m in ROW}
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan


def _layout_plain(layouts) -> list:
    """Run half: a style's declared layouts as plain rows: ``("Shard", dim)``, ``("Replicate",)``, else (type, text)."""
    from torch.distributed.tensor import Replicate, Shard
    out = []
    for p in tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,):
        if type(p) is Shard:
            out.append(("Shard", int(p.dim)))
        elif type(p) is Replicate:
            out.append(("Replicate",))
        else:
            out.append((type(p).__name__, str(p) if (type(p).__module__ or "").startswith("torch.") else f"{type(p).__name__}(...)"))
    return out


def _layout_text(rows) -> str:
    """Judge half: plain layout rows as torch prints the tuple, ``(Shard(dim=-1),)``."""
    parts = [f"Shard(dim={r[1]})" if r[0] == "Shard" else "Replicate()" if r[0] == "Replicate" else str(r[-1])
             for r in rows]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def _style_plain(style) -> dict:
    """Run half: one ParallelStyle as plain data: its kind, its type's name, the layouts it declares."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    kind = ("ColwiseParallel" if isinstance(style, ColwiseParallel) else
            "RowwiseParallel" if isinstance(style, RowwiseParallel) else None)
    out = {"kind": kind, "type": type(style).__name__}
    if kind:
        out.update(out_layouts=_layout_plain(style.output_layouts), in_layouts=_layout_plain(style.input_layouts),
                   local=bool(style.use_local_output))
    return out


def _plan_result(got) -> dict:
    """Run half: what ``tp_plan`` returned, as plain data (its first two items as they are, the plan by style)."""
    out = {"type": type(got).__name__}
    if isinstance(got, (tuple, list)):
        items = list(tuple.__iter__(got) if isinstance(got, tuple) else list.__iter__(got))
        out.update(len=len(items), items=[_plain.plain(v) for v in items[:2]])
        if len(items) >= 3:
            plan = items[2]
            out["plan_type"] = type(plan).__name__
            out["plan"] = ({_plain.plain(k): _style_plain(v) for k, v in dict.items(plan)}
                           if isinstance(plan, dict) else None)
    return out


def _style_mistake(plan, plan_type: str = "dict") -> str | None:
    """Judge half: what is wrong with a block plan (plain: name -> :func:`_style_plain`), or None."""
    if not isinstance(plan, dict):
        return f"the plan is a {plan_type}: a dict from each Linear's name in the block to its ParallelStyle"
    missing = [m for m in COLUMN + ROW if m not in plan]
    if missing:
        return (f"the plan has no entry for {missing}: every Linear of the block must be cut, or its weights are "
                "whole on every rank and its input is the wrong size (the block's attention is split into separate "
                "q, k, v Linears by tpt.split_attention_ before the plan is applied: name those three)")
    for m in COLUMN:
        if plan[m]["kind"] == "RowwiseParallel":
            return (f"{m} is row-wise, but its input is the whole activation (every rank has all of it): cut its "
                    "output features (column-wise), so that each rank computes whole heads / its slice of d_ff")
    for m in ROW:
        if plan[m]["kind"] == "ColwiseParallel":
            return (f"{m} is column-wise, but its input arrives cut (the slice the layer before produced): it must "
                    "cut its input features (row-wise) and all-reduce the partial sums")
    for m in COLUMN + ROW:
        if plan[m]["kind"] is None:
            return f"{m} is {plan[m]['type']}: use ColwiseParallel or RowwiseParallel"
    for col, row in PAIRS.items():
        out, inp, local = plan[col]["out_layouts"], plan[row]["in_layouts"], plan[col]["local"]
        if list(out) != [("Shard", -1)] or list(inp) != [("Shard", -1)] or not local:
            return (f"{col} hands its output on as {_layout_text(out)} (use_local_output={local}) but {row} expects "
                    f"its input as {_layout_text(inp)}: the layout one layer produces must be the one the next "
                    "consumes (the defaults of the two styles match: the last dimension cut, plain tensors in between)")
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


def run_tp_plan(fn) -> dict:
    """Run half: the learner's answer for each cluster: a ValueError kept as its text (the run goes on), a crash
    recorded (the run stops there), else :func:`_plan_result`. No case here says what must happen."""
    return {"got": run_cases(lambda c: _plan_result(fn(*c)), CASES, record=(ValueError,))}


def judge_tp_plan(data: dict, name: str = "tp_plan") -> str:
    """Judge half: each cluster's outcome against what must happen (:func:`_expected`), the mistake named."""
    entries = data.get("got") if isinstance(data, dict) else None
    for i, (heads, d_ff, tp, nodes, gpn) in enumerate(CASES):
        want = _expected(heads, d_ff, tp, gpn)
        where = f"tp_plan(n_heads={heads}, d_ff={d_ff}, tp={tp}, nodes={nodes}, gpus_per_node={gpn})"
        if not isinstance(entries, list) or i >= len(entries) or not isinstance(entries[i], dict):
            raise AssertionError(f"{name} was not run on every cluster")
        e = entries[i]
        if "raised" in e:                            # a ValueError
            if want != "ok":
                continue
            raise AssertionError(f"{where} raised ValueError({e.get('msg', '')}), but this layout works\n   likely "
                                 "mistake: refuse only what cannot work (tp not dividing the heads, d_ff or a node)")
        if "crash" in e:                             # a refusal of the wrong kind, or a crash: say which
            if want == "ok":
                raise_crash(e)
            msg = str(e["crash"].get("msg", "")) if isinstance(e["crash"], dict) else ""
            said = msg.strip().splitlines()[0] if msg.strip() else ""
            raise AssertionError(f"{where} raised {e['crash'].get('kind')}({said}); this layout must be refused, and "
                                 "the check expects ValueError (raise ValueError(...) naming the values), not an "
                                 "assert or another exception")
        got = e["got"]
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
            three = "items" in got and got.get("len") == 3
            why = (_layout_mistake(got["items"], heads, d_ff, tp, nodes, gpn) if three
                   else f"returned a {got['type']}: return the three things (mesh_shape, mesh_dim_names, plan)")
            why = why or _style_mistake(got.get("plan"), got.get("plan_type", "dict"))
        if why:
            shown = tuple(got["items"]) if "items" in got else got["type"]
            raise AssertionError(f"{where}: returned {shown!r}\n   likely mistake: {why}")
    return (f"{len(CASES)} clusters: q, k, v, fc column-wise and both projections row-wise, 'tp' inside a node, "
            "impossible layouts refused")


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
          guards=("argument", "boundary"), judge=judge_tp_plan,
          references=("course_lib.checks.lab06_tp.reference_tp_plan", "course_lib.strategies.tp.torch.gpt_plan"))
def check_tp_plan(fn, name: str = "tp_plan") -> bool:
    fn = _guard(fn, "06", "tp_plan")
    return decide(name, lab="06", tests=check_tp_plan.exercise.tests, run=lambda: run_tp_plan(fn),
                  judge=judge_tp_plan, params={"name": name})
