"""course_lib: the small library behind the fsdp-course labs.

Layers (a lower one never imports a higher one):
1. runtime  -- devices, backend choice, JAX simulated devices      (runtime.py)
2. launch   -- run a notebook function on N ranks                   (launch.py)
3. ledger   -- every collective a run issued                        (ledger.py, ledger_torch.py, ledger_jax.py)
4. maths    -- sharding/padding, communication cost, memory         (sharding.py, costs.py, memory.py)
5. models and data                                                  (models.py, data.py)
6. strategies, 7. checks, 8. widgets, 9. authoring

Importing this package imports neither torch's distributed machinery nor JAX, so a lab can set the
number of simulated JAX devices after ``import course_lib``.
"""
from .launch import LaunchTimeout, RankError, rank_info, run, shutdown
from .ledger import CollectiveRecord, Ledger
from .runtime import banner, choose_backend, describe, setup_jax

__all__ = [
    "run", "rank_info", "shutdown", "RankError", "LaunchTimeout",
    "Ledger", "CollectiveRecord",
    "setup_jax", "choose_backend", "describe", "banner",
]
