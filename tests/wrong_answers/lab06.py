"""Lab 06's classic mistakes (hybrid sharding): the HSDP mesh, the bytes per axis, choosing F, the FSDP × TP
specs in JAX and the TP plan in PyTorch."""
from wrong_answers import Right, Wrong

IMPORTS = """\
import math
from jax.sharding import PartitionSpec as P
from course_lib.strategies.fsdp import jax as fsdp_jax
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
"""


def _hsdp(body: str) -> str:
    return IMPORTS + """
def shard_hsdp(model, replicate, shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
""" + body


def _tp_plan(body: str) -> str:
    return IMPORTS + """
def tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node):
""" + body


RIGHT_PLAN = """\
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
"""
HSDP = "lab06.check_hsdp_shard(shard_hsdp)"
AXIS = "lab06.check_axis_bytes(axis_bytes)"
CHOOSE = "lab06.check_choose_f(choose_f)"
SPEC = "lab06.check_tp_spec(tp_spec)"
PLAN = "lab06_tp.check_tp_plan(tp_plan)"

WRONG = [
    # -- shard_hsdp ------------------------------------------------------------------------------------------
    Wrong("06", "shard_hsdp", "value", "axes swapped", _hsdp("""\
    mesh = init_device_mesh("cpu", (shard, replicate), mesh_dim_names=("shard", "replicate"))   # torchtitan's order
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
"""), HSDP, "trusts the docs' (shard, replicate) order over FSDP2's code"),
    Wrong("06", "shard_hsdp", "value", "root never sharded", _hsdp("""\
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return mesh                                      # the embeddings, ln_f and head stay whole
"""), HSDP, "shards the blocks only"),
    Wrong("06", "shard_hsdp", "value", "names swapped", _hsdp("""\
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("shard", "replicate"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
"""), HSDP, "right shape, names in the other order"),
    Wrong("06", "shard_hsdp", "value", "1-D mesh", _hsdp("""\
    mesh = init_device_mesh("cpu", (replicate * shard,))      # Lab 04's mesh
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
"""), HSDP, "FSDP over all N ranks"),
    Wrong("06", "shard_hsdp", "argument", "arguments ignored", _hsdp("""\
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))   # the lab's example
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
"""), HSDP, "hard-codes the 2 x 4 mesh of the text"),
    Wrong("06", "shard_hsdp", "cost", "1-D mesh", _hsdp("""\
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    flat = init_device_mesh("cpu", (replicate * shard,))      # Lab 04's mesh: the same values, FSDP's traffic
    for block in model.blocks:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    return mesh
"""), HSDP, "returns the 2-D mesh but shards over all N ranks: all-gathers cross every node"),
    Wrong("06", "shard_hsdp", "cost", "one unit", _hsdp("""\
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh)                    # one unit: the whole model gathered at once
    return mesh
"""), HSDP, "only the root: the memory peak is the whole model"),
    Wrong("06", "shard_hsdp", "crash", "crash", _hsdp("""\
    mesh = init_device_mesh("cpu", (replicate, shard), mesh_dim_names=("replicate", "shard"))
    for block in model.layers:                       # Hugging Face's name, not the course GPT's
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
"""), HSDP, "a typo'd attribute, raised on every rank", ("AttributeError", "on rank")),

    # -- axis_bytes ------------------------------------------------------------------------------------------
    Wrong("06", "axis_bytes", "value", "whole Ψ across replicas", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad * b}
""", AXIS, "all-reduces the whole Ψ across replicas"),
    Wrong("06", "axis_bytes", "value", "all-reduce over R ranks", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    N = R * F
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (N - 1) / N * psi_pad / F * b}
""", AXIS, "the all-reduce's ring over all N ranks"),
    Wrong("06", "axis_bytes", "value", "shard axis over N", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    N = R * F
    return {"shard": 3 * (N - 1) / N * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}
""", AXIS, "the shard axis's ring over all N ranks"),
    Wrong("06", "axis_bytes", "value", "backward re-gather", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 2 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}
""", AXIS, "one all-gather + one reduce-scatter"),
    Wrong("06", "axis_bytes", "value", "half an all-reduce", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 4 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}
