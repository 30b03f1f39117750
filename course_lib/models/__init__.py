"""The models layer, models and data: the course GPT in torch and Flax NNX from one set of weights, and the token task.

Modules: :mod:`~course_lib.models.config` (sizes, NumPy weights), :mod:`~course_lib.models.torch_gpt`,
:mod:`~course_lib.models.flax_gpt` (JAX imported on first use), :mod:`~course_lib.models.data`
(:class:`TokenTask`, a deterministic synthetic task), :mod:`~course_lib.models.names` (the canonical tensor names,
and adapters from other models' names: imported on its own). ``from course_lib.models import ...`` reaches
all of them; importing this package imports torch (where it is installed) but not JAX. On a machine
without torch the JAX side still works; the torch names then raise an ImportError that says so.
"""
import importlib.util

from course_lib.models.config import INIT_STD, LAB_CONFIG, LN_EPS, GPTConfig, init_weights, param_count, weight_shapes
from course_lib.models.data import TokenTask
from course_lib.models.flax_gpt import flax_gpt, flax_load_, flax_to_numpy_weights

if importlib.util.find_spec("torch") is not None:
    from course_lib.models.torch_gpt import (MLP, Block, CausalSelfAttention, TorchGPT, fused_loss_fn, loss_fn,
                                             to_numpy_weights, torch_gpt, torch_init_)
_TORCH_NAMES = {"MLP", "Block", "CausalSelfAttention", "TorchGPT", "loss_fn", "fused_loss_fn", "to_numpy_weights",
                "torch_gpt", "torch_init_"}

__all__ = [
    "GPTConfig", "LAB_CONFIG", "param_count", "weight_shapes", "init_weights", "LN_EPS", "INIT_STD",
    "TorchGPT", "Block", "CausalSelfAttention", "MLP", "torch_gpt", "torch_init_", "loss_fn",
    "fused_loss_fn", "to_numpy_weights", "flax_gpt", "flax_load_", "flax_to_numpy_weights", "TokenTask",
]


def __getattr__(name: str):  # PEP 562: `models.FlaxGPT` imports JAX on first touch, not at import
    if name in _TORCH_NAMES:
        raise ImportError(f"course_lib.models.{name} needs torch, which is not installed here: "
                          f"pip install torch (the JAX side of the course works without it)")
    return getattr(importlib.import_module("course_lib.models.flax_gpt"), name)
