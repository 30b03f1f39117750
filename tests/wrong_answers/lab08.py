"""Lab 08's classic mistakes (performance): a step time from the model, the compute-bound batch, a 70B plan under
a memory budget, and the price of full activation checkpointing."""
from wrong_answers import Right, Wrong

IMPORTS = """\
from course_lib.maths import planner, step_model
"""


def _step(body: str) -> str:
    return IMPORTS + """
def step_seconds(strategy, cost, flops, compute, comm, gamma):
""" + body


def _batch(test: str, stop: str = "4097", after: str = "    return None\n") -> str:
    return IMPORTS + f"""
def compute_bound_batch(model, cluster, strategy, seq_len, checkpointing):
    for b in range(1, {stop}):
        p = planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing)
        if {test}:
            return b
""" + after


def _plan(body: str) -> str:
    return IMPORTS + """
def plan_70b(cluster, budget):
""" + body


def _cost(body: str) -> str:
    return IMPORTS + """
def full_ac_cost(model, cluster, batch, seq_len):
    def tps(ac, what="tokens_per_s_per_gpu", **kw):
        args = dict(model=model, cluster=cluster, batch=batch, seq_len=seq_len, **kw)
        return getattr(planner.plan(args["model"], args["cluster"], "fsdp", args["batch"], seq_len=args["seq_len"],
                                    checkpointing=ac), what)
""" + body


STEP = "lab08.check_step_seconds(step_seconds)"
BATCH = "lab08.check_compute_bound_batch(compute_bound_batch)"
PLAN = "lab08.check_plan_70b(lambda: plan_70b(lab08.EX3_CLUSTER, lab08.EX3_BUDGET))"
COST = "lab08.check_full_ac_cost(full_ac_cost)"
FW = "    calls = sum(o.count for o in cost.ops if o.op in ('all_gather', 'reduce_scatter'))\n"
AB = "    ab = lambda o: comm.alpha_beta(o.op, o.group_size)\n"

