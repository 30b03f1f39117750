"""Compile Lab 05's FSDP train step and read its schedule: sync collectives, or async start/done pairs
with compute in between (:mod:`course_lib.comm.hlo_schedule`)?

    python -m course_lib bench xla-overlap [--devices 8] [--platform cpu|cuda] [--out DIR]

The step is compiled on *abstract* inputs (shapes, dtypes and shardings; no array is ever made), so it
compiles for devices that only need to be described, not present: ``--platform cuda`` with fewer than
``--devices`` GPUs attached compiles for a compile-only GPU topology (``jax.experimental.topologies``,
``1x1xN``, described by ``--target-config`` or by the first attached GPU), which needs jaxlib's CUDA
plugin and its compiler (``ptxas``); no GPU needs to run anything. Each variant of the GPU compiler's
scheduling flags is compiled once (:data:`GPU_VARIANTS`); with ``--out`` every compiled module's text
is written there with a ``summary.json``.

Flags checked in jaxlib 0.10.2 (``compile(compiler_options=...)`` refuses an unknown one with "No such
compile option"): ``xla_gpu_enable_latency_hiding_scheduler``, ``xla_gpu_disable_async_collectives``,
``xla_gpu_enable_pipelined_all_gather`` exist; the older ``xla_gpu_enable_async_all_gather`` /
``..._reduce_scatter`` / ``..._all_reduce`` do not any more (async is the default; the knob is the
``disable`` list). :func:`known_options` asks the installed XLA.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["OPTIONS", "GPU_VARIANTS", "COMPILE_ONLY", "known_options", "abstract_step", "compile_variants", "main"]

#: GPU scheduling flags the lab talks about, with a value to probe them with
OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_disable_async_collectives": "ALLGATHER",
           "xla_gpu_enable_pipelined_all_gather": True, "xla_gpu_enable_pipelined_reduce_scatter": True,
           "xla_gpu_enable_async_all_gather": True, "xla_gpu_enable_async_reduce_scatter": True,
           "xla_gpu_enable_async_all_reduce": True, "xla_gpu_enable_async_collectives": True}
#: what the GPU compile is asked for: its defaults, the latency-hiding scheduler off, async collectives off
GPU_VARIANTS = {"default": {},
                "no latency-hiding scheduler": {"xla_gpu_enable_latency_hiding_scheduler": False},
                "async collectives disabled": {"xla_gpu_disable_async_collectives": "ALLREDUCE,ALLGATHER,REDUCESCATTER"}}
#: a compile-only GPU has nothing to autotune on: XLA's defaults (autotuning, shared across hosts) can hang there
COMPILE_ONLY = {"xla_gpu_autotune_level": 0, "xla_gpu_shard_autotuning": False}


def known_options(options=OPTIONS) -> dict[str, bool]:
    """``{option: whether this jaxlib's XLA accepts it}``, from one tiny compile per option."""
    import jax
    import jax.numpy as jnp
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(1))
    out = {}
    for key, value in options.items():
        try:
            lowered.compile(compiler_options={key: value})
            out[key] = True
        except Exception as exc:  # JaxRuntimeError("INVALID_ARGUMENT: No such compile option: ...")
            if "No such compile option" not in str(exc):
                raise
            out[key] = False
    return out


def abstract_step(mesh, cfg, batch: int, tx=None, rule=None):
    """Lab 05's jit FSDP step (``fsdp_jax.loss_fn``, AdamW, ``pin``) lowered on abstract inputs sharded on
    ``mesh``: returns the ``Lowered``; ``.compile(options)`` it. ``batch`` rows, cut on the ``fsdp`` axis."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from course_lib.models import flax_gpt
    from course_lib.strategies.fsdp import jax as fsdp_jax
    rule = rule or fsdp_jax.fsdp_spec
    tx = tx or optax.adamw(3e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    if batch % mesh.size:
        raise ValueError(f"batch={batch} must be a multiple of the mesh's {mesh.size} devices (rows are cut evenly)")

    def shaped(tree):           # ShapeDtypeStructs that carry the rule's sharding: no array is made
        sh = fsdp_jax.shardings(mesh, fsdp_jax.state_specs(tree, mesh.size, rule))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    model_def, model_state = nnx.split(nnx.eval_shape(lambda: flax_gpt(cfg, seed=0)))
    opt_def, opt_state = nnx.split(nnx.eval_shape(lambda: nnx.Optimizer(flax_gpt(cfg, seed=0), tx, wrt=nnx.Param)))

    @jax.jit
    def step(ms, os, x, y):
        model, opt = nnx.merge(model_def, ms), nnx.merge(opt_def, os)
        loss, grads = nnx.value_and_grad(fsdp_jax.loss_fn)(model, x, y)
        opt.update(model, grads)
        fsdp_jax.pin(model, opt, mesh=mesh, rule=rule)
        return nnx.state(model), nnx.state(opt), loss
    rows = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32, sharding=NamedSharding(mesh, P(fsdp_jax.AXIS)))
    return step.lower(shaped(model_state), shaped(opt_state), rows, rows)


def _gpu_target_config() -> str:
    """A ``GpuTargetConfigProto`` (text) describing the first attached GPU, from torch's device properties.
    torch does not report the memory bandwidth or clock: an H200's 4.8 TB/s and 1.98 GHz stand in (XLA's cost
    model reads them)."""
    import torch
    p = torch.cuda.get_device_properties(0)
    sm = getattr(p, "shared_memory_per_multiprocessor", 233472)
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: {getattr(p, "warp_size", 32)}
  shared_memory_per_block: {getattr(p, "shared_memory_per_block", 49152)}
  shared_memory_per_core: {sm}
  threads_per_core_limit: {getattr(p, "max_threads_per_multi_processor", 2048)}
  core_count: {p.multi_processor_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: {getattr(p, "L2_cache_size", 52428800)}
  clock_rate_ghz: 1.98
  device_memory_size: {p.total_memory}
  shared_memory_per_block_optin: {getattr(p, "shared_memory_per_block_optin", 232448)}
  cuda_compute_capability {{
    major: {p.major}
    minor: {p.minor}
  }}
  registers_per_core_limit: {getattr(p, "regs_per_multiprocessor", 65536)}
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{p.name}"
"""


