"""Test-only: hold a checkpoint save open so a test can kill a process *during* it (tests/test_train_faults.py).

Put this folder first on ``PYTHONPATH`` and set ``COURSE_TEST_SAVE_GATE=<folder>`` (and, for JAX,
``COURSE_TEST_SAVE_GATE_PROCESS=<id>``, the one process to hold): the save begins (DCP: each rank writes 100
bytes of its file; Orbax: the process writes its part, short of the commit barrier), then the writer touches
``<folder>/saving.<who>`` and waits forever -- a save in flight, as on a slow disk, with no timing luck needed. ``COURSE_TEST_SAVE_GATE_STEP=<n>`` gates only step ``n`` (the earlier saves complete). Nothing in
course_lib knows of it; without the variable this file does nothing.
"""
import os

_GATE = os.environ.get("COURSE_TEST_SAVE_GATE")


def _hold(who: str) -> None:
    import time
    open(os.path.join(_GATE, f"saving.{who}"), "w").close()
    while True:
        time.sleep(1)


def _gate_dcp() -> None:
    """torch DCP: each worker's ``FileSystemWriter.write_data`` of the gated step writes 100 bytes, then holds."""
    from torch.distributed.checkpoint import filesystem
    write_data = filesystem.FileSystemWriter.write_data
    step = int(os.environ.get("COURSE_TEST_SAVE_GATE_STEP", -1))

    def gated(self, plan, planner):
        if step < 0 or f"step_{step:08d}" in os.fspath(self.path):
            rank = os.environ.get("RANK", "0")
            with open(os.path.join(self.path, f"__{rank}_0.distcp"), "wb") as f:
                f.write(bytes(100))
            _hold(f"rank{rank}")
        return write_data(self, plan, planner)
    filesystem.FileSystemWriter.write_data = gated


def _gate_orbax() -> None:
    """Orbax: the gated process writes its part of the gated step (``<step>.orbax-checkpoint-tmp*`` holds it),
    then its background save thread holds before the barrier where every process reports its write complete --
    so the step is never committed; the other process waits at that barrier for this one."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer as ac
    wait = ac._background_wait_for_commit_futures
    step = os.environ.get("COURSE_TEST_SAVE_GATE_STEP")

    def gated(directory, commit_futures, *a, **kw):
        if step is None or os.fspath(directory).rstrip("/").rpartition("/")[2].split(".")[0] == step:
            for f in commit_futures:
                f.result()
            _hold(f"process{os.environ['COURSE_TEST_SAVE_GATE_PROCESS']}")
        return wait(directory, commit_futures, *a, **kw)
    ac._background_wait_for_commit_futures = gated


if _GATE:
    if "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:   # a torchrun worker, not the agent
        _gate_dcp()
    elif os.environ.get("COURSE_TEST_SAVE_GATE_PROCESS"):
        _gate_orbax()
