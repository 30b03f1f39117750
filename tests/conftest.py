"""Shared test set-up.

JAX's CPU device count can only be set before JAX's first computation, and any test module may be the
first to touch JAX (even at collection time). So the whole pytest process asks for the course's 8
simulated devices here, before any test module is imported; tests that need another count run in a
subprocess.
"""
import os
import signal

os.environ.setdefault("OMP_NUM_THREADS", "1")

from course_lib.runtime import devices  # noqa: E402

devices.setup_jax(8)

# Wrong answers raise CheckFailed under the tests (a lab prints ❌ and falls back instead), so the
# tests can assert each diagnosis; subprocesses and nbval kernels inherit it.
os.environ.setdefault("COURSE_LIB_STRICT_CHECKS", "1")


import pytest  # noqa: E402

import reference_runs  # noqa: E402


@pytest.fixture(scope="session")
def torch_reference(tmp_path_factory):
    """The torch capstone, 2 ranks, 8 steps, never stopped (shared by the workers: tests/reference_runs.py)."""
    return reference_runs.once(tmp_path_factory, "torch", reference_runs.torch_run)


@pytest.fixture(scope="session")
def jax_reference(tmp_path_factory):
    """The JAX capstone, 2 processes x 2 devices, 8 steps, checkpoints at 4 and 8, never stopped (shared)."""
    return reference_runs.once(tmp_path_factory, "jax", reference_runs.jax_run)


@pytest.fixture
def kernel_sigint():
    """Ctrl-C as a Jupyter kernel delivers it: SIGINT raises KeyboardInterrupt in the main thread. A pytest-xdist
    worker that ran other files first may hold another SIGINT handler by then (seen in full runs of the suite:
    the simulated Ctrl-C never reached run()); this test is about run(), so it sets the kernel's handler itself."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)
