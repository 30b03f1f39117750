"""Lab 04's classic mistakes (FSDP2: fully_shard bottom-up over a mesh; an explicit prefetch plan; gradient
accumulation with one sync and the global norm clipped)."""
from wrong_answers import Right, Wrong

SETUP = """\
import torch
from course_lib.strategies.fsdp import torch as fsdp2
N = 4
"""

SHARD = "lab04.check_shard_model(shard_model)"
PLAN = "lab04.check_prefetch_plan(set_prefetch)"
ACCUM = "lab04_grads.check_accumulate_and_clip(accumulate_and_clip)"


def accum(loop: str, clip: str = "return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)") -> str:
    """An accumulate_and_clip cell: ``loop`` runs the micro-batches (k is their number), ``clip`` ends it."""
    return SETUP + f"""
def accumulate_and_clip(model, micro_batches, loss_fn, max_norm):
    k = len(micro_batches)
{loop}
    {clip}
"""


SYNC_LAST = """\
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == k - 1)
        (loss_fn(model(x), y) / k).backward()"""


def plan(forward: str, backward: str) -> str:
    """A set_prefetch cell whose block i prefetches ``forward`` and ``backward`` (expressions in i, depth, blocks)."""
    return SETUP + f"""
def set_prefetch(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch({forward})
        block.set_modules_to_backward_prefetch({backward})
"""


FWD = "blocks[i + 1:i + 1 + depth]"
BWD = "blocks[max(i - depth, 0):i][::-1]"

WRONG = [
    # -- exercise 1: shard_model ------------------------------------------------------------------------
    Wrong("04", "shard_model", "value", "root only", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)                    # the root only: one unit
""", SHARD, "one unit: the whole model gathered at once"),
    Wrong("04", "shard_model", "value", "root only", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in list(model.blocks)[:-1]:            # off by one: the last block stays in the root
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
""", SHARD, "skips the last block"),
    Wrong("04", "shard_model", "value", "no root", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)                # the embeddings and head stay plain tensors
""", SHARD, "never shards the root"),
    Wrong("04", "shard_model", "value", "root first", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)                    # top-down
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
""", SHARD, "shards the root before the blocks"),
    Wrong("04", "shard_model", "argument", "mesh ignored", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)                           # no mesh=: FSDP2's default, every rank
    fully_shard(model)
""", SHARD, "ignores the mesh it is given"),
    Wrong("04", "shard_model", "cost", "never resharded", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)   # ZeRO-2's traffic and memory
    fully_shard(model, mesh=mesh)
""", SHARD, "keeps every block gathered from forward to backward"),
    Wrong("04", "shard_model", "cost", "root resharded", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)        # the root freed, gathered again at once
""", SHARD, "reshards the root too: one all-gather more per step"),
    Wrong("04", "shard_model", "cost", "units too small", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        for m in block.modules():                    # every Linear its own unit
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
""", SHARD, "units inside the blocks: many small collectives"),
    Wrong("04", "shard_model", "cost", "a knob changed", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)              # halves what is gathered: not asked
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
""", SHARD, "a bf16 policy nobody asked for"),
    Wrong("04", "shard_model", "crash", "crash", SETUP + """
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for block in model.block:                        # a typo: the attribute is `blocks`
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
""", SHARD, "a typo'd attribute", ("AttributeError", "on rank")),

    # -- exercise 2: set_prefetch -----------------------------------------------------------------------
    Wrong("04", "set_prefetch", "value", "backward in forward order", plan(FWD, FWD), PLAN,
          "backward prefetches the blocks after i"),
    Wrong("04", "set_prefetch", "value", "prefetches itself", plan("blocks[i:i + depth]", BWD), PLAN,
          "forward starts at block i"),
    Wrong("04", "set_prefetch", "value", "far first", plan(FWD, "blocks[max(i - depth, 0):i]"), PLAN,
          "backward list not reversed: farthest first"),
    Wrong("04", "set_prefetch", "argument", "depth ignored", plan("blocks[i + 1:i + 3]", "blocks[max(i - 2, 0):i][::-1]"),
          PLAN, "two ahead, whatever depth says"),
    Wrong("04", "set_prefetch", "argument", "depth ignored", plan("blocks[i + 1:i + 2]", "blocks[max(i - 1, 0):i]"), PLAN,
          "one ahead, whatever depth says"),
    Wrong("04", "set_prefetch", "argument", "every block", plan("blocks[i + 1:]", "blocks[:i][::-1]"), PLAN,
          "every later block: depth ignored, everything gathered"),
    Wrong("04", "set_prefetch", "boundary", "wraps around",
          plan("[blocks[(i + k) % len(blocks)] for k in range(1, depth + 1) if (i + k) % len(blocks) != i]", BWD),
          PLAN, "the forward list wraps past the last block to block 0"),
    Wrong("04", "set_prefetch", "boundary", "negative start", plan(FWD, "blocks[i - depth:i][::-1]"), PLAN,
          "no max(.., 0): a negative start wraps and the slice is empty"),
    Wrong("04", "set_prefetch", "boundary", "last block left out",
          plan("blocks[i + 1:min(i + 1 + depth, len(blocks) - 1)]", BWD), PLAN,
          "clips the end at L - 1: the last block is never prefetched"),
    Wrong("04", "set_prefetch", "crash", "crash", SETUP + """
