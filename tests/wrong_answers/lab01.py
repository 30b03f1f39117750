"""Lab 01's classic mistakes (averaging gradients over ranks, DDP's buckets, DP in JAX, a key per device)."""
from wrong_answers import Right, Wrong

_N = "N = 4\n"
_AVG = "lab01.check_average_gradients(average_gradients, world_size=N)"
_BUCKETS = "lab01.check_make_buckets(my_make_buckets)"
# The lab's mesh: its 4 devices (the test process has 8 simulated devices; the lab asks for 4)
_MESH = ('import jax\nimport jax.numpy as jnp\n'
         'mesh = jax.make_mesh((4,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])\n')
_VG = "lab01.check_jax_dp_value_and_grad(dp_value_and_grad, mesh)"
_KEY = "lab01.check_jax_device_key(device_key, mesh)"


def _buckets(condition: str, size: str = "p.numel() * p.element_size()", order: str = "reversed(list(params))",
             comment: str = "", outer: str = "[]") -> str:
    return f"""\
def my_make_buckets(params, cap_bytes):
    buckets, current, size = {outer}, [], 0
    for p in {order}:
        nbytes = {size}
        if {condition}:{comment}
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
"""


WRONG = [
    # -- average_gradients ---------------------------------------------------------------------------------
    Wrong("01", "average_gradients", "value", "summed, not averaged", _N + """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)                  # the sum; never divided
""", _AVG, "forgets to divide by N"),
    Wrong("01", "average_gradients", "value", "averaged twice", _N + """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        p.grad /= dist.get_world_size()              # AVG already divided
""", _AVG, "ReduceOp.AVG and then ÷N"),
    Wrong("01", "average_gradients", "value", "never all-reduced", _N + """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        p.grad /= dist.get_world_size()              # divided, never communicated
""", _AVG, "divides without the all-reduce"),
    Wrong("01", "average_gradients", "value", "nothing done", _N + """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= dist.get_world_size()                   # averaged a copy; p.grad untouched
""", _AVG, "all-reduces a copy and drops it"),
    Wrong("01", "average_gradients", "value", "stepped", _N + """\
def average_gradients(model):
    import torch
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad                        # the step belongs to the optimizer, later
""", _AVG, "takes the SGD step too"),
    Wrong("01", "average_gradients", "argument", "world size hard-coded", _N + """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 4                                  # the lab's N, written in
""", _AVG, "divides by 4 whatever the world size"),
    Wrong("01", "average_gradients", "crash", "crash", _N + """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        dist.all_reduce(p.gradient)                  # no such attribute
        p.grad /= dist.get_world_size()
""", _AVG, "a typo'd attribute", ("on rank", "AttributeError")),

    # -- make_buckets -----------------------------------------------------------------------------------
    Wrong("01", "make_buckets", "value", "forward order",
          _buckets("current and size + nbytes > cap_bytes", order="params"), _BUCKETS, "walks the parameters forward"),
    Wrong("01", "make_buckets", "value", "over the cap", """\
def my_make_buckets(params, cap_bytes):
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        current.append(p)                            # added first, checked after: the bucket overflows
        size += p.numel() * p.element_size()
        if size > cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])
""", _BUCKETS, "adds the tensor, then checks the cap"),
    Wrong("01", "make_buckets", "value", "over the cap",
          _buckets("current and size + nbytes > cap_bytes", size="p.numel()"), _BUCKETS,
          "compares elements with a cap in bytes"),
    Wrong("01", "make_buckets", "value", "lost parameter", """\
def my_make_buckets(params, cap_bytes):
    buckets, current, size = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    return buckets                                   # the last, partly filled bucket is dropped
""", _BUCKETS, "forgets the last bucket"),
    Wrong("01", "make_buckets", "boundary", "exact fit split",
          _buckets("current and size + nbytes >= cap_bytes", comment="   # 'at most' read as 'less than'"),
          _BUCKETS, "closes a bucket that fits the cap exactly"),
    Wrong("01", "make_buckets", "boundary", "empty bucket",
          _buckets("size + nbytes > cap_bytes", comment="             # also when current is empty"),
          _BUCKETS, "a tensor bigger than the cap closes an empty bucket"),
    Wrong("01", "make_buckets", "argument", "dtype ignored",
          _buckets("current and size + nbytes > cap_bytes", size="p.numel() * 4"), _BUCKETS,
          "assumes 4 bytes per element (float32)"),
    Wrong("01", "make_buckets", "argument", "cap ignored",
          _buckets("current and size + nbytes > 25 * 2**20"), _BUCKETS, "DDP's default 25 MiB, not cap_bytes"),
    Wrong("01", "make_buckets", "crash", "crash",
          _buckets("current and size + nbytes > cap_bytes", order="params.reverse()"), _BUCKETS,
          "list.reverse() returns None", ("TypeError",)),

    # -- dp_value_and_grad -------------------------------------------------------------------------------
    Wrong("01", "dp_value_and_grad", "value", "pmean of the gradient", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.lax.pmean(loss, "dp"), jax.lax.pmean(grads, "dp")   # the textbook: N x under check_vma
""", _VG, "the textbook grad-then-pmean"),
    Wrong("01", "dp_value_and_grad", "value", "no collective", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    return jax.value_and_grad(loss_fn)(params, x, y)              # this device's rows only
""", _VG, "the local loss and gradient"),
    Wrong("01", "dp_value_and_grad", "value", "psum of the loss", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    return jax.value_and_grad(lambda p: jax.lax.psum(loss_fn(p, x, y), "dp"))(params)
""", _VG, "psum of the loss: the sum of the slice means"),
    Wrong("01", "dp_value_and_grad", "value", "averaged twice", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(loss_fn(p, x, y), "dp"))(params)
    return loss, jax.tree.map(lambda g: g / 4, grads)             # pmean already averaged
""", _VG, "divides the averaged gradient by N again"),
    Wrong("01", "dp_value_and_grad", "cost", "batch gathered", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    xs = jax.lax.all_gather(x, "dp", tiled=True)                  # every device takes the whole batch
    ys = jax.lax.all_gather(y, "dp", tiled=True)
    loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
    return loss, jax.tree.map(lambda g: g / 4, grads)             # "fixed" the N x it saw
""", _VG, "gathers the whole batch onto every device: right values, no data parallelism"),
    Wrong("01", "dp_value_and_grad", "cost", "extra all-reduce", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)      # the textbook, then "fixed" by / N
    return jax.lax.pmean(loss, "dp"), jax.tree.map(lambda g: jax.lax.pmean(g, "dp") / 4, grads)
""", _VG, "the textbook answer divided by N: right values, a second all-reduce of the gradients"),
    Wrong("01", "dp_value_and_grad", "crash", "crash", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    return jax.value_and_grad(lambda p: jax.lax.pmean(loss_fn(p, x), "dp"))(params)   # y forgotten
""", _VG, "calls loss_fn without y", ("TypeError",)),

    # -- device_key ----------------------------------------------------------------------------------------
    Wrong("01", "device_key", "value", "same key everywhere", _MESH + """\
def device_key(key):
    return jax.random.split(key, 4)[0]               # 4 keys, but every device takes the same one
""", _KEY, "every device takes split's first key"),
    Wrong("01", "device_key", "value", "another derivation", _MESH + """\
def device_key(key):
    return jax.random.fold_in(key, jax.lax.axis_index("dp") + 1)   # an offset nobody else uses
""", _KEY, "folds in index + 1"),
    Wrong("01", "device_key", "argument", "key ignored", _MESH + """\
def device_key(key):
    return jax.random.key(jax.lax.axis_index("dp"))               # a new key per device: the seed is lost
""", _KEY, "makes a new key from the device index"),
    Wrong("01", "device_key", "crash", "crash", _MESH + """\
def device_key(key):
    return jax.random.fold_in(key, jax.lax.axis_index("data"))    # the mesh axis is "dp"
""", _KEY, "a mesh axis name the mesh does not have", ("NameError",)),
]

# -- round 3: the caller's list changed in place; the wrong type ------------------------------------------------
WRONG += [
    Wrong("01", "make_buckets", "cost", "input reordered", _buckets("size + nbytes > cap_bytes and current",
                                                                    order="params").replace(
        "    buckets, current, size = [], [], 0\n", "    params.reverse()                                 # in place: the caller's list too\n"
        "    buckets, current, size = [], [], 0\n"), _BUCKETS, "params.reverse() in place: right buckets, the caller's list reversed"),
    Wrong("01", "make_buckets", "crash", "not a list of buckets", """\
def my_make_buckets(params, cap_bytes):
    return len(params)                               # how many parameters, not the buckets
""", _BUCKETS, "returns a count"),
]

RIGHT = [
    Right("01", "make_buckets", """\
def my_make_buckets(params, cap_bytes):
    params = params[::-1]                            # a reversed copy: the caller's list untouched
    buckets = [[]]
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and sum(q.numel() * q.element_size() for q in buckets[-1]) + nbytes > cap_bytes:
            buckets.append([])
        buckets[-1].append(p)
    return [b for b in buckets if b]
""", _BUCKETS, "a reversed copy, sizes summed again per bucket"),
]

WRONG += [
    Wrong("01", "dp_value_and_grad", "crash", "not (loss, grads)", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(loss_fn(p, x, y), "dp"))(params)
    return grads, loss                               # the order of jax.grad's has_aux, not value_and_grad's
""", _VG, "(grads, loss) where (loss, grads) is asked: the check's unpacking raised a raw IndexError"),
    Wrong("01", "dp_value_and_grad", "value", "dtype changed", _MESH + """\
def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(lambda p: jax.lax.pmean(loss_fn(p, x, y), "dp"))(params)
    return loss, jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads)   # "half the bytes to send"
""", _VG, "gradients cast to bfloat16: right to 3 digits"),
    Wrong("01", "device_key", "crash", "not a key", _MESH + """\
def device_key(key):
    jax.random.fold_in(key, jax.lax.axis_index("dp"))   # computed, never returned
""", _KEY, "no return: jax.random raised a raw TypeError in the check"),
]

# -- issue 49: a list that lies about itself (== and != say it matches anything); the judge reads what it holds ------
WRONG += [
    Wrong("01", "make_buckets", "value", "forward order", """\
class Buckets(list):
    def __eq__(self, other):                         # "equal" to whatever it is compared with
        return True

    def __ne__(self, other):
        return False

    __hash__ = None


""" + _buckets("current and size + nbytes > cap_bytes", order="params", comment="    # forward order",
               outer="Buckets()"),
          _BUCKETS, "a list subclass whose == always agrees, holding the buckets in forward order"),
]
