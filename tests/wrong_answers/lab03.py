"""Lab 03's classic mistakes (FSDP from scratch: the flat shard, Unshard, the unit lifecycle, prefetch)."""
from wrong_answers import Wrong

#: What the lab's first cell defines (and exercise 2's check cell: the lifecycle picks the gather by it).
SETUP = """\
import torch
from course_lib.strategies.fsdp import scratch as fsdp
from course_lib.strategies.fsdp.scratch import State
N = 4
ex2_ok = False
"""

FLAT = "lab03.check_flat_shard(flat_shard)"
UNSHARD = "lab03.check_unshard_function(Unshard)"
MYFSDP = "lab03.check_fsdp_class(MyFSDP)"
PREFETCH = "lab03.check_prefetch(Prefetching)"


def unshard(forward_body: str, backward_body: str) -> str:
    """An Unshard cell with the two given bodies (indented by 8)."""
    return SETUP + f"""
class Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sharded, flat):
        import torch.distributed as dist
{forward_body}
    @staticmethod
    def backward(ctx, grad_full):
        import torch.distributed as dist
{backward_body}"""


FWD = """\
        full = torch.empty(dist.get_world_size() * sharded.numel(), dtype=sharded.dtype, device=sharded.device)
        dist.all_gather_into_tensor(full, sharded.detach())
        flat.unsharded, flat.state, ctx.flat = full, State.UNSHARDED, flat
        return full
"""
BWD = """\
        n = dist.get_world_size()
        grad = torch.empty(grad_full.numel() // n, dtype=grad_full.dtype, device=grad_full.device)
        dist.reduce_scatter_tensor(grad, grad_full.contiguous())
        ctx.flat.reshard()
        return grad / n, None
"""

MYFSDP_RIGHT = """
class MyFSDP(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        gather = Unshard if ex2_ok else fsdp.Unshard
        flat.set_views(gather.apply(flat.sharded, flat))

    def post_forward(self, flat):
        flat.reshard()

    def pre_backward(self, flat):
        flat.unshard()
"""

