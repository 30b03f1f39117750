"""Runtime: which devices there are, which backend to use, and JAX's simulated CPU devices.

Two rules drive this module:

* torch: NCCL with one process per GPU when there are at least as many GPUs as ranks, gloo on CPU
  otherwise. FSDP2 on gloo is broken or silently wrong before torch 2.9 (reduce-scatter AVG
  returned the SUM, pytorch#162338), so older versions are refused.
* JAX: the number of simulated CPU devices must be set before JAX initialises its backends.
  ``jax.config.update("jax_num_cpu_devices", n)`` raises when it is too late, which is better than
  the silent ``XLA_FLAGS`` route; :func:`setup_jax` turns that into a message that says what to do.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

MIN_TORCH = (2, 9)
BANNER_PREFIX = "course_lib runtime:"


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def check_torch_version(version: str | None = None) -> str:
    """Return torch's version, or raise if FSDP2 on gloo cannot be trusted with it."""
    if version is None:
        version = _installed_torch_version()
    if _version_tuple(version) < MIN_TORCH:
        raise RuntimeError(
            f"torch {version} is too old for this course: it needs torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]}. FSDP2 on CPU/gloo fails outright up to 2.6, and in 2.7-2.8 "
            "reduce-scatter with AVG returns the SUM (silently wrong gradients, pytorch#162338). "
            "Fix: `make clean && make install` (installs torch==2.13.0), or pip install 'torch>=2.9'."
        )
    return version


def _installed_torch_version() -> str:
    """torch's version without importing torch when it is not imported yet (1-2 s saved on a cold start)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    from importlib import metadata
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch  # an unusual install (a source build on sys.path): ask torch itself
        return torch.__version__


def _no_gpu_device_nodes() -> bool:
    """True when the kernel exposes no NVIDIA or AMD GPU at all: then torch need not be imported to know."""
    import glob
    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg"))


def gpu_count() -> int:
    """CUDA GPUs visible to this process, without initialising CUDA (safe before forking)."""
    if "torch" not in sys.modules and sys.platform == "linux" and _no_gpu_device_nodes():
        return 0  # the launcher's cold start stays free of a torch import in the notebook process
    try:
        import torch
        # device_count() uses NVML where it can and does not create a CUDA context.
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver is "no GPU" for this course, not a crash
        return 0


@dataclass(frozen=True)
class Backend:
    """The torch.distributed backend a run will use, and why."""

    name: str          #: "nccl" or "gloo"
    device: str        #: "cuda" or "cpu"
    world_size: int
    reason: str


def choose_backend(world_size: int, prefer: str | None = None) -> Backend:
    """NCCL when there is one GPU per rank, gloo otherwise. ``prefer="gloo"`` forces CPU."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if prefer not in (None, "gloo", "nccl"):
        raise ValueError(f"prefer={prefer!r} must be None, 'gloo' or 'nccl'")
    n_gpu = gpu_count()
    if prefer == "nccl" and n_gpu < world_size:
        raise RuntimeError(
            f"prefer='nccl' needs one GPU per rank: world_size={world_size} but {n_gpu} GPU(s) visible. "
            "Fix: use fewer ranks, or prefer='gloo' to run on the CPU."
        )
    if prefer != "gloo" and n_gpu >= world_size:
        return Backend("nccl", "cuda", world_size, f"{n_gpu} GPU(s) >= {world_size} ranks: one process per GPU")
    why = "gloo requested" if prefer == "gloo" else f"{n_gpu} GPU(s) < {world_size} ranks: gloo on CPU"
    return Backend("gloo", "cpu", world_size, why)


def jax_is_initialised() -> bool:
    """True once JAX has created its backends (then the device count can no longer change)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(getattr(xla_bridge, "_backends", {}))
    except Exception:
        return True


def setup_jax(n_devices: int = 8) -> list:
    """Make JAX see ``n_devices`` devices and return them.

    On a machine with at least ``n_devices`` accelerators the real ones are used. Otherwise JAX is
    asked for ``n_devices`` simulated CPU devices, which only works before its first computation.
    Calling again with the same count is fine; a different count after initialisation is an error
    that says how to fix it.
    """
    if n_devices < 1:
        raise ValueError(f"n_devices={n_devices} must be >= 1")
    import jax

    if not jax_is_initialised():
        n_gpu = gpu_count()
        if 0 < n_gpu < n_devices:
            # Too few GPUs for the mesh: simulate on the CPU, and make the CPU JAX's default backend
            # so that jax.devices() / jax.make_mesh see the simulated devices, not the lone GPU.
            jax.config.update("jax_platforms", "cpu")
        try:
            jax.config.update("jax_num_cpu_devices", n_devices)
        except Exception as exc:  # pragma: no cover - depends on JAX internals
            raise RuntimeError(f"could not ask JAX for {n_devices} CPU devices: {exc}") from exc
    devices = jax.devices()
    if len(devices) >= n_devices and devices[0].platform != "cpu":
        return devices[:n_devices]
    cpus = jax.devices("cpu")
    if len(cpus) != n_devices:
        raise RuntimeError(
            f"JAX is already initialised with {len(cpus)} CPU device(s), but {n_devices} were asked for. "
            "The count can only be set before JAX's first computation. "
            "Fix: restart the kernel and run the setup cell first (Kernel > Restart, then run from the top)."
        )
    return cpus


def jax_summary() -> dict:
    """What JAX sees, without initialising it if it is not yet (returns {} then)."""
    if not jax_is_initialised():
        return {}
    import jax
    devs = jax.devices()
    platform_ = devs[0].platform
    return {
        "jax": jax.__version__,
        "jax_platform": platform_,
        "jax_devices": len(devs),
        "jax_simulated": platform_ == "cpu" and len(devs) > 1,
    }


def describe(world_size: int = 4) -> dict:
    """Versions, devices and the backend a ``world_size``-rank run would use (for `doctor`)."""
    import torch
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpus": gpu_count(),
        "cpu_cores": os.cpu_count(),
    }
    b = choose_backend(world_size)
    info.update(backend=b.name, backend_reason=b.reason, world_size=world_size)
    if info["gpus"]:
        info["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(info["gpus"])]
    for mod in ("jax", "flax", "optax"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    info.update(jax_summary())
    return info


def banner(world_size: int = 4) -> str:
    """One line every lab prints in its setup cell; ``run-solutions`` reads it back."""
    d = describe(world_size)
    parts = [f"backend={d['backend']}", f"ranks={world_size}", f"torch={d['torch']}"]
    if "jax_devices" in d:
        sim = " simulated" if d["jax_simulated"] else ""
        parts.append(f"jax_devices={d['jax_devices']}x{d['jax_platform']}{sim}")
    if d["gpus"]:
        parts.append(f"gpus={d['gpus']}")
    return f"{BANNER_PREFIX} " + " ".join(parts)
