"""The apps layer, the top: the programs a person runs. Nothing in course_lib imports it.

* :mod:`~course_lib.apps.cli` -- ``python -m course_lib`` (doctor, validate, make-labs, run-solutions, bench);
* :mod:`~course_lib.apps.train` -- the capstone, FSDP2 / HSDP under ``torchrun``;
* :mod:`~course_lib.apps.train_jax` -- the capstone in JAX under ``jax.distributed``;
* :mod:`~course_lib.apps.train_config` -- the two scripts' flags, checked before any rank trains;
* :mod:`~course_lib.apps.slurm` -- the preflight of ``scripts/slurm/*.sbatch``: a Slurm job checked before ``srun``;
* :mod:`~course_lib.apps.torchrun_demo` -- a data-parallel all-reduce under ``torchrun``, its ledger checked;
* :mod:`~course_lib.apps.grading` -- ``python -m course_lib grade``: a class's labs graded with the course's checks,
  each in a sandbox, verdicts recorded where the checks decide them (intake, sandbox, guard, verdicts, report);
* :mod:`~course_lib.apps.site` -- ``python -m course_lib site`` (``make site``): the course as a static website.

``python -m course_lib.train``, ``.train_jax`` and ``.torchrun_demo`` are thin aliases of these, so the
commands in the README, docs/ and the labs stay short.
"""