WRONG = [
    # -- exercise 1: flat_shard -------------------------------------------------------------------------
    Wrong("03", "flat_shard", "value", "no padding", SETUP + """
def flat_shard(tensors, rank, world):
    return torch.cat([t.reshape(-1) for t in tensors]).tensor_split(world)[rank]     # no padding
""", FLAT, "splits the unpadded buffer: the last ranks' shards are short"),
    Wrong("03", "flat_shard", "value", "padded in front", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat.new_zeros(S * world - flat.numel()), flat])    # zeros first
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "pads at the front"),
    Wrong("03", "flat_shard", "value", "rounded down", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = flat.numel() // world                                            # the remainder is lost
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "S = numel // world"),
    Wrong("03", "flat_shard", "value", "each tensor padded", SETUP + """
def flat_shard(tensors, rank, world):
    parts = []
    for t in tensors:                                                     # pads every tensor on its own
        f = t.reshape(-1)
        parts += [f, f.new_zeros(-(-f.numel() // world) * world - f.numel())]
    flat = torch.cat(parts)
    S = flat.numel() // world
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "pads each tensor, not the concatenation"),
    Wrong("03", "flat_shard", "value", "wrong offset", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    r = (rank + 1) % world                                                # the next rank's piece
    return flat[r * S:(r + 1) * S].clone()
""", FLAT, "an off-by-one rank offset"),
    Wrong("03", "flat_shard", "boundary", "pads when it divides", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = torch.cat([flat, flat.new_zeros(world - flat.numel() % world)])   # `world` zeros when it divides
    S = flat.numel() // world
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "pads world - numel % world: a whole extra row of zeros when numel divides"),
    Wrong("03", "flat_shard", "argument", "world ignored", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // N)                                             # the notebook's N, not `world`
    flat = torch.cat([flat, flat.new_zeros(S * N - flat.numel())])
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "sizes the shards for the notebook's N = 4"),
    Wrong("03", "flat_shard", "argument", "rank ignored", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[:S].clone()                                               # rank 0's piece on every rank
""", FLAT, "every rank keeps the first piece"),
    Wrong("03", "flat_shard", "argument", "dtype dropped", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat.float(), torch.zeros(S * world - flat.numel())])   # float32 whatever came in
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "float32 padding: float64 tensors come back float32"),
    Wrong("03", "flat_shard", "cost", "a view, not a copy", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S]                                  # a view: the whole buffer stays alive
""", FLAT, "returns a view that keeps the whole padded buffer alive"),
    Wrong("03", "flat_shard", "crash", "crash", SETUP + """
def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel // world)                                           # numel without ()
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "flat.numel without the call", ("TypeError", "at line")),

    # -- exercise 2: Unshard ----------------------------------------------------------------------------
    Wrong("03", "Unshard", "value", "summed, not averaged", unshard(FWD, BWD.replace("grad / n", "grad")),
          UNSHARD, "the reduce-scatter's sum, never ÷N"),
    Wrong("03", "Unshard", "value", "divided twice", unshard(FWD, BWD.replace(
        "dist.reduce_scatter_tensor(grad, grad_full.contiguous())",
        "dist.reduce_scatter_tensor(grad, grad_full.contiguous() / n)")), UNSHARD, "÷N before and after"),
    Wrong("03", "Unshard", "value", "returns the shard", unshard(FWD.replace("return full", "return sharded.clone()"),
                                                                 BWD), UNSHARD, "forward returns its input"),
    Wrong("03", "Unshard", "value", "state not set", unshard(FWD.replace(
        "flat.unsharded, flat.state, ctx.flat = full, State.UNSHARDED, flat", "flat.unsharded, ctx.flat = full, flat"),
        BWD), UNSHARD, "forward never marks the flat UNSHARDED"),
    Wrong("03", "Unshard", "cost", "all-reduce in backward", unshard(FWD, """\
        n, r = dist.get_world_size(), dist.get_rank()
        grad = grad_full.clone()
        dist.all_reduce(grad)                                             # the whole gradient, then a slice
        ctx.flat.reshard()
        return grad.chunk(n)[r] / n, None
"""), UNSHARD, "all-reduce then slice: right values, 2× the bytes"),
    Wrong("03", "Unshard", "cost", "forward not an all-gather", unshard("""\
        n, r = dist.get_world_size(), dist.get_rank()
        full = sharded.new_zeros(n * sharded.numel())
        full[r * sharded.numel():(r + 1) * sharded.numel()] = sharded.detach()
        dist.all_reduce(full)                                             # a gather made of an all-reduce
        flat.unsharded, flat.state, ctx.flat = full, State.UNSHARDED, flat
        return full
""", BWD), UNSHARD, "all-reduce of a zero-filled buffer in forward: right values, 2× the bytes"),
    Wrong("03", "Unshard", "cost", "not freed", unshard(FWD, BWD.replace("        ctx.flat.reshard()\n", "")),
          UNSHARD, "the unit stays gathered after its backward"),
    Wrong("03", "Unshard", "argument", "dtype dropped", unshard(
        FWD.replace(", dtype=sharded.dtype, device=sharded.device", ""),
        BWD.replace(", dtype=grad_full.dtype, device=grad_full.device", "")), UNSHARD, "float32 buffers"),
    Wrong("03", "Unshard", "argument", "world size hard-coded", unshard(FWD, BWD.replace("grad / n", "grad / N")),
          UNSHARD, "divides by the notebook's N = 4 whatever the world size"),
    Wrong("03", "Unshard", "argument", "world size hard-coded", unshard(
        FWD.replace("dist.get_world_size() * sharded.numel()", "N * sharded.numel()"), BWD),
          UNSHARD, "gathers into N = 4 shards whatever the world size", ("on 2 ranks",)),
    Wrong("03", "Unshard", "crash", "crash", unshard(FWD, BWD.replace("return grad / n, None", "return grad / n")),
          UNSHARD, "one gradient for two inputs", ("RuntimeError", "on rank")),

    # -- exercise 3: MyFSDP -----------------------------------------------------------------------------
    Wrong("03", "MyFSDP", "value", "no views", SETUP + MYFSDP_RIGHT.replace(
        "flat.set_views(gather.apply(flat.sharded, flat))", "gather.apply(flat.sharded, flat)"),
          MYFSDP, "gathers, but the modules never see the weights"),
    Wrong("03", "MyFSDP", "value", "bypasses autograd", SETUP + MYFSDP_RIGHT.replace(
        "flat.set_views(gather.apply(flat.sharded, flat))", "flat.unshard()\n        flat.set_views(flat.unsharded)"),
          MYFSDP, "gathers outside the autograd Function"),
    Wrong("03", "MyFSDP", "value", "no re-gather", SETUP + MYFSDP_RIGHT.replace(
        "    def pre_backward(self, flat):\n        flat.unshard()", "    def pre_backward(self, flat):\n        pass"),
          MYFSDP, "never gathers again for the backward"),
    Wrong("03", "MyFSDP", "value", "forgets the buffer", SETUP + MYFSDP_RIGHT.replace(
        "    def post_forward(self, flat):\n        flat.reshard()",
        "    def post_forward(self, flat):\n        flat.unsharded = None"), MYFSDP, "drops the buffer, not the state"),
    Wrong("03", "MyFSDP", "value", "summed, not averaged", SETUP + """
class Unshard(fsdp.Unshard):
    @staticmethod
    def backward(ctx, grad_full):
        grad, _ = fsdp.Unshard.backward(ctx, grad_full)
        return grad * torch.distributed.get_world_size(), None            # the sum: ÷N undone
""" + MYFSDP_RIGHT.replace("Unshard if ex2_ok else fsdp.Unshard", "Unshard"),
          MYFSDP, "its Unshard sums the gradients (SGD sees the scale)"),
    Wrong("03", "MyFSDP", "cost", "never freed", SETUP + MYFSDP_RIGHT.replace(
        "    def post_forward(self, flat):\n        flat.reshard()", "    def post_forward(self, flat):\n        pass"),
          MYFSDP, "never frees after forward: every unit stays gathered"),
    Wrong("03", "MyFSDP", "cost", "gathers too much", SETUP + MYFSDP_RIGHT.replace(
        "    def pre_backward(self, flat):\n        flat.unshard()",
        "    def pre_backward(self, flat):\n        for f in self.flats:\n            f.unshard()"),
          MYFSDP, "gathers every unit when the backward first needs one: same bytes, the whole model at once"),
    Wrong("03", "MyFSDP", "crash", "crash in the learner's code", SETUP + MYFSDP_RIGHT.replace(
        "flat.set_views(gather.apply(flat.sharded, flat))", "flat.set_view(gather.apply(flat.sharded, flat))"),
          MYFSDP, "a typo'd method name", ("AttributeError", "on rank", "at line")),

    # -- exercise 4: prefetch ---------------------------------------------------------------------------
    Wrong("03", "prefetch", "value", "no prefetch", SETUP + """
class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
""", PREFETCH, "the reference's pre_forward and nothing else"),
    Wrong("03", "prefetch", "value", "wrong unit", SETUP + """
class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        i = self.flats.index(flat)
        if i + 2 < len(self.flats):
            self.flats[i + 2].unshard(async_op=True)                      # skips the next one
""", PREFETCH, "two units ahead, not the next"),
    Wrong("03", "prefetch", "value", "prefetch too late", SETUP + """
class Prefetching(fsdp.FlatFSDP):
    def post_forward(self, flat):
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard(async_op=True)                                    # after this unit computed
        super().post_forward(flat)
""", PREFETCH, "starts the next gather after the unit's forward"),
    Wrong("03", "prefetch", "cost", "synchronous prefetch", SETUP + """
class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard()                                                 # waits: a synchronous "prefetch"
""", PREFETCH, "waits for the next unit's gather"),
    Wrong("03", "prefetch", "cost", "prefetches every unit", SETUP + """
class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        for nxt in self.flats[self.flats.index(flat) + 1:]:
            nxt.unshard(async_op=True)                                    # every later unit at once
""", PREFETCH, "starts every later unit's gather: the whole model gathered"),
    Wrong("03", "prefetch", "crash", "crash", SETUP + """
class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        self.next_unit(flat).unshard(async_op=True)                       # None after the last block
""", PREFETCH, "no None check after the last unit", ("AttributeError", "on rank")),
]

# -- round 3: aliasing the caller's tensor -----------------------------------------------------------------------
WRONG += [
    Wrong("03", "flat_shard", "cost", "a view, not a copy", SETUP + """
def flat_shard(tensors, rank, world):
    if len(tensors) == 1 and tensors[0].numel() % world == 0:    # "nothing to pad, nothing to copy"
        S = tensors[0].numel() // world
        return tensors[0].reshape(-1)[rank * S:(rank + 1) * S]   # a view of the caller's parameter
    flat = torch.cat([t.reshape(-1) for t in tensors])
    S = -(-flat.numel() // world)
    flat = torch.cat([flat, flat.new_zeros(S * world - flat.numel())])
    return flat[rank * S:(rank + 1) * S].clone()
""", FLAT, "a single tensor that divides is sliced in place: the shard shares memory with the model's parameter"),
]

# -- issue 49: a lying value (the judge reads the numbers, never the value's own methods) ----------------------------
WRONG += [
    Wrong("03", "flat_shard", "value", "no padding", SETUP + """
class Shard(torch.Tensor):                         # says it holds the padded size, and equals anything
    def numel(self):
        return self.claimed

    def __len__(self):
        return self.claimed

    def __eq__(self, other):
        return True


def flat_shard(tensors, rank, world):
    flat = torch.cat([t.reshape(-1) for t in tensors])
    out = flat.tensor_split(world)[rank].clone().as_subclass(Shard)   # no padding: the last shards are short
    out.claimed = -(-flat.numel() // world)                             # ... but numel() claims ceil(numel / world)
    return out
""", FLAT, "a tensor subclass whose numel() and == lie: unpadded shards that claim the padded size"),
]
