"""A wrong answer never breaks the rest of the lab, and its check names the mistake: one test, Labs 00-06, 09 and 10.

Each lab is executed top to bottom, as a learner would run it, with exercises' stubs replaced by plausible
wrong answers and checks in lab mode (``COURSE_LIB_STRICT_CHECKS=0``): every cell must run (the lab falls
back to the reference), and every exercise's check must print its ❌ line with the diagnosis the exercise
registry (:mod:`course_lib.checks.registry`) declares for that mistake, never a traceback. The registry
finds each exercise's cell; this file holds only the wrong answers.

These runs are also the labs' "as received" runs: the root ``conftest.py`` leaves ``labs/00``-``06`` out of
nbval's collection, since each is executed here top to bottom as shipped except for its exercise cells (a stub
and a wrong answer take the same fallback: the check returns False). Each check's ⏳ for a stub is asserted by
its unit tests (``tests/test_labNN_checks.py``); labs/07 and 08 still run as shipped under nbval. Lab 09's and Lab 10's
wrong answers are picked from their held-out catalogues (``tests/wrong_answers/lab09.py``, ``lab10.py``), one per exercise.
"""
from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest

from course_lib.authoring import lab_time
from course_lib.authoring.run import without_output_widget_mirror
from course_lib.checks import registry

ROOT = Path(__file__).resolve().parent.parent
FALLBACK = "The rest of the lab uses the reference answer"

