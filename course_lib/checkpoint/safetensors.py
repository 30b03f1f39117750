"""One file for everyone: a sharded checkpoint (DCP or Orbax) -> one ``model.safetensors`` that torch and Flax load.

safetensors (Hugging Face, https://github.com/huggingface/safetensors) is the format the ecosystem exchanges
weights in: an 8-byte little-endian header length, a JSON header (per tensor: ``dtype``, ``shape``,
``data_offsets`` into the data region; plus ``__metadata__``, string -> string only), then the raw bytes of
every tensor, contiguous, no pickle. The words are :mod:`~course_lib.checkpoint.dcp`'s, plus:

* **canonical names** -- the course's torch ``state_dict`` names and layout (``blocks.0.attn.qkv.weight``
  [3C, C], :func:`~course_lib.models.config.weight_shapes`). Every file this module writes uses them, in
  float32, whatever wrote the checkpoint; Flax's ``kernel`` [in, out] is transposed on the way in and out.
* **name adapter** -- ``names`` (a dict or a ``str -> str`` function) renames a source's tensors, then
  ``transform`` (a ``dict -> dict`` function, e.g. :func:`fuse_qkv`) reshapes the set, so a model with other
  FQNs (a tensor-parallel model's separate ``q``, ``k``, ``v``) is written under canonical names
  (:mod:`~course_lib.models.names`).
* **the header's metadata** -- ``format: pt`` (what Hugging Face loaders look for) and three JSON strings:
  ``gpt_config``, ``source`` (framework, format, source dtype) and ``tensors`` (name -> shape, dtype, and the
  CRC-32 of its bytes: safetensors itself has no checksum, so a flipped data byte would load silently).

:func:`verify` refuses a damaged or mismatched file with every problem named (tensor, shapes, the fix).
Importing this module imports neither JAX nor safetensors (torch comes with :mod:`course_lib.models`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from course_lib.models.config import GPTConfig, weight_shapes
from course_lib.models.names import adapt, flax_to_torch_names, fuse_qkv, split_qkv  # noqa: F401 (re-exported)

__all__ = ["SafetensorsError", "Header", "read_header", "verify", "save_weights", "from_dcp", "from_orbax",
           "flax_to_torch_names", "fuse_qkv", "split_qkv", "load_weights", "load_torch", "load_flax", "flax_logits"]

_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class SafetensorsError(ValueError):
    """A safetensors file that is damaged or does not fit the model: names the file, tensors, shapes and the fix."""


@dataclasses.dataclass(frozen=True)
class Header:
    """What the JSON header of a safetensors file says, read without touching the tensor bytes."""

    tensors: dict      #: name -> {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, file order
    metadata: dict     #: ``__metadata__``: str -> str, as written
    config: dict | None   #: ``gpt_config`` decoded (None for a file from elsewhere)
    source: dict | None   #: ``source`` decoded: framework, format, dtype
    crc32: dict        #: name -> CRC-32 recorded at save (empty for a file from elsewhere)
    data_start: int    #: byte offset of the data region: 8 + header length
    file_bytes: int


def read_header(path) -> Header:
    """Parse and check the file's structure: the length field, the JSON, each tensor's byte span against its
    shape and dtype, and the data region against the file size (a truncated file fails here, by name)."""
    path = Path(path)
    size = path.stat().st_size

    def bad(what):
        return SafetensorsError(f"{path.name}: {what}. Fix: write it again from the checkpoint (from_dcp / from_orbax)")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length that starts a safetensors file: truncated")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise bad(f"the header length field says {n:,} bytes but only {size - 8:,} follow it: the file is "
                      "truncated or its first 8 bytes are damaged")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        assert isinstance(header, dict), "not a JSON object"
    except (UnicodeDecodeError, json.JSONDecodeError, AssertionError) as e:
        raise bad(f"the JSON header ({n:,} bytes) does not parse ({e}): a damaged byte in the header") from None
    metadata = header.pop("__metadata__", None) or {}
    data_bytes, problems = size - 8 - n, []
    for name, t in header.items():
        try:
            b, e = t["data_offsets"]
            want = math.prod(t["shape"]) * _DTYPES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            problems.append(f"{name}: entry {t!r} is not a tensor entry (dtype, shape, data_offsets)")
            continue
        if e - b != want:
            problems.append(f"{name}: {t['dtype']} {t['shape']} needs {want:,} bytes but data_offsets {[b, e]} "
                            f"span {e - b:,}")
        elif e > data_bytes:
            problems.append(f"{name}: bytes {b:,}..{e:,} of the data region, which is only {data_bytes:,} bytes "
                            "long (truncated file)")
    if not problems and header and max(t["data_offsets"][1] for t in header.values()) != data_bytes:
        problems.append(f"the data region is {data_bytes:,} bytes but the tensors end at "
                        f"{max(t['data_offsets'][1] for t in header.values()):,}")
    if problems:
        raise bad("damaged: " + _listed(problems, 4, "; ", quote=False))
    decoded = {}
    for key in ("gpt_config", "source", "tensors"):
        try:
            decoded[key] = json.loads(metadata[key]) if key in metadata else None
        except json.JSONDecodeError as e:
            raise bad(f"metadata field {key!r} is not JSON ({e}): a damaged byte in the header") from None
    crc = {k: v["crc32"] for k, v in (decoded["tensors"] or {}).items() if "crc32" in v}
    return Header(header, metadata, decoded["gpt_config"], decoded["source"], crc, 8 + n, size)


def verify(path, cfg: GPTConfig, *, cast: bool = False, check_crc: bool = True) -> Header:
    """Refuse (``SafetensorsError``) a file that does not hold exactly ``cfg``'s tensors: every missing or extra
    name, every shape against the one ``cfg`` expects, a dtype other than float32 (``cast=True`` accepts any
    float dtype, converted on load: exact from bf16 / f16, rounded from f64), metadata of another config (every field but dropout), a CRC that does not match."""
    h = read_header(path)
    name, problems = Path(path).name, []
    # n_heads changes no shape, only how the same weights are used: the metadata is the one place to catch it.
    # dropout is training-only: a model loaded for inference may set its own.
    diff = [f"{k}: file {h.config.get(k)}, model {v}" for k, v in dataclasses.asdict(cfg).items()
            if k != "dropout" and h.config is not None and h.config.get(k) != v]
    problems += [f"written for another GPTConfig ({', '.join(diff)})"] if diff else []
    want = weight_shapes(cfg)
    missing = [k for k in want if k not in h.tensors]
    extra = [k for k in h.tensors if k not in want]
    problems += [f"missing tensor(s) [{_listed(missing, 6)}]"] if missing else []
    problems += [f"extra tensor(s) [{_listed(extra, 6)}]"] if extra else []
    problems += [f"{k}: shape {h.tensors[k]['shape']} in the file, {list(s)} for this GPTConfig"
                 for k, s in want.items() if k in h.tensors and tuple(h.tensors[k]["shape"]) != tuple(s)]
    floats = ("F32", "F16", "BF16", "F64")
    problems += [f"{k}: dtype {t['dtype']}, expected F32" + (" (or pass cast=True to convert explicitly)"
                                                             if t["dtype"] in floats else "")
                 for k, t in h.tensors.items() if t["dtype"] != "F32" and not (cast and t["dtype"] in floats)]
    if problems:
        fix = ("build the model from the file's config: GPTConfig(**read_header(path).config)" if diff
               else "write the file again from a checkpoint of this model "
               "(from_dcp / from_orbax), mapping other names with names= / transform=")
        raise SafetensorsError(f"{name} does not fit {cfg}: {_listed(problems, 6, '; ', quote=False)}. Fix: {fix}")
    if check_crc and h.crc32:
        with open(path, "rb") as f:
            for k, t in h.tensors.items():
                b, e = t["data_offsets"]
                f.seek(h.data_start + b)
                if k in h.crc32 and zlib.crc32(f.read(e - b)) != h.crc32[k]:
                    raise SafetensorsError(f"{name}: tensor {k} {t['shape']}: CRC-32 of its bytes differs from the one "
                                           "recorded at save: a damaged byte in the data. Fix: write it again")
    return h


def _listed(items, k, sep=", ", quote=True):
    """The first ``k`` items (quoted: they are names), then how many more: an error stays one readable line."""
    shown = [repr(i) if quote else i for i in items[:k]]
    return sep.join(shown) + (f" and {len(items) - k} more" if len(items) > k else "")


# -- writing --------------------------------------------------------------------------------------------
def save_weights(weights: dict, path, cfg: GPTConfig, *, source: dict, names=None, transform=None) -> Header:
    """Write ``weights`` (NumPy or torch, any float dtype) to ``path`` as float32 under canonical names, after
    ``names`` / ``transform`` (see the module docstring); checked against ``cfg`` before anything is written."""
    from safetensors.numpy import save_file
    weights = adapt(weights, names, transform)
    src_dtypes = sorted({str(getattr(w, "dtype", "?")).removeprefix("torch.") for w in weights.values()})
    arrays = {k: np.ascontiguousarray(_to_numpy(w), dtype=np.float32) for k, w in weights.items()}  # own copies
    want = weight_shapes(cfg)
    problems = ([f"missing {sorted(want.keys() - arrays.keys())}"] if want.keys() - arrays.keys() else []) + \
        ([f"not in the course GPT {sorted(arrays.keys() - want.keys())}"] if arrays.keys() - want.keys() else []) + \
        [f"{k}: shape {list(a.shape)}, {list(want[k])} for this GPTConfig" for k, a in arrays.items()
         if k in want and a.shape != tuple(want[k])]
    if problems:
        raise SafetensorsError(f"cannot write {Path(path).name} for {cfg}: " + "; ".join(problems) + ". Fix: map the "
                               "source's names with names= (a dict or function) and transform= (e.g. fuse_qkv)")
    arrays = {k: arrays[k] for k in want}                                    # state_dict order
    meta = {"format": "pt", "gpt_config": json.dumps(dataclasses.asdict(cfg)),
            "source": json.dumps({**source, "dtype": src_dtypes}),
            "tensors": json.dumps({k: {"shape": list(a.shape), "dtype": "float32", "crc32": zlib.crc32(a.tobytes())}
                                   for k, a in arrays.items()})}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(arrays, os.fspath(path), metadata=meta)
    return read_header(path)


def _to_numpy(w):
    if isinstance(w, np.ndarray):
        return w
    if hasattr(w, "detach"):                 # torch: bf16 has no NumPy twin, so upcast first (exact)
        import torch
        return w.detach().to("cpu", torch.float32).numpy()
    return np.asarray(w)


def from_dcp(dcp_dir, path, cfg: GPTConfig, *, prefix: str | None = None, names=None, transform=None) -> Header:
    """One ``model.safetensors`` from a DCP directory, in ONE process: reads only the model's tensors (under
    ``prefix``: ``model.`` for ``{"model": ..., "optim": ...}``, ``app.model.`` for an :class:`AppState`;
    found when None) with ``dcp.load`` into whole tensors, then :func:`save_weights`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from course_lib.checkpoint.dcp import quiet_single_process, read_metadata
    md = read_metadata(dcp_dir).state_dict_metadata
    if prefix is None:
        found = [p for p in ("model.", "app.model.") if any(k.startswith(p) for k in md)]
        if not found:
            tops = sorted({k.split(".")[0] for k in md})
            raise SafetensorsError(f"{dcp_dir}: no model.* or app.model.* tensors (top-level keys {tops}); "
                                   "pass prefix= for the model's key prefix")
        prefix = found[0]
    keys = {k: v for k, v in md.items() if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in keys.items()}  # whole tensors
    with quiet_single_process():
        dcp.load(state, checkpoint_id=os.fspath(dcp_dir), no_dist=True)
    weights = {k.removeprefix(prefix): t for k, t in state.items()}
    return save_weights(weights, path, cfg, source={"framework": "torch", "format": "dcp", "prefix": prefix},
                        names=names, transform=transform)


