"""Launcher fault cases that race a clock, from an independent check: timeouts that follow the call, a slow
rank named, a hang named, an interrupt during the start. The ones that do not race a clock (interrupts from
outside, bad input, nothing listening beyond loopback) are in tests/test_launch_errors.py and share the machine."""
import os
import signal
import time

import pytest

from course_lib import launch
from course_lib.launch import LaunchTimeout
from course_lib.launch import pool

# Runs alone under `make test`'s two workers (root conftest.py): a slow rank against a 1 s deadline,
# an interrupt mid-start. Alone, a warm 2-4 rank round trip takes about a millisecond, so deadlines of 1-1.5 s
# keep a margin of hundreds of times and cost the run less idle time (the other worker waits meanwhile).
pytestmark = pytest.mark.serial


def test_interrupt_in_process_during_start_then_next_call_works(monkeypatch, kernel_sigint):
    """Ctrl-C lands while the ranks are starting (forked, not yet ready): the half-started pool is
    killed, no rank is left, and the next call starts a fresh pool. The interrupt is sent from inside
    the start itself, so it lands there however fast this machine starts ranks (a timer could fire
    after the start had finished, and interrupt pytest instead)."""
    launch.shutdown()
    started = []
    real_collect = pool._Pool._collect

    def interrupted_collect(self, is_final, timeout_s, what):
        if what == "start" and not started:      # the first start only: the next call runs normally
            started.extend(self.procs)
            os.kill(os.getpid(), signal.SIGINT)   # Python raises KeyboardInterrupt at the next bytecode
            time.sleep(5)                         # not reached: the interrupt lands first
        return real_collect(self, is_final, timeout_s, what)

    monkeypatch.setattr(pool._Pool, "_collect", interrupted_collect)
    with pytest.raises(KeyboardInterrupt):
        launch.run(_value, 1, world_size=3, fresh=True)
    assert len(started) == 3
    assert (3, "gloo") not in pool._POOLS
    for p in started:
        p.join(5)
    assert not [p for p in started if p.is_alive()], "a rank of the interrupted start is still alive"
    assert list(launch.run(_value, 1, world_size=3)) == [1, 1, 1]


def _value(x):
    return x


def _slow_rank0(seconds):
    import time
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 0:
        time.sleep(seconds)
    t = torch.ones(3)
    dist.all_reduce(t)
    return t[0].item()


def test_each_call_gets_its_own_timeout():
    launch.run(int, world_size=2, timeout=1)  # a pool with a 1 s process-group timeout (int: nothing to import)
    assert list(launch.run(_slow_rank0, 1.6, world_size=2, timeout=30)) == [2.0, 2.0]


def test_a_slow_rank_is_named_not_the_one_that_noticed():
    """Rank 0 computes past the call's timeout before its collective: the error blames rank 0 (slow),
    not rank 1 (which noticed, waiting), and a later call with a longer timeout works on a fresh pool."""
    launch.run(_value, 0, world_size=2, timeout=30)          # a pool with a long process-group timeout
    with pytest.raises(LaunchTimeout) as e:
        launch.run(_slow_rank0, 8.0, world_size=2, timeout=1)
    msg = str(e.value)
    assert "rank 1 waits in all_reduce #1 (12 B); rank 0 never issued it" in msg, msg
    assert e.value.rank == 0
    # the stacks at the hang: rank 0 computing in its own line, rank 1 in the collective it issued
    assert e.value.waiting_on[0].endswith("in _slow_rank0: time.sleep(seconds)"), e.value.waiting_on
    assert "in _slow_rank0: dist.all_reduce(t)  (inside all_reduce)" in e.value.waiting_on[1], e.value.waiting_on
    assert list(launch.run(_slow_rank0, 0.5, world_size=2, timeout=30)) == [2.0, 2.0]


def _skip_on_rank1():
    import torch
    import torch.distributed as dist
    t = torch.ones(3)
    dist.all_reduce(t)
    if dist.get_rank() != 1:
        dist.all_reduce(t)
    return 0


def test_hang_names_the_missing_rank_and_where_the_others_wait():
    """...and carries every rank's stack, captured before the ranks were killed, within the timeout + 2 s."""
    launch.run(_value, 0, world_size=4)
    procs = list(pool._POOLS[(4, "gloo")].procs)
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as e:
        launch.run(_skip_on_rank1, world_size=4, timeout=1.5)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert "ranks 0,2,3 wait in all_reduce #2 (12 B); rank 1 never issued it" in msg, msg
    assert e.value.rank == 1
    assert took < 1.5 + 2, took
    assert not [p.pid for p in procs if p.is_alive()], "a rank outlived the hang report"
    err = e.value
    assert sorted(err.stacks) == [0, 1, 2, 3] and sorted(err.waiting_on) == [0, 1, 2, 3]
    line = _skip_on_rank1.__code__.co_firstlineno + 6             # the second all_reduce, the one ranks 0,2,3 wait in
    for r in (0, 2, 3):
        assert f'line {line}, in _skip_on_rank1\n    dist.all_reduce(t)\n' in err.stacks[r], err.stacks[r]
        assert err.stacks[r].rstrip().endswith("work.wait()"), err.stacks[r]          # the innermost frame: torch's
        assert err.waiting_on[r] == (f"tests/test_launch_faults.py:{line} in _skip_on_rank1: dist.all_reduce(t)  "
                                     "(inside all_reduce)"), err.waiting_on[r]
        assert err.frames[r][-1].name == "all_reduce" or err.frames[r][-1].code == "work.wait()"
    assert err.waiting_on[1] == "finished the call (idle)" and ", in recv\n" in err.stacks[1], err.stacks[1]
    assert f"  rank 2: tests/test_launch_faults.py:{line} in _skip_on_rank1: dist.all_reduce(t)" in msg, msg
