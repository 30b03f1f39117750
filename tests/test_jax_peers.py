"""course_lib.apps.jax_peers without a trainer: two ``jax.distributed`` processes (2 CPU devices each, gloo
collectives in a loop), one SIGKILLed. Process 1's death and -- issue 48 -- process 0's, the coordinator whose
death XLA itself sees first: the survivor prints one course_lib line naming the vanished process and exits
``PEER_LOST_EXIT`` (3), within seconds, with no XLA fatal line and no C++ stack (XLA's own E/W lines of the failed
RPC may come first: they are printed before any hook runs). The capstone's version, during an Orbax save, is in
tests/test_train_faults.py.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from course_lib.apps.jax_peers import PEER_LOST_EXIT

REPO = Path(__file__).resolve().parent.parent
PEER = """
import os, sys, time
import numpy as np
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from course_lib.apps.jax_peers import PeerWatch, initialize
pid = int(sys.argv[1])
initialize(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=pid, initialization_timeout=60,
           heartbeat_timeout_seconds=8, shutdown_timeout_seconds=8)
from jax._src.distributed import global_state
from jax.experimental import multihost_utils
watch = PeerWatch(global_state.client, pid, 2, stale_s=6, prog="peers")
print("ready", flush=True)
step = 0
try:
    while True:
        step += 1
        watch.where["step"] = step
        multihost_utils.process_allgather(np.array([step]))
        time.sleep(0.02)
except Exception:
    watch.verdict(8)   # a collective that failed because a peer is gone: the watch says so and exits (as train_jax)
    raise
"""


@pytest.mark.parametrize("victim", [0, 1], ids=["process-0-the-coordinator", "process-1"])
def test_a_vanished_peer_is_one_line_and_exit_3(tmp_path, victim):
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port)], env=env, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True) for i in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.communicate(timeout=60)[1][-3000:]
        time.sleep(1.0)                                   # both inside the collective loop
        os.killpg(procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - victim]
        _, err = survivor.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    said = [line for line in err.splitlines() if line.startswith("peers:")]
    print(f"\nvictim {victim}: survivor status {survivor.returncode} after {took:.2f} s; says {said}")
    assert survivor.returncode == PEER_LOST_EXIT and took < 15, (survivor.returncode, took, err[-3000:])
    assert len(said) == 1 and said[0].startswith(f"peers: process {victim} of 2 (pid {procs[victim].pid} on "), \
        err[-3000:]
    assert f"this process {1 - victim} was at step " in said[0] and "(exit 3)" in said[0], said[0]
    assert "Traceback" not in err and "Check failure" not in err and "terminate called" not in err, err[-3000:]
    assert not re.search(r"(?m)^F\d{4} ", err), err[-3000:]   # no XLA fatal log line, no C++ stack