def from_orbax(step_dir, path, cfg: GPTConfig, *, item: str = "state", subtree: str = "model", names=None,
               transform=None) -> Header:
    """One ``model.safetensors`` from an Orbax step directory (``<root>/<step>``, as
    :mod:`~course_lib.checkpoint.orbax` saves it): only ``<item>/<subtree>`` is read (a partial
    restore, as NumPy: no mesh needed), Flax names and layout become torch's, then :func:`save_weights`."""
    import jax
    import orbax.checkpoint as ocp
    from course_lib.strategies.fsdp.jax import path_name
    where = Path(step_dir).absolute() / item
    if not where.is_dir():
        raise SafetensorsError(f"{where} does not exist: pass an Orbax step directory (<root>/<step>) holding {item!r}")
    absl, level = logging.getLogger("absl"), logging.getLogger("absl").level
    absl.setLevel(logging.ERROR)              # Orbax logs "no _CHECKPOINT_METADATA" for an item directory
    try:
        ckptr = ocp.PyTreeCheckpointer()
        tree = ckptr.metadata(where)
        tree = getattr(tree, "item_metadata", tree) or tree
        if subtree not in tree:
            raise SafetensorsError(f"{where}: no {subtree!r} in the saved tree (it has {sorted(tree)}); pass subtree=")
        target = {subtree: tree[subtree]}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
        out = ckptr.restore(where, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                                partial_restore=True))
        ckptr.close()
    finally:
        absl.setLevel(level)
    flat = {path_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(out[subtree])[0]}
    return save_weights(flax_to_torch_names(flat), path, cfg, source={"framework": "jax", "format": "orbax"},
                        names=names, transform=transform)


