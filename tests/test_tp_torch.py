"""PyTorch FSDP × tensor parallel on a (dp_shard 2, tp 2) DeviceMesh of 4 gloo ranks: the same losses and
weights as one process, every collective on its mesh dim, and each dim's bytes equal to its formula."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import course_lib
from course_lib.models import GPTConfig, init_weights, torch_gpt
from course_lib.strategies.tp import torch as tpt

#: heads and d_ff divide by T = 2; d_model 66, vocab 67 and seq 31 still make FSDP pad
CFG = GPTConfig(d_model=66, n_heads=6, d_ff=198, seq_len=31, vocab_size=67, n_layers=2)
STEPS, BATCH = 3, 8


def test_fuse_and_split_are_inverse():
    w = init_weights(CFG)
    split = tpt.split_qkv(w)
    assert "blocks.0.attn.q.weight" in split and "blocks.0.attn.qkv.weight" not in split
    assert split["blocks.1.attn.v.bias"].shape == (66,)
    back = tpt.fuse_qkv(split)
    assert sorted(back) == sorted(w) and all(np.array_equal(back[k], w[k]) for k in w)


def test_split_attention_computes_the_same_logits():
    torch.manual_seed(0)
    model = torch_gpt(CFG, seed=0)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    before = model(x)
    tpt.split_attention_(model)
    assert isinstance(model.blocks[0].attn, tpt.TPAttention)
    torch.testing.assert_close(model(x), before, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cfg,tp,says", [
    (GPTConfig(d_model=66, n_heads=3, d_ff=198), 2, "n_heads(3)"),
    (GPTConfig(d_model=64, n_heads=4, d_ff=199), 2, "d_ff(199)"),
    (GPTConfig(d_model=64, n_heads=4, d_ff=198), 4, "d_ff(198)"),
])
def test_tp_degrees_that_do_not_cut_whole_heads_are_refused(cfg, tp, says):
    with pytest.raises(ValueError) as err:
        tpt.check_tp(cfg, tp)
    assert f"tp({tp}) must divide" in str(err.value) and says in str(err.value)
    tpt.check_tp(cfg, 1)


@pytest.fixture(scope="module")
def two_d():
    out = course_lib.run(tpt.train_2d, CFG, 2, 2, steps=STEPS, batch=BATCH, world_size=4)
    return out, tpt.train_2d(CFG, 1, 1, steps=STEPS, batch=BATCH)


def test_2d_matches_one_process(two_d):
    out, ref = two_d
    for r in range(4):
        np.testing.assert_allclose(out[r]["losses"], ref["losses"], rtol=0, atol=1e-5)
        for k, w in ref["weights"].items():
            np.testing.assert_allclose(out[r]["weights"][k], w, rtol=0, atol=1e-5, err_msg=k)
    assert ref["losses"][-1] < ref["losses"][0]


def test_every_collective_runs_on_a_named_mesh_dim(two_d):
    out, _ = two_d
    led = out.ledger.filter(step=tuple(range(STEPS)))   # the training steps (set-up and the final gather aside)
    assert {r.axis for r in led} == {"dp_shard", "tp"}
    assert {r.op for r in led.filter(axis="tp")} == {"all_reduce"}
    assert {r.op for r in led.filter(axis="dp_shard")} == {"all_gather", "reduce_scatter"}
    per_step = led.filter(rank=0, step=STEPS - 1)
    assert per_step.filter(axis="tp").counts()["all_reduce"] == 6 * CFG.n_layers   # 2 forward + 4 backward


def test_bytes_per_dim_equal_the_formula(two_d):
    out, _ = two_d
    want = tpt.formula_by_axis(out[0]["units"], 2, 2, batch=BATCH // 2, seq=CFG.seq_len, d_model=CFG.d_model,
                               n_layers=CFG.n_layers)
    for r in range(4):
        got = tpt.ledger_by_axis(out.ledger, rank=r, step=STEPS - 1)
        assert {k: round(got[k] / want[k], 3) for k in want} == {"dp_shard": 1.0, "tp": 1.0}, (r, got, want)
