"""Checkpoints across layouts: a DCP checkpoint of PyTorch FSDP × TP (dp_shard 2 × tp 2, 4 gloo ranks) loads
into 1-D FSDP on 2 ranks and into one process, weights and Adam state bit-identical; and its weights, under
the course GPT's names (q, k, v fused back), equal a plain model's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib
from course_lib.models import GPTConfig
from course_lib.checkpoint import dcp as ck
from course_lib.strategies.tp import torch as tpt

CFG = GPTConfig(d_model=66, n_heads=6, d_ff=198, seq_len=31, vocab_size=67, n_layers=2)


def _numpy(state: dict) -> dict:
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def _train(model, steps=2, batch=8, d=0, dp=1):
    from course_lib.models import TokenTask, loss_fn
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    task = TokenTask(CFG.vocab_size, CFG.seq_len, seed=0)
    for s in range(steps):
        x, y = (torch.from_numpy(a) for a in task.rank_batch(s, batch, d, dp))
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _save_2d(path):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from course_lib.models import torch_gpt
    mesh = tpt.mesh_2d(2, 2)
    model = tpt.apply_tp(torch_gpt(CFG, seed=0), mesh["tp"])
    tpt.apply_fsdp(model, mesh["dp_shard"])
    opt = _train(model, d=mesh["dp_shard"].get_local_rank(), dp=2)
    ck.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), path)
    return _numpy(ck.full_state(model, opt))


def _split_model():
    from course_lib.models import torch_gpt
    return tpt.split_attention_(torch_gpt(CFG, seed=1))        # other weights: the load must overwrite them


def _load_1d(path):
    from torch.distributed.device_mesh import init_device_mesh
    model = _split_model()
    tpt.apply_fsdp(model, init_device_mesh("cpu", (2,)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ck.load_model_and_optimizer(model, opt, path)
    return _numpy(ck.full_state(model, opt))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_ckpt") / "step2"
    return path, course_lib.run(_save_2d, path, world_size=4)[0]


def _assert_identical(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    assert any(k.endswith(".exp_avg_sq") for k in want) and "model.blocks.0.attn.q.weight" in want
    bad = [k for k in want if not np.array_equal(got[k], want[k])]
    assert bad == [], f"not bit-identical: {bad[:5]}"


def test_2d_checkpoint_loads_into_1d_fsdp_on_2_ranks(saved):
    path, want = saved
    _assert_identical(course_lib.run(_load_1d, path, world_size=2)[0], want)


def test_2d_checkpoint_loads_into_one_process(saved):
    path, want = saved
    model = _split_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ck.load_model_and_optimizer(model, opt, path)
    _assert_identical(_numpy(ck.full_state(model, opt)), want)
    # under the course GPT's own names, the weights load into a plain (fused) model: same logits
    from course_lib.models import TorchGPT
    plain = TorchGPT(CFG)
    plain.load_state_dict({k: torch.from_numpy(v) for k, v in tpt.fuse_qkv(
        {k.removeprefix("model."): v for k, v in want.items() if k.startswith("model.")}).items()})
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(plain(x), model(x), rtol=0, atol=1e-6)