def _devices(platform: str, n: int, target_config: str | None):
    """``(devices, how)``: ``n`` devices of ``platform``, attached or (cuda) compile-only."""
    import jax
    if platform == "cpu":
        return jax.devices("cpu")[:n], f"{n} CPU devices"
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) >= n:
        return gpus[:n], f"{n} attached GPUs ({gpus[0].device_kind})"
    import importlib.util
    plugins = ("jax_cuda13_plugin", "jax_cuda12_plugin")
    if not any(importlib.util.find_spec(m) for m in plugins):
        raise RuntimeError(f"no XLA:GPU compiler here: jaxlib's CUDA plugin ({' or '.join(plugins)}) is not installed "
                           f"and {len(gpus)} GPUs are attached; install it with pip install \"jax[cuda12]\"")
    from jax.experimental import topologies
    tried = []
    for config in ([target_config] if target_config else []) + [None, "auto"]:
        kwargs = {"topology": f"1x1x{n}"}
        if config == "auto":
            config = _gpu_target_config()
        if config:
            kwargs["target_config"] = config
        try:
            topo = topologies.get_topology_desc("fsdp-course", "cuda", **kwargs)
            kind = "described by " + ("the attached GPU" if config and not target_config else
                                      "--target-config" if config else "the plugin's default")
            return list(topo.devices)[:n], f"{n} compile-only GPUs ({kind}; topology 1x1x{n})"
        except Exception as exc:
            tried.append(f"{'target_config' in kwargs and 'with' or 'without'} a target config: "
                         f"{type(exc).__name__}: {str(exc)[:300]}")
    raise RuntimeError(f"no {n}-GPU topology to compile for ({len(gpus)} GPUs attached); tried: " + " | ".join(tried))


def compile_variants(platform: str = "cpu", n: int = 8, target_config: str | None = None, cfg=None,
                     batch: int = 32) -> dict:
    """Compile Lab 05's step for ``n`` devices of ``platform`` under each variant (CPU: one, with
    ``fsdp_jax.compile_options``). Returns ``{"devices": how, "jax": version, "variants": {name: text}}``."""
    import jax
    from jax.sharding import AxisType

    from course_lib.models import GPTConfig
    from course_lib.strategies.fsdp import jax as fsdp_jax
    cfg = cfg or GPTConfig(vocab_size=512, seq_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256)  # Lab 05's
    devices, how = _devices(platform, n, target_config)
    mesh = jax.make_mesh((n,), (fsdp_jax.AXIS,), axis_types=(AxisType.Auto,), devices=devices)
    lowered = abstract_step(mesh, cfg, batch)
    variants = {"default": fsdp_jax.compile_options(mesh)} if platform == "cpu" else GPU_VARIANTS
    if "compile-only" in how:
        variants = {name: {**COMPILE_ONLY, **options} for name, options in variants.items()}
    texts = {}
    for name, options in variants.items():
        try:
            texts[name] = lowered.compile(options or None).as_text()
        except Exception as exc:
            texts[name] = f"# compile failed: {type(exc).__name__}: {str(exc)[:500]}"
    return {"devices": how, "jax": jax.__version__, "variants": texts}


def main(argv=None) -> int:
    from course_lib.comm import hlo_schedule
    ap = argparse.ArgumentParser(prog="python -m course_lib bench xla-overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--platform", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--target-config", type=Path, help="GpuTargetConfigProto text for a compile-only GPU topology")
    ap.add_argument("--out", type=Path, help="write each compiled module's text and summary.json here")
    a = ap.parse_args(argv)
    if a.platform == "cpu":
        from course_lib.runtime.devices import setup_jax
        setup_jax(a.devices)
    print("options this jaxlib accepts:", ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in known_options().items()))
    res = compile_variants(a.platform, a.devices, a.target_config.read_text() if a.target_config else None)
    print(f"jax {res['jax']}, Lab 05's FSDP step compiled for {res['devices']}")
    out = {"devices": res["devices"], "jax": res["jax"], "variants": {}}
    for name, text in res["variants"].items():
        if text.startswith("# compile failed"):
            print(f"{name}: {text[2:]}")
            continue
        s = hlo_schedule.summary(text)
        out["variants"][name] = s
        print(f"{name}: " + "; ".join(f"{k} sync {v['sync']}, async pairs {v['pairs']} ({v['overlapped']} with compute "
                                       "inside)" for k, v in s.items()))
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / f"{a.platform}_{name.replace(' ', '_')}.hlo.txt").write_text(text)
    if a.out:
        (a.out / "summary.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