def set_prefetch(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch([blocks[i + k] for k in range(1, depth + 1)])   # past the end
        block.set_modules_to_backward_prefetch(blocks[max(i - depth, 0):i][::-1])
""", PLAN, "indexes past the last block", ("IndexError", "on rank")),

    # -- exercise 3: accumulate_and_clip ---------------------------------------------------------------
    Wrong("04", "accumulate_and_clip", "value", "per-shard clipping", accum(SYNC_LAST, """\
shards = [p.grad.to_local() for p in model.parameters()]        # this rank's rows only
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in shards]))
    for g in shards:
        g.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm"""), ACCUM, "clips each rank's shard by the norm of that shard"),
    Wrong("04", "accumulate_and_clip", "value", "missing sync", accum("""\
    model.set_requires_gradient_sync(False)                        # ... and never True again
    for x, y in micro_batches:
        (loss_fn(model(x), y) / k).backward()"""), ACCUM, "turns gradient sync off and never back on"),
    Wrong("04", "accumulate_and_clip", "cost", "sync every micro-batch", accum("""\
    import contextlib
    for x, y in micro_batches:                                     # FSDP2 has no no_sync(): this one does nothing
        with getattr(model, "no_sync", contextlib.nullcontext)():
            (loss_fn(model(x), y) / k).backward()"""), ACCUM, "FSDP1's no_sync, which FSDP2 lacks: syncs every time"),
    Wrong("04", "accumulate_and_clip", "cost", "sync every micro-batch", accum("""\
    for x, y in micro_batches:
        model.set_requires_gradient_sync(True)                     # the default, every time
        (loss_fn(model(x), y) / k).backward()"""), ACCUM, "gradient sync left on for every micro-batch"),
    Wrong("04", "accumulate_and_clip", "value", "not divided by k", accum("""\
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == k - 1)
        loss_fn(model(x), y).backward()                            # the sum, not the mean"""), ACCUM,
          "sums the micro-batches' gradients: clipping hides it in the gradients, not in the norm"),
    Wrong("04", "accumulate_and_clip", "value", "not clipped", accum(SYNC_LAST, """\
shards = [p.grad.to_local() for p in model.parameters()]
    return torch.nn.utils.clip_grad_norm_(shards, max_norm)        # tensors, not parameters: no .grad to clip"""),
          ACCUM, "hands clip_grad_norm_ the gradients themselves, which have no .grad: nothing is clipped"),
    Wrong("04", "accumulate_and_clip", "value", "clipped too early", accum("""\
    for i, (x, y) in enumerate(micro_batches):
        (loss_fn(model(x), y) / k).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # inside the loop""", "return norm"),
          ACCUM, "clips the running sum after every micro-batch"),
    Wrong("04", "accumulate_and_clip", "value", "wrong norm", SETUP + """
class Norm(float):                                   # "equal" to whatever it is compared with
    def __eq__(self, other):
        return True


def accumulate_and_clip(model, micro_batches, loss_fn, max_norm):
    k = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        model.set_requires_gradient_sync(i == k - 1)
        (loss_fn(model(x), y) / k).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return Norm(max_norm)                            # the norm after clipping, dressed to equal anything
""", ACCUM, "a lying value: a float subclass whose == always says yes, holding the clipped norm"),
    Wrong("04", "accumulate_and_clip", "value", "not a norm", accum(SYNC_LAST, """\
torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return model                                                   # not the norm"""), ACCUM,
          "returns the model instead of the norm"),
    Wrong("04", "accumulate_and_clip", "crash", "crash", accum("""\
    for x, y in micro_batches:
        with model.no_sync():                                      # FSDP1's spelling: FSDP2 has none
            (loss_fn(model(x), y) / k).backward()"""), ACCUM, "FSDP1's no_sync() on an FSDP2 module",
          ("AttributeError", "on rank")),
]

RIGHT = [
    Right("04", "accumulate_and_clip", SETUP + """
def accumulate_and_clip(model, micro_batches, loss_fn, max_norm):
    *first, last = micro_batches
    model.set_requires_gradient_sync(False)
    for x, y in first:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
    model.set_requires_gradient_sync(True)
    (loss_fn(model(last[0]), last[1]) / len(micro_batches)).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return norm.full_tensor().item()                 # a float, not a DTensor
""", ACCUM, "sync toggled around the loop; get_total_norm + clip_grads_with_norm_; a float returned"),
]