WRONG = [
    # -- step_seconds ----------------------------------------------------------------------------------------
    Wrong("08", "step_seconds", "value", "α left out", _step(FW + AB + """\
    return compute.seconds(flops) + gamma * calls + sum(ab(o).beta_s_per_byte * o.wire_bytes for o in cost.ops)
"""), STEP, "bandwidth only, no latency"),
    Wrong("08", "step_seconds", "value", "α once per op", _step(FW + AB + """\
    return compute.seconds(flops) + gamma * calls + sum(ab(o).alpha_s + ab(o).beta_s_per_byte * o.wire_bytes
                                                        for o in cost.ops)
"""), STEP, "α once per op kind, not per call"),
    Wrong("08", "step_seconds", "value", "compute left out", _step(FW + """\
    return gamma * calls + sum(comm.seconds(o) for o in cost.ops)
"""), STEP, "communication only"),
    Wrong("08", "step_seconds", "value", "γ left out", _step("""\
    return compute.seconds(flops) + sum(comm.seconds(o) for o in cost.ops)
"""), STEP, "FSDP2's framework term forgotten"),
    Wrong("08", "step_seconds", "value", "milliseconds", _step(FW + """\
    return 1e3 * (compute.seconds(flops) + gamma * calls + sum(comm.seconds(o) for o in cost.ops))
"""), STEP, "milliseconds"),
    Wrong("08", "step_seconds", "value", "not a float", _step(FW + """\
    return {"compute": compute.seconds(flops), "framework": gamma * calls,
            "comm": sum(comm.seconds(o) for o in cost.ops)}          # the terms, never added up
"""), STEP, "a dict of terms"),
    Wrong("08", "step_seconds", "cost", "payload bytes", _step(FW + AB + """\
    return compute.seconds(flops) + gamma * calls + sum(o.count * ab(o).alpha_s + ab(o).beta_s_per_byte * o.payload_bytes
                                                        for o in cost.ops)
"""), STEP, "β times the payload, not the wire bytes"),
    Wrong("08", "step_seconds", "cost", "one fit for every op", _step(FW + """\
    ar = lambda o: comm.alpha_beta("all_reduce", o.group_size)       # one fit for all
    return compute.seconds(flops) + gamma * calls + sum(o.count * ar(o).alpha_s + ar(o).beta_s_per_byte * o.wire_bytes
                                                        for o in cost.ops)
"""), STEP, "the all-reduce fit for every op"),
    Wrong("08", "step_seconds", "cost", "γ on all-reduces", _step("""\
    calls = sum(o.count for o in cost.ops)                            # all-reduces too
    return compute.seconds(flops) + gamma * calls + sum(comm.seconds(o) for o in cost.ops)
"""), STEP, "γ charged on every collective"),
    Wrong("08", "step_seconds", "argument", "argument ignored", _step(FW + """\
    return compute.seconds(flops) + 3e-3 * calls + sum(comm.seconds(o) for o in cost.ops)   # the lab's γ
"""), STEP, "γ hard-coded from the calibration", ("`gamma`",)),
    Wrong("08", "step_seconds", "argument", "strategy branch", _step(FW + """\
    framework = gamma * calls if strategy == "fsdp" else 0.0          # "γ is FSDP's"
    return compute.seconds(flops) + framework + sum(comm.seconds(o) for o in cost.ops)
"""), STEP, "γ for FSDP only, not HSDP"),
    Wrong("08", "step_seconds", "crash", "crash", _step(FW + """\
    return compute.seconds(flops) + gamma * calls + sum(comm.alpha_beta(o.op).seconds(o) for o in cost.ops)
"""), STEP, "alpha_beta without the group size", ("TypeError",)),

    # -- compute_bound_batch -------------------------------------------------------------------------------------
    Wrong("08", "compute_bound_batch", "value", "tokens", _batch("p.compute_bound", after="    return None\n").replace(
        "            return b\n", "            return b * seq_len                # tokens\n"), BATCH, "tokens, not sequences"),
    Wrong("08", "compute_bound_batch", "value", "global batch", _batch("p.compute_bound").replace(
        "            return b\n", "            return b * cluster.world          # the global batch\n"), BATCH,
          "the global batch"),
    Wrong("08", "compute_bound_batch", "value", "too small", _batch("p.compute_s >= p.exposed_comm_s"), BATCH,
          "compares with the exposed communication"),
    Wrong("08", "compute_bound_batch", "value", "fraction", IMPORTS + """
def compute_bound_batch(model, cluster, strategy, seq_len, checkpointing):
    p = planner.plan(model, cluster, strategy, 1, seq_len=seq_len, checkpointing=checkpointing)
    return p.comm_s / p.compute_s                    # the crossing point, as if compute were proportional to b
""", BATCH, "a fraction of a sequence"),
    Wrong("08", "compute_bound_batch", "feasible", "not the smallest", IMPORTS + """
def compute_bound_batch(model, cluster, strategy, seq_len, checkpointing):
    b = 1
    while b <= 4096:                                 # doubling: fast, and compute-bound, but not the smallest
        if planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing).compute_bound:
            return b
        b *= 2
    return None
""", BATCH, "doubles the batch: a compute-bound batch, not the smallest"),
    Wrong("08", "compute_bound_batch", "boundary", "off by one", _batch("p.compute_bound").replace(
        "            return b\n", "            return b - 1                      # the last one that was not\n"),
          BATCH, "the batch before the crossing"),
    Wrong("08", "compute_bound_batch", "boundary", "tie not covered", _batch("p.compute_s > p.comm_s"), BATCH,
          "> where the text says >="),
    Wrong("08", "compute_bound_batch", "boundary", "limit excluded", _batch("p.compute_bound", stop="4096"), BATCH,
          "range(1, 4096) stops at 4095"),
    Wrong("08", "compute_bound_batch", "crash", "crash", _batch("p.compute_bound").replace(
        "checkpointing=checkpointing)", "checkpoint=checkpointing)"), BATCH, "a keyword the planner does not take",
          ("TypeError",)),

    # -- plan_70b ----------------------------------------------------------------------------------------------
    Wrong("08", "plan_70b", "value", "does not fit", _plan("""\
    p = planner.plan(planner.LLAMA3_70B, cluster, "dp", 1, seq_len=4096, checkpointing="full")
    return {"strategy": "dp", "batch": 1, "checkpointing": "full", "replicate": 1, "memory_bytes": p.total}
"""), PLAN, "DP: 16Ψ per GPU"),
    Wrong("08", "plan_70b", "value", "does not fit", _plan("""\
    p = planner.plan(planner.LLAMA3_70B, cluster, "hsdp", 2, seq_len=4096, checkpointing="full", replicate=4)
    return {"strategy": "hsdp", "batch": 2, "checkpointing": "full", "replicate": 4, "memory_bytes": p.total}
"""), PLAN, "HSDP within a node: 16Ψ/8 does not fit"),
    Wrong("08", "plan_70b", "value", "does not fit", _plan("""\
    p = planner.plan(planner.LLAMA3_70B, cluster, "fsdp", 2, seq_len=4096, checkpointing="none")
    return {"strategy": "fsdp", "batch": 2, "checkpointing": "none", "replicate": 1, "memory_bytes": p.total}
"""), PLAN, "no checkpointing"),
    Wrong("08", "plan_70b", "value", "estimate ignores activations", _plan("""\
    return {"strategy": "fsdp", "batch": 2, "checkpointing": "full", "replicate": 1,
            "memory_bytes": 16 * planner.LLAMA3_70B.params / cluster.world}      # model state alone
"""), PLAN, "the estimate without activations"),
    Wrong("08", "plan_70b", "value", "estimate off", _plan("""\
    return {"strategy": "fsdp", "batch": 2, "checkpointing": "full", "replicate": 1,
            "memory_bytes": 4 * planner.LLAMA3_70B.params / cluster.world}       # "~4 GB per device": fp32 weights
"""), PLAN, "fp32 weights only"),
    Wrong("08", "plan_70b", "value", "planner refuses", _plan("""\
    return {"strategy": "fsdp", "batch": 0, "checkpointing": "full", "replicate": 1, "memory_bytes": 1e10}
"""), PLAN, "batch 0"),
    Wrong("08", "plan_70b", "value", "not a dict", _plan("""\
    return {"strategy": "fsdp", "batch": 2}
"""), PLAN, "keys missing"),
    Wrong("08", "plan_70b", "feasible", "not the largest batch", _plan("""\
    for b in range(1, 65):
        p = planner.plan(planner.LLAMA3_70B, cluster, "fsdp", b, seq_len=4096, checkpointing="full")
        if p.total <= budget:                        # the first batch that fits
            return {"strategy": "fsdp", "batch": b, "checkpointing": "full", "replicate": 1, "memory_bytes": p.total}
"""), PLAN, "the first batch that fits, not the largest"),
    Wrong("08", "plan_70b", "feasible", "not the largest batch", _plan("""\
    p = planner.plan(planner.LLAMA3_70B, cluster, "fsdp", 1, seq_len=4096, checkpointing="full")
    return {"strategy": "fsdp", "batch": 1, "checkpointing": "full", "replicate": 1, "memory_bytes": p.total}
"""), PLAN, "batch 1: it fits, so it must be fine", ("batch 2 fits too",)),
    Wrong("08", "plan_70b", "boundary", "not the largest batch", _plan("""\
    best = None
    for b in range(1, 65):
        p = planner.plan(planner.LLAMA3_70B, cluster, "fsdp", b, seq_len=4096, checkpointing="full")
        if p.total > 70e9:                           # 70 GB, where the budget is 70 GiB
            break
        best = {"strategy": "fsdp", "batch": b, "checkpointing": "full", "replicate": 1, "memory_bytes": p.total}
    return best
"""), PLAN, "the budget read as 70 × 10⁹ bytes", ("2³⁰",)),
    Wrong("08", "plan_70b", "crash", "crash", _plan("""\
    p = planner.plan(planner.LLAMA3_70B, cluster, "fsdp", 2, seq_len=4096, checkpointing="full")
    return {"strategy": "fsdp", "batch": 2, "checkpointing": "full", "replicate": 1, "memory_bytes": p.total_bytes}
"""), PLAN, "a Plan attribute that does not exist", ("AttributeError",)),

    # -- full_ac_cost ------------------------------------------------------------------------------------------
    Wrong("08", "full_ac_cost", "value", "the fraction kept", _cost("""\
    return tps("full") / tps("selective")
"""), COST, "the fraction kept"),
    Wrong("08", "full_ac_cost", "value", "a percentage", _cost("""\
    return 100 * (1 - tps("full") / tps("selective"))
"""), COST, "a percentage"),
    Wrong("08", "full_ac_cost", "value", "sign flipped", _cost("""\
    return tps("full") / tps("selective") - 1
"""), COST, "the sign flipped"),
    Wrong("08", "full_ac_cost", "value", "compared with no checkpointing", _cost("""\
    return 1 - tps("full") / tps("none")
"""), COST, "from no checkpointing"),
    Wrong("08", "full_ac_cost", "value", "compared HFU", _cost("""\
    return 1 - tps("full", "hfu") / tps("selective", "hfu")
"""), COST, "HFU, which counts the recompute as useful"),
    Wrong("08", "full_ac_cost", "value", "compared step times", _cost("""\
    return tps("full", "step_s") / tps("selective", "step_s") - 1
"""), COST, "step times"),
    Wrong("08", "full_ac_cost", "value", "not a float", _cost("""\
    return f"{1 - tps('full') / tps('selective'):.0%}"
"""), COST, "a formatted string"),
    Wrong("08", "full_ac_cost", "argument", "argument ignored", IMPORTS + """
def full_ac_cost(model, cluster, batch, seq_len):
    tps = {ac: planner.plan(model, cluster, "fsdp", batch, seq_len=8192, checkpointing=ac).tokens_per_s_per_gpu
           for ac in ("selective", "full")}           # torchtitan's 8192, whatever seq_len says
    return 1 - tps["full"] / tps["selective"]
""", COST, "seq_len hard-coded", ("`seq_len`",)),
    Wrong("08", "full_ac_cost", "argument", "argument ignored", IMPORTS + """
def full_ac_cost(model, cluster, batch, seq_len):
    tps = {ac: planner.plan(model, cluster, "fsdp", 1, seq_len=seq_len, checkpointing=ac).tokens_per_s_per_gpu
           for ac in ("selective", "full")}           # one sequence per GPU, whatever batch says
    return 1 - tps["full"] / tps["selective"]
""", COST, "batch hard-coded", ("`batch`",)),
    Wrong("08", "full_ac_cost", "crash", "crash", IMPORTS + """
def full_ac_cost(model, cluster, batch, seq_len):
    tps = {ac: planner.plan(model, cluster, "fsdp", batch, seq_len=seq_len, checkpointing=ac).tokens_per_s
           for ac in ("selective", "full")}
    return 1 - tps["full"] / tps["selective"]
""", COST, "tokens_per_s is not a Plan attribute", ("AttributeError",)),
]