""", AXIS, "prices the reduce-scatter as an all-reduce"),
    Wrong("06", "axis_bytes", "value", "R and F swapped", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    F, R = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}
""", AXIS, "unpacks the arguments the other way round"),
    Wrong("06", "axis_bytes", "value", "bytes not elements", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad, "replicate": 2 * (R - 1) / R * psi_pad / F}
""", AXIS, "elements, not bytes"),
    Wrong("06", "axis_bytes", "value", "not a dict", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return 3 * (F - 1) / F * psi_pad * b, 2 * (R - 1) / R * psi_pad / F * b
""", AXIS, "a tuple, not the dict the text asks for"),
    Wrong("06", "axis_bytes", "argument", "b ignored", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * 4, "replicate": 2 * (R - 1) / R * psi_pad / F * 4}   # fp32 always
""", AXIS, "multiplies by 4 whatever b says"),
    Wrong("06", "axis_bytes", "argument", "shard of Ψ/R", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / R * b}
""", AXIS, "divides the replicated shard by R, not F"),
    Wrong("06", "axis_bytes", "boundary", "F = 1 is DDP", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    if F == 1:                                       # "nothing is sharded, so nothing moves"
        return {"shard": 0.0, "replicate": 0.0}
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad / F * b}
""", AXIS, "F = 1 read as no communication at all"),
    Wrong("06", "axis_bytes", "boundary", "R = 1 all-reduces", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    replicate_bytes = 2 * (R - 1) / R * psi_pad / F * b if R > 1 else 2 * psi_pad / F * b   # one copy still syncs
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": replicate_bytes}
""", AXIS, "a single copy still all-reduces"),
    Wrong("06", "axis_bytes", "crash", "crash", """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 3 * psi_pad * b / (F / (F - 1)), "replicate": 2 * (R - 1) / R * psi_pad / F * b}
""", AXIS, "divides by F - 1, zero at F = 1", ("ZeroDivisionError",)),

    # -- choose_f --------------------------------------------------------------------------------------------
    Wrong("06", "choose_f", "value", "plain FSDP", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    return world if 16 * psi / world <= budget else None      # always FSDP
""", CHOOSE, "always F = N"),
    Wrong("06", "choose_f", "value", "time not compared", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    def seconds(F):
        return 3 * (F - 1) / F * 4 * psi / (bw_intra if F <= per_node else bw_inter)   # the shard axis only
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits, key=lambda F: (round(seconds(F), 12), F)) if fits else None
""", CHOOSE, "leaves the replicate all-reduce out of the time"),
    Wrong("06", "choose_f", "value", "does not fit", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    return per_node                                  # "one node" as the rule, memory unchecked
""", CHOOSE, "F = a node's GPUs whatever the budget"),
    Wrong("06", "choose_f", "value", "not a divisor", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    return max(1, math.ceil(16 * psi / budget))      # the least F that fits, divisor or not
""", CHOOSE, "F from the budget alone, not a divisor of N"),
    Wrong("06", "choose_f", "value", "None expected", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    def seconds(F):
        R = world // F
        shard_bw = bw_intra if F <= per_node else bw_inter
        return 3 * (F - 1) / F * 4 * psi / shard_bw + (2 * (R - 1) / R * 4 * psi / F / bw_inter if R > 1 else 0.0)
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits or [world], key=lambda F: (round(seconds(F), 12), F))   # F = N when nothing fits
""", CHOOSE, "answers F = N when nothing fits"),
    Wrong("06", "choose_f", "feasible", "time not compared", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return fits[0] if fits else None                 # the least sharding that fits
""", CHOOSE, "the first F that fits, not the fastest"),
    Wrong("06", "choose_f", "feasible", "plain FSDP", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return fits[-1] if fits else None                # as much sharding as fits: the least memory
""", CHOOSE, "the most sharding that fits, not the fastest"),
    Wrong("06", "choose_f", "boundary", "exact fit refused", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    def seconds(F):
        R = world // F
        shard_bw = bw_intra if F <= per_node else bw_inter
        return 3 * (F - 1) / F * 4 * psi / shard_bw + (2 * (R - 1) / R * 4 * psi / F / bw_inter if R > 1 else 0.0)
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F < budget]   # < where the text says fits
    return min(fits, key=lambda F: (round(seconds(F), 12), F)) if fits else None
""", CHOOSE, "an exact fit refused"),
    Wrong("06", "choose_f", "boundary", "full node counted across", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    def seconds(F):
        R = world // F
        shard_bw = bw_intra if F < per_node else bw_inter          # a whole node counted as crossing
        return 3 * (F - 1) / F * 4 * psi / shard_bw + (2 * (R - 1) / R * 4 * psi / F / bw_inter if R > 1 else 0.0)
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits, key=lambda F: (round(seconds(F), 12), F)) if fits else None
""", CHOOSE, "F = per_node priced at the inter-node speed"),
    Wrong("06", "choose_f", "argument", "argument ignored", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    def seconds(F):
        R = world // F
        shard_bw = bw_intra if F <= 8 else bw_inter                # "a node has 8 GPUs"
        return 3 * (F - 1) / F * 4 * psi / shard_bw + (2 * (R - 1) / R * 4 * psi / F / bw_inter if R > 1 else 0.0)
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits, key=lambda F: (round(seconds(F), 12), F)) if fits else None
""", CHOOSE, "a node of 8 GPUs hard-coded", ("per_node",)),
    Wrong("06", "choose_f", "argument", "argument ignored", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    def seconds(F):
        R = world // F
        shard_bw = 300e9 if F <= per_node else bw_inter            # NVLink's speed, as in the text
        return 3 * (F - 1) / F * 4 * psi / shard_bw + (2 * (R - 1) / R * 4 * psi / F / bw_inter if R > 1 else 0.0)
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits, key=lambda F: (round(seconds(F), 12), F)) if fits else None
""", CHOOSE, "NVLink's 300 GB/s hard-coded", ("bw_intra",)),
    Wrong("06", "choose_f", "crash", "crash", """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return min(fits, key=lambda F: 3 * (F - 1) / F * 4 * psi / bw_intra + 2 * (world // F - 1) / (world // F) * 4 * psi / F / bw_inter)
""", CHOOSE, "min() of an empty list when nothing fits", ("ValueError",)),

    # -- tp_spec ---------------------------------------------------------------------------------------------
    Wrong("06", "tp_spec", "value", "cut over both axes on dim 0", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % (fsdp * tensor) == 0:
        return P(("fsdp", "tensor"), None)           # both axes on the rows
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "FSDP over F·T devices, no tensor parallelism"),
    Wrong("06", "tp_spec", "value", "axes swapped", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % tensor == 0 and shape[1] % fsdp == 0:
        return P("tensor", "fsdp")
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "rows to 'tensor', columns to 'fsdp'"),
    Wrong("06", "tp_spec", "value", "tensor axis unused", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    return fsdp_jax.fsdp_spec(shape, fsdp)           # Lab 05's rule: the tensor axis never cuts
""", SPEC, "the FSDP rule alone"),
    Wrong("06", "tp_spec", "value", "tensor axis unused", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P()                                   # "tensor parallel: every device holds the kernel"
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "big kernels replicated"),
    Wrong("06", "tp_spec", "value", "small arrays cut", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P("fsdp", "tensor")
    return fsdp_jax.fsdp_spec(shape, fsdp, min_size=0)          # biases and norms cut too
""", SPEC, "no MIN_SIZE: biases and norms cut"),
    Wrong("06", "tp_spec", "value", "uneven rows cut", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and shape[0] >= 64:
        return P("fsdp", "tensor")                   # big enough, whatever divides
    return P()
""", SPEC, "no divisibility test at all"),
    Wrong("06", "tp_spec", "argument", "uneven columns cut", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % fsdp == 0 and shape[1] % fsdp == 0:
        return P("fsdp", "tensor")                   # both dims tested against fsdp
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "tests the columns against fsdp, not tensor", ("test the columns against 'tensor'",)),
    Wrong("06", "tp_spec", "argument", "uneven rows cut", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % tensor == 0 and shape[1] % fsdp == 0:
        return P("fsdp", "tensor")                   # each dim tested against the other axis
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "rows tested against tensor, columns against fsdp"),
    Wrong("06", "tp_spec", "boundary", "MIN_SIZE excluded", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) > fsdp_jax.MIN_SIZE and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P("fsdp", "tensor")                   # > where the text says "at least"
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "'at least MIN_SIZE' read as strictly more"),
    Wrong("06", "tp_spec", "crash", "crash", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    rows, cols = shape                               # 1-D biases have one dim
    if rows * cols >= fsdp_jax.MIN_SIZE and rows % fsdp == 0 and cols % tensor == 0:
        return P("fsdp", "tensor")
    return fsdp_jax.fsdp_spec(shape, fsdp)
""", SPEC, "unpacks a 1-D shape into two", ("ValueError",)),

    # -- tp_plan ---------------------------------------------------------------------------------------------
    Wrong("06", "tp_plan", "value", "row-wise where column-wise belongs", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    plan["mlp.fc"], plan["mlp.proj"] = RowwiseParallel(), ColwiseParallel()      # the MLP's pair swapped
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "the MLP's two styles swapped"),
    Wrong("06", "tp_plan", "value", "column-wise where row-wise belongs", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    plan["attn.proj"] = ColwiseParallel()           # every Linear column-wise
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "attn.proj column-wise"),
    Wrong("06", "tp_plan", "value", "layouts that do not chain", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    plan["mlp.fc"] = ColwiseParallel(output_layouts=Replicate())   # gathers fc's output, proj expects a slice
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "fc hands on a whole activation"),
    Wrong("06", "tp_plan", "value", "layouts that do not chain", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    plan["attn.q"] = ColwiseParallel(use_local_output=False)       # a DTensor where a plain tensor is expected
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "q hands on DTensors"),
    Wrong("06", "tp_plan", "value", "missing entry", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),   # the fused name, before split_attention_
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "names the fused qkv Linear"),
    Wrong("06", "tp_plan", "value", "heads not divisible by tp", _tp_plan("""\
    if d_ff % tp or gpus_per_node % tp:              # the heads forgotten
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "accepts heads that do not divide"),
    Wrong("06", "tp_plan", "value", "d_ff not divisible by tp", _tp_plan("""\
    if n_heads % tp or gpus_per_node % tp:           # d_ff forgotten
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "accepts a d_ff that does not divide"),
    Wrong("06", "tp_plan", "value", "TP over the inter-node link", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    return (tp, nodes * gpus_per_node // tp), ("tp", "dp_shard"), plan     # 'tp' first
"""), PLAN, "'tp' as the first mesh dim"),
    Wrong("06", "tp_plan", "value", "ValueError expected", _tp_plan("""\
    assert n_heads % tp == 0 and d_ff % tp == 0 and gpus_per_node % tp == 0, "tp must divide"
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "refuses with an assert"),
    Wrong("06", "tp_plan", "argument", "mesh is not the cluster", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    return (gpus_per_node // tp, tp), ("dp_shard", "tp"), plan          # one node's mesh: nodes ignored
"""), PLAN, "the mesh of one node"),
    Wrong("06", "tp_plan", "argument", "TP over the inter-node link", _tp_plan("""\
    if n_heads % tp or d_ff % tp or (nodes * gpus_per_node) % tp:   # the world, not a node
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "divides the world's GPUs, not a node's"),
    Wrong("06", "tp_plan", "boundary", "refuses a layout that works", _tp_plan("""\
    if n_heads % tp or d_ff % tp or tp >= gpus_per_node:   # a node's GPUs exactly read as too many
        raise ValueError(f"tp({tp}) does not fit in a node")
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "tp equal to a node's GPUs refused"),
    Wrong("06", "tp_plan", "boundary", "TP over the inter-node link", _tp_plan("""\
    if n_heads % tp or d_ff % tp or tp > gpus_per_node:    # at most a node's GPUs, but not a divisor
        raise ValueError(f"tp({tp}) does not fit in a node")
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""), PLAN, "tp <= gpus_per_node instead of dividing it"),
    Wrong("06", "tp_plan", "crash", "crash", _tp_plan("""\
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
""" + RIGHT_PLAN + """\
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan.update({"mlp.fc": ColwiseParallel()}) or plan[0]
"""), PLAN, "indexes a dict by position", ("KeyError",)),
]

# -- round 3: a TP fallback that uses both mesh axes ------------------------------------------------------------
WRONG += [
    Wrong("06", "tp_spec", "argument", "fallback for F·T", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P("fsdp", "tensor")
    return fsdp_jax.fsdp_spec(shape, fsdp * tensor)  # "the mesh has F·T devices"
""", SPEC, "the fallback's FSDP rule run for F·T devices"),
    Wrong("06", "tp_spec", "argument", "fallback over both axes", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE and shape[0] % fsdp == 0 and shape[1] % tensor == 0:
        return P("fsdp", "tensor")
    spec = fsdp_jax.fsdp_spec(shape, fsdp * tensor)    # FSDP over every device of the mesh
    return P(*[("fsdp", "tensor") if a == "fsdp" else a for a in spec])
""", SPEC, "the fallback cuts over both axes together"),
]

RIGHT = [
    Right("06", "tp_spec", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    rows, cols = (shape + (None, None))[:2] if len(shape) == 2 else (None, None)
    if rows is not None and rows * cols >= fsdp_jax.MIN_SIZE and not rows % fsdp and not cols % tensor:
        return P("fsdp", "tensor")
    return fsdp_jax.fsdp_spec(tuple(shape), fsdp)   # the fallback: FSDP over 'fsdp' alone
""", SPEC, "unpacks rows and columns, tests with `not x % n`"),
]

# -- round 3: the wrong type (compared with the spec, a numpy value raised a raw ValueError in the check) --------
WRONG += [
    Wrong("06", "tp_spec", "crash", "not a PartitionSpec", IMPORTS + """
def tp_spec(shape, fsdp, tensor):
    import numpy as np
    return np.array(["fsdp", "tensor"]) if len(shape) == 2 else None   # the axis names, as an array
""", SPEC, "the axis names as a numpy array"),
    Wrong("06", "tp_plan", "crash", "not three things", IMPORTS + """
def tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node):
    return {"mesh_shape": (nodes * gpus_per_node // tp, tp), "mesh_dim_names": ("dp_shard", "tp")}   # a dict
""", PLAN, "a dict where the text asks for three things"),
]

# -- issue 49: lying values (the judge sees plain data, never the learner's object) -------------------------------
WRONG += [
    Wrong("06", "choose_f", "value", "plain FSDP", """\
class LyingF(int):                                   # an F that says it equals whatever it is compared with
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    fits = [F for F in range(1, world + 1) if world % F == 0 and 16 * psi / F <= budget]
    return LyingF(fits[-1]) if fits else None       # plain FSDP where it fits, dressed as the answer
""", CHOOSE, "a lying value: an int subclass whose == always says yes, holding the largest F that fits"),
    Wrong("06", "tp_spec", "value", "not a PartitionSpec", IMPORTS + """
class Spec:                                          # says it is a PartitionSpec, equal to any spec
    __class__ = property(lambda self: P)
    partitions = ("fsdp", "tensor")

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    def __iter__(self):
        return iter(("fsdp", "tensor"))


def tp_spec(shape, fsdp, tensor):
    return Spec()
""", SPEC, "a lying value: an object that passes isinstance(P) and equals every spec", ("returned Spec",)),
    Wrong("06", "axis_bytes", "value", "whole Ψ across replicas", """\
class Bytes(float):                                  # a number that says it equals whatever it is compared with
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = float.__hash__


def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": Bytes(3 * (F - 1) / F * psi_pad * b), "replicate": Bytes(2 * (R - 1) / R * psi_pad * b)}
""", AXIS, "a lying value: float subclasses whose == always says yes, the whole Ψ all-reduced"),
]
