"""course_lib.checkpoint.safetensors: DCP and Orbax checkpoints -> one model.safetensors -> torch and Flax.

The course GPT with awkward sizes (vocab 67, d_ff 199, seq_len 31), trained a step so that no weight is its
init value. Runs in the pytest process (conftest sets up 8 simulated JAX devices); the 4-rank FSDP2 case is in
tests/test_checkpoint.py, beside the checkpoint it reuses.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from course_lib import models
from course_lib.checkpoint import safetensors as cs
from course_lib.checkpoint import dcp as ck

cfg = models.GPTConfig(seq_len=31, d_ff=199)


@pytest.fixture(scope="module")
def trained():
    """A TorchGPT after one AdamW step, its DCP checkpoint as an AppState (keys ``app.model.*``), a batch."""
    torch.manual_seed(0)
    model, x = models.torch_gpt(cfg, seed=3), torch.from_numpy(models.TokenTask(cfg.vocab_size, cfg.seq_len)
                                                                 .global_batch(0, 4)[0])      # [4, 31]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    models.loss_fn(model(x), x).backward()
    opt.step()
    return model.eval(), opt, x


@pytest.fixture(scope="module")
def st_file(trained, tmp_path_factory):
    model, opt, _ = trained
    d = tmp_path_factory.mktemp("st")
    ck.save({"app": ck.AppState(model, opt, rank=0)}, d / "dcp")
    cs.from_dcp(d / "dcp", d / "model.safetensors", cfg)
    return d / "model.safetensors"


def test_dcp_to_safetensors_header_documents_every_tensor(trained, st_file):
    h = cs.read_header(st_file)
    assert list(h.tensors) and set(h.tensors) == set(models.weight_shapes(cfg))
    assert h.config == {**cfg.__dict__} and h.source == {"framework": "torch", "format": "dcp",
                                                         "prefix": "app.model.", "dtype": ["float32"]}
    assert h.metadata["format"] == "pt" and all(isinstance(v, str) for v in h.metadata.values())
    table = json.loads(h.metadata["tensors"])
    assert {k: tuple(v["shape"]) for k, v in table.items()} == models.weight_shapes(cfg)
    assert {v["dtype"] for v in table.values()} == {"float32"} and {t["dtype"] for t in h.tensors.values()} == {"F32"}
    assert table["blocks.2.mlp.fc.weight"]["shape"] == [199, 66]


def test_load_torch_bit_identical_and_flax_within_1e_5(trained, st_file):
    model, _, x = trained
    back = cs.load_torch(st_file, cfg)
    assert not back.training and all(p.device.type == "cpu" for p in back.parameters())
    with torch.no_grad():
        want, got = model(x), back(x)
    assert torch.equal(got, want)                                     # same weights, same module: bit for bit
    flax = cs.load_flax(st_file, cfg)
    diff = np.abs(cs.flax_logits(flax, x.numpy()) - want.numpy()).max()
    assert diff <= 1e-5, diff                                         # other kernels: rounding differs
    assert all(np.array_equal(a, b) for a, b in zip(models.flax_to_numpy_weights(flax).values(),
                                                    models.to_numpy_weights(model).values()))


def test_model_optim_layout_and_a_wrong_prefix(trained, tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt, _ = trained
    ck.save(dict(zip(("model", "optim"), get_state_dict(model, opt))), tmp_path / "dcp")
    assert cs.from_dcp(tmp_path / "dcp", tmp_path / "m.safetensors", cfg).source["prefix"] == "model."
    w = cs.load_weights(tmp_path / "m.safetensors", cfg)
    assert all(np.array_equal(w[k], v) for k, v in models.to_numpy_weights(model).items())
    with pytest.raises(cs.SafetensorsError, match=r"cannot write x.safetensors .*missing \['blocks.0.attn.proj"):
        cs.from_dcp(tmp_path / "dcp", tmp_path / "x.safetensors", cfg, prefix="model.blocks.")


def test_fuse_and_split_qkv_round_trip_and_refusals():
    w = models.init_weights(cfg, seed=1)
    split = cs.split_qkv(w)
    assert "blocks.0.attn.qkv.weight" not in split and split["blocks.0.attn.k.weight"].shape == (66, 66)
    assert np.array_equal(split["blocks.1.attn.v.bias"], w["blocks.1.attn.qkv.bias"][132:])
    fused = cs.fuse_qkv(split)
    assert fused.keys() == w.keys() and all(np.array_equal(fused[k], w[k]) for k in w)
    tw = {k: torch.from_numpy(v) for k, v in split.items()}              # torch tensors fuse too
    assert torch.equal(cs.fuse_qkv(tw)["blocks.2.attn.qkv.weight"], torch.from_numpy(w["blocks.2.attn.qkv.weight"]))
    del split["blocks.0.attn.v.weight"]
    with pytest.raises(ValueError, match=r"blocks.0.attn.\{q,k,v\}.weight needs all three, found only \['k', 'q'\]"):
        cs.fuse_qkv(split)
    with pytest.raises(ValueError, match="has 65 rows, not a multiple of 3"):
        cs.split_qkv({"h.attn.qkv.bias": np.zeros(65, np.float32)})


def test_name_adapter_writes_a_tp_style_model_under_canonical_names(trained, tmp_path):
    """Another model's FQNs (``layers.i`` for ``blocks.i``, separate q/k/v as a tensor-parallel model keeps them,
    bf16): renamed by a function, fused by ``transform``, upcast; the file loads into a TorchGPT bit for bit."""
    model, _, x = trained
    theirs = {k.replace("blocks.", "layers."): torch.from_numpy(v).to(torch.bfloat16)
              for k, v in cs.split_qkv(models.to_numpy_weights(model)).items()}
    path = tmp_path / "tp.safetensors"
    with pytest.raises(cs.SafetensorsError, match=r"not in the course GPT \['layers.0.attn.k.bias'"):
        cs.save_weights(theirs, path, cfg, source={"framework": "torch", "format": "state_dict"})
    h = cs.save_weights(theirs, path, cfg, source={"framework": "torch", "format": "state_dict"},
                        names=lambda k: k.replace("layers.", "blocks."), transform=cs.fuse_qkv)
    assert h.source["dtype"] == ["bfloat16"] and {t["dtype"] for t in h.tensors.values()} == {"F32"}
    want = {k: torch.from_numpy(v).to(torch.bfloat16).float() for k, v in models.to_numpy_weights(model).items()}
    assert all(torch.equal(p, want[k]) for k, p in cs.load_torch(path, cfg).named_parameters())
    rename = {k: k.replace("layers.", "blocks.") for k in theirs}         # a dict of whole names works too
    path.unlink()
    cs.save_weights(theirs, path, cfg, source={"framework": "torch", "format": "state_dict"}, names=rename,
                    transform=cs.fuse_qkv)
    assert set(cs.read_header(path).tensors) == set(models.weight_shapes(cfg))


# -- refusals -------------------------------------------------------------------------------------------
def _damaged(src, tmp_path, how):
    bad = tmp_path / "model.safetensors"
    shutil.copy(src, bad)
    data = bytearray(bad.read_bytes())
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    h = cs.read_header(src)
    if how == "truncated":
        data = data[:-1000]
    elif how == "truncated header":
        data = data[:100]
    elif how == "flipped header":
        at = data.index(b'"blocks.1.mlp.fc.weight"') + 1     # blocks -> clocks: the name changes
        data[at] ^= 0x01
    elif how == "flipped brace":
        data[8] ^= 0x01                                      # the header's opening '{' -> 'z'
    elif how == "flipped data":
        b, e = h.tensors["blocks.1.mlp.fc.weight"]["data_offsets"]
        data[8 + n + (b + e) // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("how, message", [
    ("truncated", r"model.safetensors: damaged: tok_emb.weight: bytes .* of the data region, which is only [\d,]+ bytes long "
                  r"\(truncated file\).*Fix: write it again"),
    ("truncated header", r"the header length field says [\d,]+ bytes but only 92 follow it"),
    ("flipped header", r"missing tensor\(s\) \['blocks.1.mlp.fc.weight'\]; extra tensor\(s\) \['clocks.1.mlp.fc.weight'\]"),
    ("flipped brace", r"the JSON header \([\d,]+ bytes\) does not parse .*a damaged byte in the header"),
    ("flipped data", r"tensor blocks.1.mlp.fc.weight \[199, 66\]: CRC-32 of its bytes differs"),
])
def test_damaged_files_are_refused_by_name(st_file, tmp_path, how, message):
    bad = _damaged(st_file, tmp_path, how)
    with pytest.raises(cs.SafetensorsError, match=message):
        cs.load_torch(bad, cfg)
    with pytest.raises(cs.SafetensorsError, match=message):
        cs.load_weights(bad, cfg)


def test_mismatched_files_are_refused_with_shapes_and_the_fix(trained, st_file, tmp_path):
    model, _, _ = trained
    other = models.GPTConfig(seq_len=31, d_ff=200)
    with pytest.raises(cs.SafetensorsError, match=r"model.safetensors does not fit GPTConfig\(.*d_ff=200.*\): written for "
                       r"another GPTConfig \(d_ff: file 199, model 200\); .*blocks.0.mlp.fc.weight: shape \[199, 66\] in "
                       r"the file, \[200, 66\] for this GPTConfig.*Fix: build the model from the file's config"):
        cs.load_torch(st_file, other)
    heads = models.GPTConfig(seq_len=31, d_ff=199, n_heads=6)         # every shape the same: only the metadata knows
    with pytest.raises(cs.SafetensorsError, match=r"written for another GPTConfig \(n_heads: file 3, model 6\)\. Fix"):
        cs.load_flax(st_file, heads)
    cs.verify(st_file, models.GPTConfig(seq_len=31, d_ff=199, dropout=0.1))  # dropout is training-only: accepted
    w = models.to_numpy_weights(model)
    from safetensors.numpy import save_file
    plain = tmp_path / "plain.safetensors"                             # no metadata: a file from elsewhere
    save_file({k: v for k, v in w.items() if k != "head.weight"} | {"lm_head.weight": w["head.weight"]}, plain)
    with pytest.raises(cs.SafetensorsError, match=r"missing tensor\(s\) \['head.weight'\]; extra tensor\(s\) "
                       r"\['lm_head.weight'\].*Fix: write the file again .*names="):
        cs.load_weights(plain, cfg)
    half = tmp_path / "half.safetensors"
    save_file({k: v.astype(np.float16) for k, v in w.items()}, half)
    with pytest.raises(cs.SafetensorsError, match=r"blocks.0.ln1.weight: dtype F16, expected F32 \(or pass cast=True to convert"):
        cs.load_torch(half, cfg)
    back = cs.load_torch(half, cfg, cast=True)                         # explicit: upcast on load
    assert all(p.dtype == torch.float32 and torch.equal(p, torch.from_numpy(w[k].astype(np.float16).astype(np.float32)))
               for k, p in back.named_parameters())
    from safetensors.torch import save_file as save_torch
    bf16 = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in w.items()}
    save_torch(bf16, tmp_path / "bf16.safetensors")                    # NumPy has no bfloat16: Flax's loader reads it
    flax_w = models.flax_to_numpy_weights(cs.load_flax(tmp_path / "bf16.safetensors", cfg, cast=True))
    assert all(np.array_equal(flax_w[k], v.float().numpy()) for k, v in bf16.items())
    ints = tmp_path / "ints.safetensors"
    save_file({k: v.astype(np.int32) for k, v in w.items()}, ints)
    with pytest.raises(cs.SafetensorsError, match=r"dtype I32, expected F32(?! \(or)"):
        cs.load_weights(ints, cfg, cast=True)


# -- the reverse: Orbax (JAX) -> safetensors -> torch ---------------------------------------------------
def test_orbax_to_safetensors_to_torch_within_1e_5(tmp_path):
    import jax
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 JAX devices (tests/conftest.py sets them up)")
    import optax
    from jax.sharding import AxisType
    from course_lib.checkpoint import orbax as cj
    from course_lib.strategies.fsdp import jax as fsdp_jax
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    model = models.flax_gpt(cfg, seed=4)
    fsdp_jax.shard_model(model, mesh)                                  # stored sharded over 8 devices
    opt = fsdp_jax.sharded_optimizer(model, optax.adamw(1e-3), mesh)
    mngr = cj.manager(tmp_path / "orbax")
    cj.save(mngr, 7, cj.train_state(model, opt), {"data_step": 7})
    mngr.wait_until_finished()
    mngr.close()
    h = cs.from_orbax(tmp_path / "orbax" / "7", tmp_path / "j.safetensors", cfg)
    assert h.source == {"framework": "jax", "format": "orbax", "dtype": ["float32"]}
    want = models.flax_to_numpy_weights(model)
    got = cs.load_weights(tmp_path / "j.safetensors", cfg)
    assert all(np.array_equal(got[k], want[k]) for k in want)         # kernels transposed back, bit for bit
    x = models.TokenTask(cfg.vocab_size, cfg.seq_len).global_batch(1, 4)[0]
    with torch.no_grad():
        t = cs.load_torch(tmp_path / "j.safetensors", cfg)(torch.from_numpy(x)).numpy()
    flax = cs.load_flax(tmp_path / "j.safetensors", cfg)
    assert np.abs(t - cs.flax_logits(flax, x)).max() <= 1e-5
    with pytest.raises(cs.SafetensorsError, match="does not exist: pass an Orbax step directory"):
        cs.from_orbax(tmp_path / "orbax" / "8", tmp_path / "k.safetensors", cfg)
