"""Lab 02's classic mistakes (counting storage, ZeRO-1's sharded step, ZeRO-3's gather and free)."""
from wrong_answers import Wrong

_N = "N = 4\n"
_SB = "lab02.check_storage_bytes(storage_bytes)"
_STEP = "lab02.check_sharded_step(sharded_step, world_size=N)"
_GF = "lab02.check_gather_free(gather, free, world_size=N)"
_IMPORTS = """\
    import torch
    import torch.distributed as dist
    from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
"""


def _step(body: str) -> str:
    return _N + "def sharded_step(full_params, full_grads, shard_params, optimizer):\n" + _IMPORTS + body


_GATHER = """\
def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel() * full.element_size())
    all_gather_flat(shard, out=full)
"""
_FREE = """\
def free(full):
    full.untyped_storage().resize_(0)
"""

WRONG = [
    # -- storage_bytes ----------------------------------------------------------------------------------------
    Wrong("02", "storage_bytes", "value", "views counted twice", """\
def storage_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)   # per tensor, not per storage
""", _SB, "numel × element_size per tensor"),
    Wrong("02", "storage_bytes", "value", "storage counted twice", """\
def storage_bytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)   # no de-duplication
""", _SB, "every tensor's whole storage, shared ones again"),
    Wrong("02", "storage_bytes", "value", "storage counted twice", """\
def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.data_ptr() not in seen:          # the view's address, not the storage's
            seen.add(t.data_ptr())
            total += t.untyped_storage().nbytes()
    return total
""", _SB, "identifies a storage by the view's data_ptr"),
    Wrong("02", "storage_bytes", "value", "elements, not bytes", """\
def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes() // t.element_size()   # elements
    return total
""", _SB, "counts elements"),
    Wrong("02", "storage_bytes", "boundary", "padding missed", """\
def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()           # the view's size: padding and the rest missed
    return total
""", _SB, "one count per storage, at the first view's size"),
    Wrong("02", "storage_bytes", "boundary", "freed counted", """\
def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        base = t._base if t._base is not None else t        # the tensor that owns the storage
        if base.untyped_storage().data_ptr() not in seen:
            seen.add(base.untyped_storage().data_ptr())
            total += base.numel() * base.element_size()     # its shape, not what is allocated now
    return total
""", _SB, "sizes a storage by its owner's shape: a freed storage still counts"),
    Wrong("02", "storage_bytes", "crash", "crash", """\
def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:                                       # None (a parameter without gradient) not skipped
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total
""", _SB, "forgets to skip None", ("AttributeError",)),

    # -- sharded_step ---------------------------------------------------------------------------------------
    Wrong("02", "sharded_step", "value", "summed, not averaged", _step("""\
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g                                   # the sum over ranks: Adam hardly notices
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)
"""), _STEP, "forgets to divide by N"),
    Wrong("02", "sharded_step", "value", "not gathered", _step("""\
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()                                        # the other ranks' shards never arrive
"""), _STEP, "forgets the all-gather"),
    Wrong("02", "sharded_step", "value", "no reduction", _step("""\
    r, S = dist.get_rank(), shard_params.numel()
    shard_params.grad = full_grads[r * S:(r + 1) * S].clone()   # this rank's own gradient slice
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)
"""), _STEP, "uses its own gradient slice, never reduced"),
    Wrong("02", "sharded_step", "cost", "all-reduce", _step("""\
    r, n, S = dist.get_rank(), dist.get_world_size(), shard_params.numel()
    dist.all_reduce(full_grads)                             # the whole gradient to every rank
    shard_params.grad = full_grads[r * S:(r + 1) * S] / n
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)
"""), _STEP, "all-reduce, then keep a slice: right values, DP's memory"),
    Wrong("02", "sharded_step", "cost", "gather into its own input", _step("""\
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()
    all_gather_flat(shard_params, out=full_params)          # the input is a view of the output
"""), _STEP, "all-gathers from a view of its output"),
    Wrong("02", "sharded_step", "cost", "scatter into its own gradient", _step("""\
    r, n, S = dist.get_rank(), dist.get_world_size(), shard_params.numel()
    mine = full_grads[r * S:(r + 1) * S]                    # "no new buffer": a view of the input
    dist.reduce_scatter_tensor(mine, full_grads)
    shard_params.grad = mine / n
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)
"""), _STEP, "reduce-scatters into a slice of its own input"),
    Wrong("02", "sharded_step", "argument", "world size hard-coded", _step("""\
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / 4                               # the lab's N, written in
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)
"""), _STEP, "divides by 4 whatever the world size"),
    Wrong("02", "sharded_step", "crash", "crash", _step("""\
    g = torch.empty_like(full_params)                       # full-sized, not shard-sized
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()
    all_gather_flat(shard_params.clone(), out=full_params)
"""), _STEP, "a full-sized output buffer", ("on rank",)),

    # -- gather / free ----------------------------------------------------------------------------------------
    Wrong("02", "gather / free", "value", "gathered elsewhere", _N + """\
def gather(full, shard):
    import torch
    from course_lib.comm.shim import all_gather_flat
    fresh = torch.empty(full.numel())                       # a new tensor: the parameters never see it
    all_gather_flat(shard, out=fresh)
""" + _FREE, _GF, "all-gathers into a new tensor"),
    Wrong("02", "gather / free", "value", "no communication", _N + """\
def gather(full, shard):
    import torch.distributed as dist
    full.untyped_storage().resize_(full.numel() * full.element_size())
    full.copy_(shard.repeat(dist.get_world_size()))         # its own shard N times
""" + _FREE, _GF, "copies its own shard everywhere"),
    Wrong("02", "gather / free", "value", "storage too small", _N + """\
def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel())            # elements, not bytes
    all_gather_flat(shard, out=full)
""" + _FREE, _GF, "resizes the storage to the element count"),
    Wrong("02", "gather / free", "cost", "name dropped, storage kept", _N + _GATHER + """\
def free(full):
    full = None                                             # drops a name; the storage stays allocated
""", _GF, "rebinding the argument frees nothing"),
    Wrong("02", "gather / free", "cost", "zeroed, storage kept", _N + _GATHER + """\
def free(full):
    full.zero_()                                            # zeros the values; the bytes stay
""", _GF, "zeroes instead of releasing"),
    Wrong("02", "gather / free", "crash", "crash", _N + """\
def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel() * full.element_size())
    all_gather_flat(shard, out=full.view(-1, 2))            # a 2-D output for a flat gather
""" + _FREE, _GF, "a reshaped output", ("on rank",)),
]

# -- round 3: the wrong type (a list compared with an int raised a raw TypeError in the check) -------------------
WRONG += [
    Wrong("02", "storage_bytes", "crash", "not a number", """\
def storage_bytes(tensors):
    return [t.untyped_storage().nbytes() for t in tensors if t is not None]   # one number per tensor, not a total
""", _SB, "a list of per-tensor sizes, never summed"),
]
