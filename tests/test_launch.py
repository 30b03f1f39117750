"""The launcher: results, prints, errors, hangs, deaths, interrupts, and no leftovers -- on real gloo ranks."""
import os
import signal
import threading
import time

import pytest

from course_lib import launch
from course_lib.launch import forkserver, pool
from course_lib.launch import LaunchTimeout, RankError

# Every test here runs alone under `make test`'s two workers (root conftest.py): deadlines of a few seconds and
# start-up times. The fifty fresh launches, which count flakes, are in test_launch_flakes.py: the other worker's
# load is welcome there, and a file of their own is handed out among the others, not after the serial files.
serial = pytest.mark.serial


def _rank_sum(x):
    import torch
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}")
    return t.item() + x


def _pool_procs(world_size):
    return list(pool._POOLS[(world_size, "gloo")].procs)


@serial
def test_results_in_rank_order_and_prints_labelled(capsys):
    out = launch.run(_rank_sum, 0.5, world_size=4)
    assert list(out) == [10.5] * 4
    printed = capsys.readouterr().out
    for r in range(4):
        assert f"[rank {r}] rank {r} of 4" in printed
    assert out.backend == "gloo"
    assert [rec.op for rec in out.ledger] == ["all_reduce"] * 4
    assert sorted(rec.rank for rec in out.ledger) == [0, 1, 2, 3]


@serial
def test_function_defined_in_main_travels_by_value():
    ns = {"__name__": "__main__"}
    exec("def f(k):\n    import torch.distributed as dist\n    return dist.get_rank() * k\n", ns)
    assert ns["f"].__module__ == "__main__"
    assert list(launch.run(ns["f"], 3, world_size=3)) == [0, 3, 6]


@serial
def test_rank_info_inside_run():
    def info():
        i = launch.rank_info()
        return (i.rank, i.world_size, i.backend, i.device)
    assert launch.run(info, world_size=2) == [(0, 2, "gloo", "cpu"), (1, 2, "gloo", "cpu")]


def _what_the_rank_inherited():
    import gc
    import sys
    return gc.isenabled(), gc.get_freeze_count(), "torch._dynamo" in sys.modules


@serial
def test_ranks_inherit_the_fork_servers_imports_frozen_and_their_collector_on():
    """The fork server imported ``PRELOAD["full"]`` (dynamo among it) with the collector paused and froze it
    (launch.preload): each rank starts with it imported and still frozen (its collections skip the shared
    pages), and its collector on."""
    results = launch.run(_what_the_rank_inherited, world_size=2)
    preloaded = "torch._dynamo" in forkserver._SERVERS["torch"].modules   # "full" (the default) lists it
    assert [(on, dynamo) for on, _, dynamo in results] == [(True, preloaded)] * 2
    assert all(frozen > 100_000 for _, frozen, _ in results), results


def _raise_on_two():
    import torch.distributed as dist
    if dist.get_rank() == 2:
        raise ValueError("bad shard size 17 on rank 2")
    dist.barrier()


@serial
def test_exception_on_one_rank_names_it_with_traceback_then_recovers():
    with pytest.raises(RankError) as err:
        launch.run(_raise_on_two, world_size=4, timeout=20)
    e = err.value
    assert e.rank == 2 and e.exc_type == "ValueError"
    assert "bad shard size 17 on rank 2" in str(e) and "_raise_on_two" in e.traceback_text
    assert list(launch.run(_rank_sum, 0.0, world_size=4)) == [10.0] * 4


def _raise_on_one_after_a_barrier():
    import torch.distributed as dist
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    return dist.get_rank()


@serial
def test_a_raise_while_the_others_finish_keeps_the_ranks():
    """Every rank answered and no raise came from inside a collective: the process group is in step, the same rank
    processes serve the next call (a %%ranks cell's variables live in them)."""
    launch.run(_rank_sum, 0.0, world_size=2)
    procs = [p.pid for p in _pool_procs(2)]
    with pytest.raises(RankError, match="rank 1 raised ValueError: rank 1 gives up") as err:
        launch.run(_raise_on_one_after_a_barrier, world_size=2)
    assert "worker_main" not in str(err.value) and "worker_main" in err.value.traceback_text, str(err.value)
    assert [p.pid for p in _pool_procs(2)] == procs
    assert list(launch.run(_rank_sum, 0.0, world_size=2)) == [3.0, 3.0]


def _skip_collective():
    import torch
    import torch.distributed as dist
    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))
    return dist.get_rank()


@serial
def test_hang_ends_in_timeout_naming_stuck_ranks_and_leaves_nothing():
    launch.run(_rank_sum, 0.0, world_size=4)
    procs = _pool_procs(4)
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as err:
        launch.run(_skip_collective, world_size=4, timeout=1.5)
    assert time.monotonic() - t0 < 10
    assert "ranks 0,2,3 did not finish" in str(err.value) and "finished: 1)" in str(err.value)
    assert "rank 1 never issued it" in str(err.value) and err.value.rank == 1
    assert not any(p.is_alive() for p in procs)
    assert list(launch.run(_rank_sum, 1.0, world_size=4)) == [11.0] * 4


def _die_on_three():
    import torch.distributed as dist
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@serial
def test_rank_killed_by_signal_is_named():
    with pytest.raises(RankError) as err:
        launch.run(_die_on_three, world_size=4, timeout=20)
    assert err.value.rank == 3 and "SIGKILL" in str(err.value)
    assert list(launch.run(_rank_sum, 0.0, world_size=4)) == [10.0] * 4


def _sleep_long():
    time.sleep(60)


