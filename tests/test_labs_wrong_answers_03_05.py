"""A wrong answer never breaks the rest of the lab (Labs 03, 04, 05).

Each lab is executed top to bottom, as a learner would run it, with every exercise's stub replaced by
a plausible wrong answer and checks in lab mode (``COURSE_LIB_STRICT_CHECKS=0``): every cell must run
(the lab falls back to the reference), and every exercise's check must print its ❌ line with the
diagnosis. One wrong ``MyFSDP`` crashes inside the learner's own code on the ranks: its ❌ must be one
line naming the rank and the learner's line, not four tracebacks.
"""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lab -> {text that identifies the exercise cell: (its wrong source, what the ❌ line must say)}
WRONG = {
    "03_fsdp_from_scratch": {
        "def flat_shard(": ('''def flat_shard(tensors, rank, world):
    return torch.cat([t.reshape(-1) for t in tensors]).tensor_split(world)[rank]     # no padding
''', ["❌ flat_shard:", "pad the flat buffer with zeros"]),
        "class Unshard(": ('''class Unshard(torch.autograd.Function):
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
''', ["❌ Unshard:", "allocated without dtype="]),
        "class MyFSDP(": ('''class MyFSDP(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        gather = Unshard if ex2_ok else fsdp.Unshard
        full = gather.apply(flat.sharded, flat)
        flat.set_view(full)                          # a typo: crashes on every rank

    def post_forward(self, flat):
        flat.reshard()

    def pre_backward(self, flat):
        flat.unshard()
''', ["❌ MyFSDP: your code raised AttributeError on rank", "at line", "set_view",
      "checks.last_error()"]),
        "class Prefetching(": ('''class Prefetching(fsdp.FlatFSDP):
    def pre_forward(self, flat):
        super().pre_forward(flat)
        nxt = self.next_unit(flat)
        if nxt is not None:
            nxt.unshard()                            # waits: a synchronous "prefetch"
''', ["❌ prefetch:", "async_op=False"]),
    },
    "04_fsdp2": {
        "def shard_model(": ('''def shard_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)                    # the root only: one unit
''', ["❌ shard_model:", "call fully_shard(block) on every block"]),
        "def set_prefetch(": ('''def set_prefetch(model, depth):
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + depth])
        block.set_modules_to_backward_prefetch(blocks[i + 1:i + 1 + depth])   # not reversed
''', ["❌ set_prefetch:", "backward runs the blocks in reverse"]),
    },
    "05_fsdp_jax": {
        "def my_fsdp_spec(": ('''def my_fsdp_spec(shape, n, min_size=fsdp_jax.MIN_SIZE):
    return P() if math.prod(shape) < min_size else P("fsdp")     # dim 0, divisible or not
''', ["❌ fsdp_spec:", "does not divide"]),
        "def gather_weight(": ('''def gather_weight(w_shard, dim):
    return jax.lax.all_gather(w_shard, "fsdp", axis=dim, tiled=True)


def scatter_grad(g_full, dim):
    return jax.lax.psum(g_full, "fsdp")             # sums, but every device keeps the whole gradient
''', ["❌ gather_pair:", "psum sums but does not scatter"]),
    },
}


def _wrong_lab(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(ROOT / "labs" / f"{name}.ipynb", as_version=4)
    for key, (source, _) in WRONG[name].items():
        cells = [c for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith(key)]
        assert len(cells) == 1, f"{name}: exercise cell {key!r} not found once"
        assert "NotImplementedError" in cells[0].source, f"{name}: {key!r} is not a stub in the lab"
        cells[0].source = source
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WRONG))
def test_a_wrong_answer_never_breaks_the_lab(name, monkeypatch, tmp_path):
    from nbclient import NotebookClient
    monkeypatch.setenv("COURSE_LIB_STRICT_CHECKS", "0")       # lab mode: ❌ and fall back, never raise
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = _wrong_lab(name)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "labs")}}).execute()   # raises if a cell fails
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                     if o.get("output_type") == "stream")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, errors[0]
    for key, (_, says) in WRONG[name].items():
        line = next((l for l in text.splitlines() if l.startswith(says[0])), None)
        assert line is not None, f"{name}: no {says[0]!r} line for {key!r} in:\n{text[-3000:]}"
        block = text[text.index(line):text.index(line) + 800]
        for s in says[1:]:
            assert s in block, f"{name}, {key!r}: {s!r} not in\n{block}"
        assert "Traceback" not in block.split("The rest of the lab uses the reference")[0]
    assert text.count("The rest of the lab uses the reference answer") >= len(WRONG[name])