#: (lab, exercise, mistake tag in the registry, more text the ❌ block must hold, the wrong cell's source)
WRONG = [
    ("00", 'my_all_reduce', 'averaged twice', [], """\
def my_all_reduce(x, mean=False):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    shard = torch.empty(x.numel() // n)
    dist.reduce_scatter_tensor(shard, x)
    if mean:
        shard /= n
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out / n if mean else out                  # divided again after gathering
"""),
    ("00", 'jax_all_reduce', 'stacked gather', [], """\
def jax_all_reduce(block):
    return jax.lax.all_gather(jax.lax.psum_scatter(block, "x", tiled=True), "x")   # stacks: (N, numel/N)
"""),
    ("00", 'ring_bytes', "broadcast as the root's bytes", [], """\
def ring_bytes(op, V, N):
    if N == 1:
        return 0.0
    if op == "broadcast":
        return float(V)                              # the root's bytes, not the per-rank average
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V
"""),
    ("01", 'average_gradients', 'summed, not averaged', [], """\
def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)                  # the sum: forgot the mean
"""),
    ("01", 'make_buckets', 'forward order', [], """\
def my_make_buckets(params, cap_bytes):
    buckets, current, size = [], [], 0
    for p in list(params):                           # forward order
        b = p.numel() * p.element_size()
        if current and size + b > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += b
    return buckets + ([current] if current else [])
"""),
    ("01", 'dp_value_and_grad', 'pmean of the gradient', [], """\
def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.lax.pmean(loss, "dp"), jax.lax.pmean(grads, "dp")   # the textbook answer
"""),
    ("01", 'device_key', 'same key everywhere', [], """\
def device_key(key):
    return key                                        # the same key everywhere
"""),
    ("02", 'storage_bytes', 'views counted twice', [], """\
def storage_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
"""),
    ("02", 'sharded_step', 'gather into its own input', [], """\
def sharded_step(full_params, full_grads, shard_params, optimizer):
    import torch
    import torch.distributed as dist
    from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()
    all_gather_flat(shard_params, out=full_params)   # reads the memory it overwrites
"""),
    ("02", 'gather / free', 'name dropped, storage kept', [], """\
def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel() * full.element_size())
    all_gather_flat(shard, out=full)


def free(full):
    full = None                                      # drops a name; the storage stays
"""),
    ("03", 'flat_shard', 'no padding', [], """\
def flat_shard(tensors, rank, world):
    return torch.cat([t.reshape(-1) for t in tensors]).tensor_split(world)[rank]     # no padding
"""),
    ("03", 'Unshard', 'dtype dropped', [], """\
class Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sharded, flat):
        import torch.distributed as dist
        full = torch.empty(N * sharded.numel())                  # float32 whatever the shard is
        dist.all_gather_into_tensor(full, sharded)
        flat.unsharded, flat.state, ctx.flat = full, State.UNSHARDED, flat
        return full

    @staticmethod
    def backward(ctx, grad_full):
        import torch.distributed as dist
        grad = torch.empty(grad_full.numel() // N)
        dist.reduce_scatter_tensor(grad, grad_full.contiguous())
        ctx.flat.reshard()
        return grad / N, None
"""),
    ("03", 'MyFSDP', "crash in the learner's code", ['your code raised AttributeError on rank', 'at line', 'set_view', 'checks.last_error()'], """\
class MyFSDP(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        gather = Unshard if ex2_ok else fsdp.Unshard
        full = gather.apply(flat.sharded, flat)
        flat.set_view(full)                          # a typo: crashes on every rank

    def post_forward(self, flat):
        flat.reshard()

    def pre_backward(self, flat):
        flat.unshard()
"""),
    ("03", 'prefetch', 'synchronous prefetch', [], """\
class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard()                            # waits: a synchronous "prefetch"
"""),
    ("04", 'shard_model', 'root only', [], """\
def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)                    # the root only: one unit
"""),
    ("04", 'set_prefetch', 'backward in forward order', [], """\
def set_prefetch(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[i + 1:i + 1 + depth])   # not reversed
"""),
    ("05", 'fsdp_spec', 'cut that does not divide', [], """\
def my_fsdp_spec(shape, n, min_size=fsdp_jax.MIN_SIZE):
    return P() if math.prod(shape) < min_size else P("fsdp")     # dim 0, divisible or not
"""),
    ("05", 'gather_pair', 'psum instead of psum_scatter', [], """\
def gather_weight(w_shard, dim):
    return jax.lax.all_gather(w_shard, "fsdp", axis=dim, tiled=True)


def scatter_grad(g_full, dim):
    return jax.lax.psum(g_full, "fsdp")             # sums, but every device keeps the whole gradient
"""),
    ("06", 'shard_hsdp', 'axes swapped', [], """\
def shard_hsdp(model, replicate, shard):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (shard, replicate), mesh_dim_names=("shard", "replicate"))   # torchtitan's order
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh
"""),
    ("06", 'axis_bytes', 'whole Ψ across replicas', [], """\
def axis_bytes(psi_pad, replicate, shard, b=4):
    R, F = replicate, shard
    return {"shard": 3 * (F - 1) / F * psi_pad * b, "replicate": 2 * (R - 1) / R * psi_pad * b}   # the whole Ψ
"""),
    ("06", 'choose_f', 'plain FSDP', [], """\
def choose_f(psi, world, per_node, budget, bw_intra, bw_inter):
    return world                                     # always FSDP
"""),
    ("06", 'tp_spec', 'cut over both axes on dim 0', [], """\
def tp_spec(shape, fsdp, tensor):
    if len(shape) == 2 and math.prod(shape) >= fsdp_jax.MIN_SIZE:
        return P(("fsdp", "tensor"), None)          # both axes on the rows
    return fsdp_jax.fsdp_spec(shape, fsdp)
"""),
    ("06", 'tp_plan', 'row-wise where column-wise belongs', [], """\
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def tp_plan(n_heads, d_ff, tp, nodes, gpus_per_node):
    if n_heads % tp or d_ff % tp or gpus_per_node % tp:
        raise ValueError(f"tp({tp}) does not fit")
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(), "mlp.fc": RowwiseParallel(), "mlp.proj": ColwiseParallel()}   # swapped
    return (nodes * gpus_per_node // tp, tp), ("dp_shard", "tp"), plan
"""),
]