# -- round 3: an argument read as a constant (every case but the probes is FSDP with full checkpointing) ---------
WRONG += [
    Wrong("08", "compute_bound_batch", "argument", "strategy ignored",
          _batch("p.compute_bound").replace("planner.plan(model, cluster, strategy,", 'planner.plan(model, cluster, "fsdp",'),
          BATCH, "hard-codes the course's strategy, FSDP"),
    Wrong("08", "compute_bound_batch", "argument", "checkpointing ignored",
          _batch("p.compute_bound").replace(", checkpointing=checkpointing)", ")"), BATCH,
          "leaves checkpointing at planner.plan's default ('none')"),
    Wrong("08", "compute_bound_batch", "argument", "checkpointing ignored",
          _batch("p.compute_bound").replace("checkpointing=checkpointing", 'checkpointing="full"'), BATCH,
          "hard-codes full checkpointing, as in most cases"),
    Wrong("08", "compute_bound_batch", "argument", "seq_len ignored",
          _batch("p.compute_bound").replace("seq_len=seq_len, ", ""), BATCH, "the model's own sequence length"),
]

RIGHT = [
    Right("08", "compute_bound_batch", IMPORTS + """
def compute_bound_batch(model, cluster, strategy, seq_len, checkpointing):
    ok = lambda b: planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing).compute_bound
    if not ok(4096):
        return None
    lo, hi = 1, 4096                                 # bisection: compute grows with b, traffic does not
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid + 1, hi)
    return lo
""", BATCH, "bisection instead of a linear search"),
]

