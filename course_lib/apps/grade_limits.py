"""The grading kernel's launch wrapper: set resource limits, then become the kernel (``exec``).

Run by file path, not as a module, so that nothing of course_lib is imported before the limits hold::

    python .../course_lib/apps/grade_limits.py --as-bytes 4294967296 --nproc 512 -- python -m ipykernel_launcher -f CONN

* ``--as-bytes``: RLIMIT_AS, the address space of each process. Rank processes forked by ``course_lib.run``
  inherit it (it is per process, not a total). A kernel importing torch and JAX peaks near 2.1 GB here, so
  the grader's default (4 GiB) leaves room for a lab and stops a runaway allocation with a MemoryError.
* ``--nproc``: RLIMIT_NPROC, how many processes the *user* may have: a brake on fork bombs. The kernel
  ignores it when run as root; the grader's reaper (:mod:`course_lib.apps.grade_sandbox`) ends every
  process of the submission anyway.
* ``--nice``: lower the kernel's priority, so the grader's own bookkeeping stays responsive.

The process keeps its PID across ``exec``: the kernel manager's handle is the kernel itself.
"""
from __future__ import annotations

import os
import resource
import sys


def main(argv: list[str]) -> None:
    if "--" not in argv:
        sys.exit("grade_limits: usage: grade_limits.py [--as-bytes N] [--nproc N] [--nice N] -- CMD ...")
    split = argv.index("--")
    opts, cmd = argv[:split], argv[split + 1:]
    values = dict(zip(opts[::2], opts[1::2]))
    if "--as-bytes" in values:
        n = int(values["--as-bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (n, n))
    if "--nproc" in values:
        n = int(values["--nproc"])
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (n if hard == resource.RLIM_INFINITY else min(n, hard),) * 2)
    if "--nice" in values:
        os.nice(int(values["--nice"]))
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