# -- loading --------------------------------------------------------------------------------------------
def _cast(weights: dict, h: Header, cast: bool) -> dict:
    return {k: (w if h.tensors[k]["dtype"] == "F32" else w.astype(np.float32) if isinstance(w, np.ndarray)
                else w.float()) for k, w in weights.items()} if cast else weights


def load_weights(path, cfg: GPTConfig, *, cast: bool = False) -> dict:
    """Canonical float32 NumPy weights (``safetensors.numpy.load_file``), after :func:`verify`. NumPy has no
    bfloat16, so a bf16 file (``cast=True``) is read with ``safetensors.flax`` and upcast on the host."""
    h = verify(path, cfg, cast=cast)
    if any(t["dtype"] == "BF16" for t in h.tensors.values()):
        from safetensors.flax import load_file
        return {k: np.asarray(v).astype(np.float32) for k, v in load_file(os.fspath(path)).items()}
    from safetensors.numpy import load_file
    return _cast(load_file(os.fspath(path)), h, cast)


def load_torch(path, cfg: GPTConfig, *, cast: bool = False):
    """A plain ``TorchGPT`` in eval mode from the file (``safetensors.torch.load_file``), after :func:`verify`.
    Built on the meta device and filled with ``assign=True``: no random init, torch's RNG untouched."""
    import torch
    from safetensors.torch import load_file
    from course_lib.models.torch_gpt import TorchGPT
    h = verify(path, cfg, cast=cast)
    with torch.device("meta"):
        model = TorchGPT(cfg)
    model.load_state_dict(_cast(load_file(os.fspath(path)), h, cast), strict=True, assign=True)
    return model.eval()


def load_flax(path, cfg: GPTConfig, *, cast: bool = False):
    """A ``FlaxGPT`` from the file (``safetensors.numpy.load_file`` + ``flax_load_``, which transposes the
    kernels), after :func:`verify`. Built with ``nnx.eval_shape``: Flax's own random init never runs."""
    from flax import nnx
    from course_lib import models
    from course_lib.models.flax_gpt import flax_load_
    weights = load_weights(path, cfg, cast=cast)
    model = nnx.eval_shape(lambda: models.FlaxGPT(cfg, rngs=nnx.Rngs(0)))
    flax_load_(model, weights)
    model.eval()                         # dropout off, as load_torch's model.eval()
    return model


def flax_logits(model, idx) -> np.ndarray:
    """``model(idx)`` as NumPy through one ``jax.jit`` (eagerly, each op would compile a program of its own:
    seconds on CPU), with the CPU fast-compile options of :mod:`course_lib.strategies.fsdp.jax`."""
    import jax
    from flax import nnx
    from course_lib.strategies.fsdp.jax import compile_options
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, idx)
    return np.asarray(fwd.compile(compile_options(jax.devices()))(state, idx))