def _from_catalogue(lab: str, picks: dict[str, str]) -> list[tuple]:
    """One wrong answer per exercise, taken from the held-out catalogue (tests/wrong_answers/labNN.py) by tag."""
    import importlib
    catalogue = importlib.import_module(f"wrong_answers.lab{lab}").WRONG
    return [(w.lab, w.exercise, w.tag, list(w.more), w.source) for name, tag in picks.items()
            for w in [next(w for w in catalogue if (w.exercise, w.tag) == (name, tag))]]


WRONG += _from_catalogue("04", {"accumulate_and_clip": "per-shard clipping"})
WRONG += _from_catalogue("09", {"hang_report": "outermost frame", "diverged_ranks": "not the first parameter",
                                "first_nonfinite": "list order", "spec_fix": "replicated state"})
WRONG += _from_catalogue("10", {"one_f_one_b": "GPipe order", "bubble_fraction": "relative to useful time",
                                "ring_merge": "overflow", "dispatch_counts": "dropped counted"})
LABS = sorted({lab for lab, *_ in WRONG})


def _lab_path(lab: str) -> Path:
    paths = sorted((ROOT / "labs").glob(f"{lab}_*.ipynb"))
    assert len(paths) == 1, f"lab {lab}: expected one labs/{lab}_*.ipynb, found {paths}"
    return paths[0]


def _wrong_lab(lab: str) -> nbformat.NotebookNode:
    nb = nbformat.read(_lab_path(lab), as_version=4)
    for _, name, _, _, source in (w for w in WRONG if w[0] == lab):
        ex = registry.find(lab, name)
        cells = [c for c in nb.cells if c.cell_type == "code" and ex.cell in c.source]
        assert len(cells) == 1, f"lab {lab}: the cell of exercise {name!r} ({ex.cell!r}) found {len(cells)} times"
        assert "NotImplementedError" in cells[0].source, f"lab {lab}: {name!r}'s cell is not a stub in the lab"
        cells[0].source = source
    return nb


def test_every_wrong_answer_names_a_declared_mistake():
    """Each wrong answer's tag is one its exercise declares (so the ❌ text asserted below is the registry's)."""
    for lab, name, tag, _, _ in WRONG:
        assert tag in registry.find(lab, name).mistakes, f"{lab}/{name}: {tag!r} is not among its declared mistakes"


@pytest.mark.slow
@pytest.mark.parametrize("lab", LABS)
def test_a_wrong_answer_never_breaks_the_lab(lab, monkeypatch):
    from nbclient import NotebookClient
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")       # lab mode: ❌ and fall back, never raise
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("COURSE_LIB_TWO_NODE", "0")        # Lab 06's two-node cells: tests/test_netns.py runs them
    nb = _wrong_lab(lab)
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "labs")}})
    t0 = time.perf_counter()
    without_output_widget_mirror(client).execute()        # raises if a cell fails
    seconds = time.perf_counter() - t0
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                     if o.get("output_type") == "stream")
    # the lab as received, predictions untouched: nothing scored as the learner's, nothing credited from a fallback
    assert "you predicted" not in text, [line for line in text.splitlines() if "you predicted" in line]
    # not far slower than the first cell states (course_lib/authoring/lab_time.py: an upper bound, never a floor)
    late = lab_time.problem(_lab_path(lab), seconds)
    assert late is None, late
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[0]
    wrong = [w for w in WRONG if w[0] == lab]
    for _, name, tag, more, _ in wrong:
        ex = registry.find(lab, name)
        line = next((l for l in text.splitlines() if l.startswith(f"❌ {name}:")), None)
        assert line is not None, f"lab {lab}: no '❌ {name}:' line in:\n{text[-3000:]}"
        block = text[text.index(line):text.index(line) + 800]
        for s in [ex.mistakes[tag], *more]:
            assert s in block, f"lab {lab}, {name}: {s!r} not in\n{block}"
        assert registry.verdict(ex, text) == ("wrong", tag)
        assert "Traceback" not in block.split(FALLBACK)[0]
    assert text.count(FALLBACK) >= len(wrong)
