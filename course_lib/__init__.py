"""course_lib: the small library behind the fsdp-course labs, in layers.

A module imports its own layer and the layers its layer may import, nothing else. The layers, their order and
what each may import are stated once, in ``tests/test_layers.py`` (``LAYERS``, ``MAY_IMPORT``; the test also sees
lazy and string imports, cycles and private names borrowed across modules). Here, lowest first, is where each
module lives::

  runtime/     devices (backend choice, JAX simulated devices), netns (two "nodes" on one machine), imports
               (heavy imports with the garbage collector paused and frozen: a quicker start), errors (the one
               walk of an error's causes, groups and DCP's per-rank failures)
  comm/        ledger (record types), shim (flat all-gather / reduce-scatter), collectives (all-reduce from
               its halves), torch_ledger (c10d-level capture), jax_ledger (collectives from compiled HLO),
               hlo_schedule (a compiled module's schedule: sync collectives or async pairs with compute inside)
  maths/       strategy (which strategy shards what: the one table), sharding (padding), costs (bytes per
               collective and step, α-β), memory (bytes per rank), ownership, traffic, step_model (step
               time from α, β and FLOP/s), flops (FLOPs per token: MFU's one numerator), schedule (the LR
               warm-up), planner (real models on real clusters), planner_hw (GPU and link rates, cited: the one
               table of GPU peaks), planner_work (FLOPs and bytes per token and op), planner_host (the host's
               time: dispatches per step x seconds per dispatch), planner_dims (pipeline and context
               parallel: bubble, p2p, ring; a step composed with FSDP x TP), planner_moe (expert parallel:
               MoE parameters, FLOPs, all-to-all bytes), planner_runs (published runs: calibration,
               validation and held-out sets), planner_course_runs (the capstone measured on a lent H200: the planner
               judged by the course's own GPU runs)
  launch/      pool (run a notebook function on N ranks), preflight (run()'s checks; run under torchrun),
               forkserver (the torch and the jax fork server; which one a call needs), preload (a fork server's
               imports), store_dirs (where ranks meet), verdict (a failed call's error), rank (the rank side),
               results, stacks (every rank's stack when a call hangs), magic (``%%ranks``: a cell on every rank),
               cell_output (the ranks' output, labelled: live, then grouped), kernel_exit (a kernel that ran
               ranks shuts down at once)
  models/      config (sizes, NumPy weights), torch_gpt, flax_gpt, data (TokenTask), names (the canonical
               tensor names, adapters from other models')
  measure/     memory (live bytes on a rank), ownership (who holds which slice of a real sharded model),
               fingerprint (a parameter's exact bits in 8 bytes: drifted replicas), nonfinite (where a NaN/inf
               was born: a forward hook on every module), dispatches (torch ops of a step, counted)
  strategies/  one folder per parallelism, torch and JAX side by side:
               dp/ {torch}, zero/ {torch}, fsdp/ {scratch, torch, jax}, hsdp/ {torch, jax}, tp/ {torch, jax},
               pp/ {schedule (GPipe and 1F1B orders, their timeline and bubble), torch (send/recv and pipelining), jax},
               cp/ {torch (ring attention with send/recv; torch's context_parallel probed), jax (ring with ppermute)},
               ep/ {routing (top-k, capacity, the dispatch matrix), torch (all_to_all_single), jax (all_to_all)}
  checkpoint/  dcp (torch DCP: save / load / reshard), orbax (JAX), commit (write, commit by one rename,
               verify), manager (numbered steps, the last K kept, faults agreed), owner (one writer per folder:
               an fcntl lock), resumable (a run whose whole state saves), safetensors (one file for torch and
               Flax under the canonical names)
  checks/      core (✅ ⏳ ❌, hints), compare (tolerances, likely mistakes), predict, registry (each exercise
               declared once), judge (each check as a run half and a judge half), plain (the plain data between
               them), fsdp_harness (Lab 03: the learner's class trained on ranks; DDP's numbers in the judge),
               lab00 ... labNN, lab04_grads (Lab 04's gradient accumulation and clipping exercise), lab06_tp (Lab 06's
               PyTorch tensor-parallel exercise), lab07_judge, lab07_orbax,
               lab07_crash (Lab 07's judge halves, its Orbax exercise, a rank's crash as plain data)
  widgets/     base, ownership (who owns which slice), traffic (what each collective moved), timeline_svg,
               dimensions (Lab 10: a pipeline's timeline, an all-to-all's matrix)
  authoring/   labs (solution -> lab), validate, run (run-solutions), nbgrader (each lab as an nbgrader
               source notebook), lab_time (each lab's stated run time)
  bench/       wire (bytes on the wire, α-β sweep), launch, launch_kernel (fresh kernel: course vs accelerate), fsdp (ours vs FSDP2 vs DDP), step_time
               (predicted vs measured), timeline (profiler trace: overlap), progress (bars and clocks for long
               cells), gpu_mfu, frameworks (torch eager / compiled / JAX on one
               GPU, each predicted first), two_node +
               two_node_worker (torchrun across two network namespaces), labs (each lab's
               seconds against its stated time), host (seconds per dispatch: the planner's host term),
               offload (FSDP2's CPU offload on one GPU), weak_scaling (DDP vs FSDP2, the batch per rank
               fixed), xla_overlap (Lab 05's step compiled for CPU or a compile-only GPU topology: its schedule)
  apps/        cli (``python -m course_lib``), train, train_jax, train_config (their flags, checked
               before any rank trains), torchrun (torchrun, with those flags checked before any worker starts
               and a quiet exit), torchrun_demo, site (the course as a static website), slurm (the Slurm
               batch scripts' preflight: the job's shape from Slurm's environment, checked before srun),
               jax_peers (a JAX process that vanished, named before XLA aborts),
               grading/ (grade a class: intake, sandbox, box, kernel, limits, guard, verdicts, report, grade)

Outside the layers: this module (the public API below) and the entry aliases at the root -- ``__main__``,
``train``, ``train_jax``, ``torchrun``, ``torchrun_demo`` -- which hand over to ``apps`` so ``python -m course_lib.train``
keeps working. Vocabulary (sharded parameter, all-gather output, padding, unit, payload V) is defined once,
in :mod:`course_lib.maths.sharding` and :mod:`course_lib.comm.ledger`.

Importing this package imports neither torch's distributed machinery nor JAX, so a lab can set the
number of simulated JAX devices after ``import course_lib``. In a Jupyter kernel it pauses the garbage collector
until the end of the cell that imports it (every lab's first cell, which imports torch and JAX next), then
freezes what that cell imported: :func:`course_lib.runtime.imports.quicker_first_cell`.
"""
from course_lib.runtime import imports as _imports

_imports.quicker_first_cell()   # in a Jupyter kernel: the rest of this cell's imports, the collector paused

from course_lib.launch import LaunchTimeout, RankError, rank_info, run, shutdown  # noqa: E402
from course_lib.comm.ledger import CollectiveRecord, Ledger
from course_lib.runtime.devices import banner, choose_backend, describe, setup_jax
from course_lib.launch.magic import in_notebook_setup as _in_notebook_setup, load_ipython_extension  # noqa: E402

_in_notebook_setup()   # in IPython: %%ranks registered; in a kernel the fork server starts now, in the background

__all__ = [
    "run", "rank_info", "shutdown", "RankError", "LaunchTimeout",
    "Ledger", "CollectiveRecord",
    "setup_jax", "choose_backend", "describe", "banner",
]