WRONG += [
    Wrong("08", "compute_bound_batch", "crash", "not a number", IMPORTS + """
def compute_bound_batch(model, cluster, strategy, seq_len, checkpointing):
    import torch
    for b in range(1, 4097):
        if planner.plan(model, cluster, strategy, b, seq_len=seq_len, checkpointing=checkpointing).compute_bound:
            return torch.tensor(b)                   # a tensor where a batch size is asked
    return None
""", BATCH, "a tensor holding the batch"),
]

# -- lying values (issue 49): a number whose == always says yes is judged by the number it holds ------------------
_LYING_FLOAT = """
class Seconds(float):
    def __eq__(self, other):
        return True
    __hash__ = float.__hash__
"""
_LYING_INT = """
class Batch(int):
    def __eq__(self, other):
        return True
    __ne__ = lambda self, other: False
    __hash__ = int.__hash__
"""
WRONG += [
    Wrong("08", "step_seconds", "value", "milliseconds", _step(FW + """\
    return Seconds(1e3 * (compute.seconds(flops) + gamma * calls + sum(comm.seconds(o) for o in cost.ops)))
""") + _LYING_FLOAT, STEP, "milliseconds, in a float whose == always says yes"),
    Wrong("08", "compute_bound_batch", "boundary", "off by one", _batch("p.compute_bound").replace(
        "            return b\n", "            return Batch(b - 1)               # == says yes to anything\n") + _LYING_INT,
          BATCH, "the batch before the crossing, in an int whose == always says yes"),
]
