"""Lab 00's classic mistakes (all-reduce from its halves, in torch and JAX; the ring's cost)."""
from wrong_answers import Right, Wrong

_N = "N = 4\n"
_MESH = 'import jax\nmesh = jax.make_mesh((8,), ("x",))\n'
_AR = "lab00.check_all_reduce(my_all_reduce, world_size=N)"
_JAR = "lab00.check_jax_all_reduce(jax_all_reduce, mesh)"
_RING = "lab00.check_ring_bytes(ring_bytes)"

WRONG = [
    # -- my_all_reduce ---------------------------------------------------------------------------------
    Wrong("00", "my_all_reduce", "value", "averaged twice", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    if mean:
        shard /= n
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out / n if mean else out                  # divided the shard already
""", _AR, "divides by N on the shard and again on the output", ("mean=True",)),
    Wrong("00", "my_all_reduce", "value", "shard not gathered", _N + """\
def my_all_reduce(x, mean=False):
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    return shard / n if mean else shard              # one rank's chunk of the sum, never gathered
""", _AR, "returns the reduce-scatter's shard"),
    Wrong("00", "my_all_reduce", "value", "input gathered", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n, r = dist.get_world_size(), dist.get_rank()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x.chunk(n)[r].contiguous())   # the input's chunk, not the sum's
    return out / n if mean else out
""", _AR, "all-gathers its own input chunk instead of the reduced shard"),
    Wrong("00", "my_all_reduce", "value", "shifted shards", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    out = torch.roll(out, out.numel() // n)          # shard r written where shard r+1 belongs
    return out / n if mean else out
""", _AR, "the gathered shards land one place off"),
    Wrong("00", "my_all_reduce", "argument", "mean ignored", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out                                       # mean=True never looked at
""", _AR, "ignores mean=True"),
    Wrong("00", "my_all_reduce", "cost", "all_reduce called", _N + """\
def my_all_reduce(x, mean=False):
    import torch.distributed as dist
    dist.all_reduce(x)                               # the real thing: right values, not the exercise
    return x / dist.get_world_size() if mean else x
""", _AR, "calls dist.all_reduce"),
    Wrong("00", "my_all_reduce", "cost", "all_reduce called", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    if mean:                                         # the mean "the easy way"
        dist.all_reduce(x)
        return x / n
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out
""", _AR, "builds the sum from halves but the mean from dist.all_reduce", ("mean=True",)),
    Wrong("00", "my_all_reduce", "cost", "whole tensors gathered", _N + """\
def my_all_reduce(x, mean=False):
    import torch.distributed as dist
    n = dist.get_world_size()
    every = x.new_empty(n * x.numel())
    dist.all_gather_into_tensor(every, x)            # every rank's whole x, then sum locally
    out = every.view(n, -1).sum(0)
    return out / n if mean else out
""", _AR, "all-gathers every rank's whole tensor and sums locally: right values, N/2 x the bytes"),
    Wrong("00", "my_all_reduce", "crash", "crash", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter(shard, x)                    # the list version: wants a list of tensors
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out / n if mean else out
""", _AR, "calls the list-taking reduce_scatter with a tensor", ("on rank",)),

    # -- jax_all_reduce ----------------------------------------------------------------------------------
    Wrong("00", "jax_all_reduce", "value", "stacked gather", _MESH + """\
def jax_all_reduce(block):
    shard = jax.lax.psum_scatter(block, "x", tiled=True)
    return jax.lax.all_gather(shard, "x")            # stacks: (8, len/8), not (len,)
""", _JAR, "all_gather without tiled=True"),
    Wrong("00", "jax_all_reduce", "value", "shard not gathered", _MESH + """\
def jax_all_reduce(block):
    return jax.lax.psum_scatter(block, "x", tiled=True)   # this device's chunk of the sum only
""", _JAR, "returns the reduce-scatter's chunk"),
    Wrong("00", "jax_all_reduce", "value", "averaged", _MESH + """\
def jax_all_reduce(block):
    shard = jax.lax.psum_scatter(block, "x", tiled=True)
    return jax.lax.all_gather(shard, "x", tiled=True) / 8   # a mean where the sum is asked
""", _JAR, "divides by the device count"),
    Wrong("00", "jax_all_reduce", "cost", "psum", _MESH + """\
def jax_all_reduce(block):
    return jax.lax.psum(block, "x")                  # right values: the one-piece all-reduce
""", _JAR, "psum instead of the two halves"),
    Wrong("00", "jax_all_reduce", "cost", "whole blocks gathered", _MESH + """\
def jax_all_reduce(block):
    every = jax.lax.all_gather(block, "x")           # (8, len): every device's whole block
    return every.sum(axis=0)
""", _JAR, "gathers every device's whole block and sums locally"),
    Wrong("00", "jax_all_reduce", "crash", "crash", _MESH + """\
def jax_all_reduce(block):
    shard = jax.lax.psum_scatter(block, "i", tiled=True)   # an axis name the mesh does not have
    return jax.lax.all_gather(shard, "i", tiled=True)
""", _JAR, "names a mesh axis that does not exist"),

    # -- ring_bytes -------------------------------------------------------------------------------------
    Wrong("00", "ring_bytes", "value", "broadcast as the root's bytes", """\
def ring_bytes(op, V, N):
    if N == 1:
        return 0.0
    if op == "broadcast":
        return float(V)                              # the root's bytes, not the per-rank average
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V
""", _RING, "a broadcast priced at the root's V"),
    Wrong("00", "ring_bytes", "value", "broadcast total", """\
def ring_bytes(op, V, N):
    if op == "broadcast":
        return (N - 1) * V                           # all ranks together, not per rank
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V
""", _RING, "a broadcast priced at the ring's total"),
    Wrong("00", "ring_bytes", "value", "whole V per step", """\
def ring_bytes(op, V, N):
    return (2 if op == "all_reduce" else 1) * (N - 1) * V    # each step sends V, not V/N
""", _RING, "each ring step sends the whole V"),
    Wrong("00", "ring_bytes", "value", "one step", """\
def ring_bytes(op, V, N):
    return (2 if op == "all_reduce" else 1) * V / N           # one ring step only
""", _RING, "counts one ring step"),
    Wrong("00", "ring_bytes", "value", "not a number", """\
def ring_bytes(op, V, N):
    phases = 2 if op == "all_reduce" else 1
    bytes_sent = phases * (N - 1) / N * V                     # computed, never returned
""", _RING, "forgets to return"),
    Wrong("00", "ring_bytes", "boundary", "N = 1", """\
def ring_bytes(op, V, N):
    if N == 1:
        return V                                     # "one rank sends its whole tensor"
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V
""", _RING, "N = 1 priced at V, not 0"),
    Wrong("00", "ring_bytes", "argument", "op ignored", """\
def ring_bytes(op, V, N):
    return (N - 1) / N * V                           # the same for every op: all-reduce has two phases
""", _RING, "one formula for all four ops"),
    Wrong("00", "ring_bytes", "argument", "op ignored", """\
def ring_bytes(op, V, N):
    return 2 * (N - 1) / N * V                       # all-reduce's cost for every op
""", _RING, "all-reduce's formula for every op"),
    Wrong("00", "ring_bytes", "argument", "N ignored", """\
def ring_bytes(op, V, N):
    return 2 * V if op == "all_reduce" else V        # the large-N limit: N never used
""", _RING, "the large-N limit, whatever N"),
    Wrong("00", "ring_bytes", "argument", "V ignored", """\
def ring_bytes(op, V, N):
    return (2 if op == "all_reduce" else 1) * (N - 1) / N    # the fraction of V, never times V
""", _RING, "returns the fraction of V"),
    Wrong("00", "ring_bytes", "crash", "crash", """\
def ring_bytes(op, V, N):
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V / (N - 1) * (N - 1) if N > 1 else V / (N - 1)
""", _RING, "divides by N - 1 when N = 1", ("ZeroDivisionError",)),
]

# -- round 3: psum_scatter without tiled=True (JAX raises a ValueError that names sizes, not the flag) -----------
WRONG += [
    Wrong("00", "jax_all_reduce", "crash", "untiled scatter", _MESH + """\
def jax_all_reduce(block):
    shard = jax.lax.psum_scatter(block, "x")          # untiled: wants the block's length to be the device count
    return jax.lax.all_gather(shard, "x", tiled=True)
""", _JAR, "psum_scatter without tiled=True"),
]

# -- round 3: right values in the caller's own tensor (the text asks for a NEW tensor) ---------------------------
WRONG += [
    Wrong("00", "my_all_reduce", "cost", "input returned", _N + """\
def my_all_reduce(x, mean=False):
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    if mean:
        shard /= n
    dist.all_gather_into_tensor(x, shard)            # "in place, like dist.all_reduce"
    return x
""", _AR, "gathers into x and returns it: the result aliases the caller's tensor", ("on rank",)),
    Wrong("00", "my_all_reduce", "cost", "input overwritten", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    if mean:
        x /= n                                       # the mean: divide first (the caller's x with it)
    shard = x.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out
""", _AR, "divides the input in place before reducing: right values, the caller's x changed", ("mean=True",)),
]

RIGHT = [
    Right("00", "my_all_reduce", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = torch.empty(x.numel() // n, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(shard, x)
    out = x.new_empty(x.shape)
    dist.all_gather_into_tensor(out, shard)
    return out.div_(n) if mean else out              # in place on its own new tensor: not the input
""", _AR, "divides the gathered output in place (the result aliases only itself)"),
    Right("00", "jax_all_reduce", _MESH + """\
def jax_all_reduce(block):
    n = jax.lax.axis_size("x")
    shard = jax.lax.psum_scatter(block.reshape(n, -1), "x")          # untiled: dim 0 IS the device axis
    return jax.lax.all_gather(shard, "x").reshape(block.shape)       # untiled, then flattened back
""", _JAR, "untiled collectives with the reshapes that make their shapes line up"),
]

WRONG += [
    Wrong("00", "ring_bytes", "value", "not a number", """\
def ring_bytes(op, V, N):
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V / (N - 1) * (N - 1) if N > 1 else float("nan")
""", _RING, "nan for one rank (0/0 written out)"),
]

WRONG += [
    Wrong("00", "jax_all_reduce", "value", "dtype changed", _MESH + """\
def jax_all_reduce(block):
    shard = jax.lax.psum_scatter(block.astype(jax.numpy.bfloat16), "x", tiled=True)   # half the bytes on the wire
    return jax.lax.all_gather(shard, "x", tiled=True)
""", _JAR, "reduces in bfloat16"),
    Wrong("00", "my_all_reduce", "value", "dtype changed", _N + """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    x16 = x.to(torch.bfloat16)                       # half the bytes on the wire
    shard = x16.new_empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x16)
    out = torch.empty_like(x16)
    dist.all_gather_into_tensor(out, shard)
    return out / n if mean else out
""", _AR, "communicates and returns bfloat16"),
]

# -- issue 49: a value that lies about itself (its == says yes to anything); the judge reads the number it holds ----
WRONG += [
    Wrong("00", "ring_bytes", "value", "whole V per step", """\
class Bytes(float):
    def __eq__(self, other):                         # "equal" to whatever it is compared with
        return True

    def __ne__(self, other):
        return False

    __hash__ = float.__hash__


def ring_bytes(op, V, N):
    return Bytes((2 if op == "all_reduce" else 1) * (N - 1) * V)    # each step sends V, not V/N
""", _RING, "a float subclass whose == always agrees, holding (N-1)·V"),
]