@serial
def test_interrupt_kills_the_pool_and_next_call_works(kernel_sigint):
    launch.run(_rank_sum, 0.0, world_size=2)
    procs = _pool_procs(2)
    # Ctrl-C in the main thread (as Jupyter's interrupt delivers it), whichever thread the test worker's
    # signal would otherwise reach: _thread.interrupt_main raises KeyboardInterrupt there
    import _thread
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        launch.run(_sleep_long, world_size=2, timeout=30)
    assert not any(p.is_alive() for p in procs)
    assert list(launch.run(_rank_sum, 0.0, world_size=2)) == [3.0, 3.0]


@serial
def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size=0"):
        launch.run(_rank_sum, 0.0, world_size=0)
    with pytest.raises(TypeError, match="needs a function"):
        launch.run(42)
    with pytest.raises(ValueError, match="timeout=-1"):
        launch.run(_rank_sum, 0.0, timeout=-1)


@serial
def test_ranks_meet_without_a_socket_or_a_name_lookup():
    """A file store (no port, no host name to resolve) and gloo bound to lo by interface name."""
    assert set(launch.run(_rendezvous, world_size=2)) == {("lo", "FileStore")}


def _rendezvous():
    import os
    import torch.distributed as dist
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):          # PrefixStore -> the store ranks met through
        store = store.underlying_store
    return os.environ.get("GLOO_SOCKET_IFNAME"), type(store).__name__


@serial
def test_auto_preload_is_minimal_plus_what_the_notebook_imported_never_jax(monkeypatch):
    """COURSE_LIB_PRELOAD=auto: torch-only work preloads torch alone; a lab that imported FSDP gets it
    preloaded; JAX never (no rank needs it); a wrong mode is named with the choices."""
    import sys
    monkeypatch.setenv("COURSE_LIB_PRELOAD", "auto")
    fsdp = "torch.distributed.fsdp"
    monkeypatch.delitem(sys.modules, fsdp, raising=False)
    assert fsdp not in forkserver.preload_modules()
    assert forkserver.preload_modules()[:len(launch.PRELOAD["minimal"])] == launch.PRELOAD["minimal"]
    monkeypatch.setitem(sys.modules, fsdp, sys)
    assert fsdp in forkserver.preload_modules()
    monkeypatch.setitem(sys.modules, "jax", sys)
    assert not [m for m in forkserver.preload_modules() + forkserver.preload_modules("full") if "jax" in m or "flax" in m]
    assert forkserver.modules_for("jax") == forkserver.preload_modules() + ["jax", "jax.numpy"]
    assert forkserver.preload_modules("full") == launch.PRELOAD["full"]
    with pytest.raises(ValueError, match="COURSE_LIB_PRELOAD='fast' must be one of"):
        forkserver.preload_modules("fast")


def _torch_parent():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.getppid(), t.item()


def _jax_parent():
    import sys
    import jax.numpy as jnp
    return os.getppid(), float(jnp.arange(3.0).sum()), "jax" in sys.modules


def _jax_by_global():
    """A notebook's function (``__main__``: sent by value) that reads a global holding ``jax.numpy``."""
    import jax.numpy
    ns = {"__name__": "__main__", "jnp": jax.numpy, "os": os}
    exec("def f():\n    return os.getppid(), float(jnp.ones(2).sum())\n", ns)
    return ns["f"]


@serial
def test_each_call_runs_on_ranks_forked_from_the_server_whose_imports_it_needs():
    """(Issue 52 item 3.) A torch call: ranks from the torch server. A call that imports JAX (in its body or through
    a global) restarts them from the jax server, which imported JAX before the fork; torch calls then run there."""
    launch.shutdown()
    out = launch.run(_torch_parent, world_size=2, fresh=True)
    torch_server = forkserver._SERVERS["torch"]
    assert [p for p, _ in out] == [torch_server.pid] * 2 and [v for _, v in out] == [2.0, 2.0]
    assert "jax" not in torch_server.modules and pool._POOLS[(2, "gloo")].kind == "torch"
    out = launch.run(_jax_parent, world_size=2)
    jax_server = forkserver._SERVERS["jax"]
    assert jax_server.pid not in (None, torch_server.pid) and "jax" in jax_server.modules
    assert out == [(jax_server.pid, 3.0, True)] * 2
    assert [p for p, _ in launch.run(_torch_parent, world_size=2)] == [jax_server.pid] * 2   # kept: they have torch
    assert launch.run(_jax_by_global(), world_size=2) == [(jax_server.pid, 2.0)] * 2


@serial
def test_the_rule_that_picks_the_server():
    """needs(): what unpickling the call on a rank would import, and the names its code uses; a %%ranks cell's
    imports. Strings that merely contain "jax" do not count."""
    import cloudpickle
    from course_lib.launch.preflight import pickle_call

    def in_body():
        from flax import nnx   # noqa: F401
    assert forkserver.needs(pickle_call(_torch_parent, (), {})) == "torch"
    assert forkserver.needs(pickle_call(_jax_parent, (), {})) == "jax"
    assert forkserver.needs(pickle_call(in_body, (), {})) == "jax"
    assert forkserver.needs(pickle_call(_jax_by_global(), (), {})) == "jax"
    assert forkserver._uses_jax(_jax_by_global()) and not forkserver._uses_jax(_torch_parent)
    assert forkserver.needs(cloudpickle.dumps(("say jax", "jaxonomy"))) == "torch"
    assert forkserver.source_needs("import torch\nx = 'jax'") == "torch"
    assert forkserver.source_needs("import torch\nif 1:\n    import jax.numpy as jnp") == "jax"
    assert forkserver.source_needs("from optax import adam") == "jax"
    assert forkserver.source_needs("x = (1,") == "torch"
    with pytest.raises(ValueError, match="kind='tpu' must be 'torch' or 'jax'"):
        forkserver.modules_for("tpu")
