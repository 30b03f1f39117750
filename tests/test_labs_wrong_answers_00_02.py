"""A wrong answer never breaks the rest of the lab (Labs 00, 01, 02).

Each lab is executed top to bottom, as a learner would run it, with every exercise's stub replaced by
a plausible wrong answer and checks in lab mode (``COURSE_LIB_STRICT_CHECKS=0``): every cell must run
(the lab falls back to the reference), and every exercise's check must print its ❌ line with the
diagnosis.
"""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lab -> {text that identifies the exercise cell: (its wrong source, what the ❌ line must say)}
WRONG = {
    "00_collectives": {
        "def my_all_reduce(": ('''def my_all_reduce(x, mean=False):
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
''', ["❌ my_all_reduce:", "averaged twice"]),
        "def jax_all_reduce(": ('''def jax_all_reduce(block):
    return jax.lax.all_gather(jax.lax.psum_scatter(block, "x", tiled=True), "x")   # stacks: (N, numel/N)
''', ["❌ jax_all_reduce:", "all_gather without tiled=True"]),
        "def ring_bytes(": ('''def ring_bytes(op, V, N):
    if N == 1:
        return 0.0
    if op == "broadcast":
        return float(V)                              # the root's bytes, not the per-rank average
    return (2 if op == "all_reduce" else 1) * (N - 1) / N * V
''', ["❌ ring_bytes:", "only the root sends all of V"]),
    },
    "01_data_parallel": {
        "def average_gradients(": ('''def average_gradients(model):
    import torch.distributed as dist
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)                  # the sum: forgot the mean
''', ["❌ average_gradients:", "summed instead of averaging"]),
        "def my_make_buckets(": ('''def my_make_buckets(params, cap_bytes):
    buckets, current, size = [], [], 0
    for p in list(params):                           # forward order
        b = p.numel() * p.element_size()
        if current and size + b > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += b
    return buckets + ([current] if current else [])
''', ["❌ make_buckets:", "reverse"]),
        "def dp_value_and_grad(": ('''def dp_value_and_grad(loss_fn, params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return jax.lax.pmean(loss, "dp"), jax.lax.pmean(grads, "dp")   # the textbook answer
''', ["❌ dp_value_and_grad:", "jax.grad already psums"]),
        "def device_key(": ('''def device_key(key):
    return key                                        # the same key everywhere
''', ["❌ device_key:", "drew the same mask"]),
    },
    "02_memory": {
        "def storage_bytes(": ('''def storage_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
''', ["❌ storage_bytes:", "counts views twice"]),
        "def sharded_step(": ('''def sharded_step(full_params, full_grads, shard_params, optimizer):
    import torch
    import torch.distributed as dist
    from course_lib.comm.shim import all_gather_flat, reduce_scatter_flat
    g = torch.empty_like(shard_params)
    reduce_scatter_flat(full_grads, out=g)
    shard_params.grad = g / dist.get_world_size()
    optimizer.step()
    all_gather_flat(shard_params, out=full_params)   # reads the memory it overwrites
''', ["❌ sharded_step:", "must not overlap"]),
        "def gather(": ('''def gather(full, shard):
    from course_lib.comm.shim import all_gather_flat
    full.untyped_storage().resize_(full.numel() * full.element_size())
    all_gather_flat(shard, out=full)


def free(full):
    full = None                                      # drops a name; the storage stays
''', ["❌ gather / free:", "release it"]),
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
