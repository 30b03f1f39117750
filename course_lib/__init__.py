"""course_lib: the small library behind the fsdp-course labs, in ten layers.

A module imports only its own layer and lower ones (``tests/test_layers.py`` enforces it, with no
cycles and no private names borrowed across modules). Lowest first::

  10 authoring/   labs (solution -> lab), validate, run (run-solutions), cli (python -m course_lib)
   9 bench/       wire (bytes on the wire, α-β sweep), launch, fsdp (ours vs FSDP2 vs DDP), step_time
                  (predicted vs measured step time), timeline (profiler trace: overlap), gpu_mfu,
                  two_node + two_node_worker (torchrun across two network namespaces)
   8 widgets/     base, ownership (who owns which slice), traffic (what each collective moved),
                  timeline_svg (the traffic timeline: boxes, labels, time axis)
   7 checks/      core (✅ ⏳ ❌, hints), compare (tolerances, likely mistakes), predict, lab00 ... labNN
   6 strategies/  collectives, dp, zero, fsdp (from scratch), fsdp2, fsdp_jax, hsdp, hsdp_jax,
                  checkpoint (DCP app state, reshard, consolidate), checkpoint_manager (write then
                  commit, keep last K), checkpoint_jax (Orbax), resumable (exact resume),
                  memory_meter (measured bytes), describe (ownership of real sharded models),
                  train_config (the training scripts' flags, checked before any rank trains)
   5 models/      config (sizes, NumPy weights), torch_gpt, flax_gpt, data (TokenTask)
   4 launch/      pool (run a notebook function on N ranks), rank (the rank side), results
   3 maths/       strategy (which strategy shards what: the one table), sharding (padding), costs
                  (bytes per collective and step, α-β), memory (bytes per rank), ownership, traffic,
                  step_model (step time from α, β and FLOP/s), planner (real models on real clusters),
                  planner_hw (GPU and link rates, cited), planner_work (FLOPs and bytes per token and op),
                  planner_runs (published runs: calibration and validation sets)
   2 comm/        ledger (record types), shim (flat all-gather / reduce-scatter), torch_ledger
                  (c10d-level capture), jax_ledger (collectives from compiled HLO)
   1 runtime/     devices (backend choice, JAX simulated devices), netns (two "nodes" on one machine)

Top-level modules are entry points: this one (the public API below), ``__main__`` and the scripts
run under torchrun or ``jax.distributed`` (``torchrun_demo``, ``train``, ``train_jax``). Vocabulary
(sharded parameter, all-gather output, padding, unit, payload V) is defined once, in
:mod:`course_lib.maths.sharding` and :mod:`course_lib.comm.ledger`.

Importing this package imports neither torch's distributed machinery nor JAX, so a lab can set the
number of simulated JAX devices after ``import course_lib``.
"""
from course_lib.launch import LaunchTimeout, RankError, rank_info, run, shutdown
from course_lib.comm.ledger import CollectiveRecord, Ledger
from course_lib.runtime.devices import banner, choose_backend, describe, setup_jax

__all__ = [
    "run", "rank_info", "shutdown", "RankError", "LaunchTimeout",
    "Ledger", "CollectiveRecord",
    "setup_jax", "choose_backend", "describe", "banner",
]
