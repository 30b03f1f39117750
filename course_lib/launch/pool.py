"""Run a function defined in a notebook cell on N ranks and get every rank's result back: the pool's life cycle.

``run(fn, world_size=4)`` starts N rank processes (once; later calls reuse them), initialises
``torch.distributed`` in each (gloo on CPU, NCCL with one GPU per rank when there are enough), calls
``fn(*args, **kwargs)`` on every rank and returns the N return values in rank order, plus the ledger of every
collective they issued. Prints inside ``fn`` appear in the cell, labelled ``[rank r]`` (:mod:`.cell_output`).
Inside ``fn`` use ``torch.distributed`` as usual or :func:`rank_info`.

How it avoids the traps we measured on this kind of machine:

* Ranks are forked from a fork server that imported the frameworks once, never from the kernel
  (:mod:`.forkserver`: which server a call needs); the call travels by value (:mod:`.preflight`).
* Ranks meet through a file store in a private directory: no socket listens, no port race, no name lookup.
* Process groups get a short timeout, and the notebook side has its own deadline: a rank that
  raised, died or skipped a collective ends in a :class:`RankError` / :class:`LaunchTimeout` naming
  the ranks (:mod:`.verdict`). The pool is killed, and the next call starts a fresh one, unless every rank answered
  and no raise came from inside a collective: its process group is then in step, and the ranks' state (a
  ``%%ranks`` cell's variables) stays. Interrupting the kernel kills the pool too. ``%%ranks`` limits waiting in a
  collective while no rank progresses (``stall_s``), not computing.
* Workers leave with ``os._exit`` after flushing: gloo's threads sometimes abort the process at
  interpreter exit ("terminate called without an active exception"); skipping the exit handlers
  removes that crash, so it can never surface as a failure.

Longer than ~300 lines: the pool's life cycle (start, call, collect, fail, shut down) reads best in one place.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import time

import cloudpickle

from course_lib.launch import cell_output, forkserver, kernel_exit, preflight, stacks, store_dirs, verdict
from course_lib.launch.rank import worker_main
from course_lib.comm.ledger import Ledger
from course_lib.launch.results import RUN_SPELLING, RankError, RunResult, ranks_text

DEFAULT_TIMEOUT_S = 45.0  # notebook-side deadline for one call; well under a minute
#: A limit on *waiting in a collective* (``stall_s``, what ``%%ranks`` uses by default) is reported this much before
#: the process group's own timeout, so the report -- every rank's stack -- comes before gloo's bare timeout error.
STALL_MARGIN_S = 5.0
#: After a rank raised, how long the others may go on computing to finish the call (and keep the ranks) before
#: the pool is killed; a rank that waits for a collective the failed rank never issued ends the wait at once.
ERROR_GRACE_S = 10.0
_POOLS: dict = {}         # (world_size, backend) -> _Pool, at most _MAX_POOLS kept warm
_MAX_POOLS = 2


class _Pool:
    def __init__(self, world_size: int, backend: str, server, pg_timeout_s: float, start_timeout_s: float):
        self.world_size, self.backend, self.pg_timeout_s = world_size, backend, pg_timeout_s
        self.stall_s, self.spelling, self.ended = None, RUN_SPELLING, None   # the call's; why the pool was killed
        self.conns, self.procs, self._child_ends = [], [], []
        self.kind = server.kind   # "torch" or "jax": the fork server its ranks came from (.forkserver)
        t_pool = time.time()
        self.tmpdir = store_dirs.make()
        store_path = os.path.join(self.tmpdir, "store")
        ctx = mp.get_context("forkserver")   # pipes and shared memory that travel to a forked rank
        self.progress = ctx.Array("q", 3 * world_size, lock=False)  # per rank: collectives, op, bytes
        try:  # an interrupt while forking/connecting must not leave half a pool behind
            for r in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                p = forkserver.RankProcess(target=worker_main, name=f"course_lib-rank{r}", daemon=True,
                                           args=(r, world_size, backend, store_path, 0, child, pg_timeout_s,
                                                 self.progress))
                self.conns.append(parent)
                self._child_ends.append(child)
                server.start_process(p)
                self.procs.append(p)
                child.close()
            ready = self._collect(lambda r, msg: msg[0] == "ready", start_timeout_s, what="start")
        except BaseException:
            self.kill()
            raise
        # Wall-clock milestones of this pool's start, for `bench launch`'s cold-start breakdown: the fork
        # server asked for, this pool asked for, the first rank forked (the server had finished its imports),
        # every rank through the rendezvous and init_process_group.
        self.main_threads = {r: m[2].get("thread") for r, m in ready.items()}   # whose stack a hang reports
        self.startup = {"fork_server_asked": server.asked or t_pool, "pool_asked": t_pool,
                        "first_rank_forked": min(m[2]["enter"] for m in ready.values()),
                        "last_rank_forked": max(m[2]["enter"] for m in ready.values()),
                        "all_ranks_ready": max(m[2]["ready"] for m in ready.values())}

        store_dirs.remove_stale()  # any rank of an earlier, killed pool has had this whole start to leave

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def _collect(self, is_final, timeout_s: float | None, what: str):
        """Read every rank's messages until each sent a final one; print output as it arrives.

        ``timeout_s``: a wall limit (None: none). During a call, ``self.stall_s`` (set by :meth:`call`): end it when
        some rank waits in a collective (it issued more than another rank) and no rank's count of collectives moved
        for that long."""
        stall_s = self.stall_s if what == "call" else None
        finals: dict[int, tuple] = {}
        errors: dict[int, tuple] = {}
        dead: dict[int, int] = {}
        deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
        grace_deadline = None
        self._stalled = False
        counts, last_change = None, time.monotonic()
        first_error = float("inf")
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(finals) + len(errors) + len(dead) < self.world_size:
            now = time.monotonic()
            limit = min(deadline, grace_deadline) if grace_deadline else deadline
            if now >= limit:
                break
            waiting = [c for c, r in by_conn.items() if r not in finals and r not in errors and r not in dead]
            waiting += [s for s, r in by_sentinel.items() if r not in finals and r not in errors and r not in dead]
            cell_output.tick()   # %%ranks: stream the lines that waited long enough
            for ready in mpc.wait(waiting, timeout=min(0.2, limit - now)):
                if ready in by_sentinel:
                    r = by_sentinel[ready]
                    conn = self.conns[r]
                    try:
                        while conn.poll():  # drain what it said before dying
                            self._handle(r, conn.recv(), finals, errors, is_final)
                    except (EOFError, OSError):
                        pass
                    if r not in finals and r not in errors:
                        self.procs[r].join(0.1)
                        dead[r] = self.procs[r].exitcode
                    continue
                r = by_conn[ready]
                try:
                    msg = ready.recv()
                except (EOFError, OSError):
                    continue  # the sentinel will tell us how it died
                self._handle(r, msg, finals, errors, is_final)
            if what == "call":
                prog = [self.progress[3 * r] for r in range(self.world_size)]
                if prog != counts:
                    counts, last_change = prog, time.monotonic()
                pending = [r for r in range(self.world_size) if r not in finals and r not in errors and r not in dead]
                # A rank waits in a collective that a failed rank never issued: no need to wait more. (Counts are
                # read 0.25 s after the error: a rank's publisher may still show its previous call's count.)
                if (errors and not dead and time.monotonic() - first_error >= 0.25
                        and verdict.stuck_after_error(errors, pending, prog)):
                    break
                if (stall_s and pending and any(prog[r] > min(prog) for r in pending)
                        and time.monotonic() - last_change >= stall_s):
                    self._stalled = True    # a rank waits in a collective and no rank made progress for stall_s
                    break
            if (errors or dead) and grace_deadline is None:
                first_error = time.monotonic()
                # Others are probably blocked in a collective with the failed rank: give them a moment to report
                # their own errors, then stop waiting. Ranks still computing get longer, to finish the call.
                broken = dead or what != "call" or any(verdict.facts(e).get("in_collective", True) for e in errors.values())
                grace_deadline = time.monotonic() + (1.0 if broken else ERROR_GRACE_S)
        return self._verdict(finals, errors, dead, what, timeout_s, stall_s)

    def _handle(self, r, msg, finals, errors, is_final):
        kind = msg[0]
        if kind == "out":
            cell_output.print_labelled(r, msg[1], msg[2])
        elif kind == "error":
            errors[r] = msg[1:]
        elif is_final(r, msg):
            finals[r] = msg

    def _verdict(self, finals, errors, dead, what, timeout_s, stall_s=None):
        if not errors and not dead and len(finals) == self.world_size:
            return finals
        cell_output.flush_labelled()
        frames = {}
        if what == "call" and not errors and not dead:   # a hang: every rank's stack before the ranks go
            frames = stacks.capture(self.procs, self.tmpdir, getattr(self, "main_threads", {}))
        why = verdict.kill_reason(finals, errors, dead, self.world_size, what)
        if why:
            self.kill(why)
        raise verdict.error(finals, errors, dead, what, self.world_size, list(self.progress), timeout_s=timeout_s,
                            stall_s=stall_s if self._stalled else None, spell=getattr(self, "spelling", RUN_SPELLING),
                            frames=frames)

    def call(self, blob: bytes, timeout_s: float | None, stall_s: float | None = None,
             spelling=RUN_SPELLING) -> RunResult:
        """Run the pickled call ``blob`` (:func:`.preflight.pickle_call`) on every rank."""
        for i in range(len(self.progress)):
            self.progress[i] = 0
        self.spelling = spelling
        t0 = time.perf_counter()
        for c in self.conns:
            c.send(("run", blob))
        self.stall_s = stall_s
        finals = self._collect(lambda r, msg: msg[0] == "result", timeout_s, what="call")
        cell_output.flush_labelled()
        bad = {r: finals[r][1][1] for r in range(self.world_size) if finals[r][1][0] == "unpicklable"}
        if bad:
            r = min(bad)
            raise RankError(r, "PicklingError", f"the return value of fn on {ranks_text(sorted(bad))} could not "
                            f"be sent back: {bad[r]}. Return tensors, numbers, lists or dicts of them", "")
        out = RunResult(cloudpickle.loads(finals[r][1][1]) for r in range(self.world_size))
        out.seconds = time.perf_counter() - t0
        out.ledger = Ledger.merge(Ledger.from_dicts(finals[r][2]) for r in range(self.world_size))
        out.backend = self.backend
        return out

    def kill(self, why: str = ""):
        """Kill the ranks; ``why`` (e.g. "after the hang") is kept in ``self.ended`` for the next %%ranks cell."""
        if getattr(self, "ended", None) is None:
            self.ended = why or "(stopped)"
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(2)
        for c in self.conns + getattr(self, "_child_ends", []):
            c.close()  # a rank forked after an interrupt sees EOF during its start and leaves
        # The store's directory goes later (store_dirs says why): with the file there such a rank reaches the
        # rendezvous, sees the pipe closed and leaves.
        if getattr(self, "tmpdir", None):
            store_dirs.STALE.append(self.tmpdir)
        if _POOLS.get((self.world_size, self.backend)) is self:
            _POOLS.pop((self.world_size, self.backend), None)

    def stop(self, why: str = "by course_lib.shutdown()"):
        """Polite shutdown: ranks leave with os._exit; anything left after 2 s is killed."""
        if getattr(self, "ended", None) is None:
            self.ended = why
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(2)
        self.kill(why)
        return [p.exitcode for p in self.procs]


def run(fn, *args, world_size: int = 4, backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
        fresh: bool = False, **kwargs) -> RunResult:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results.

    Args:
        world_size: number of ranks (processes). On this 2-core course machine keep it at 2-8.
        backend: ``None`` picks NCCL when there is one GPU per rank, else gloo; ``"gloo"`` forces CPU.
        timeout: seconds the notebook waits for every rank (also the process-group timeout).
        fresh: start new rank processes instead of reusing warm ones (e.g. after changing global state).

    Raises:
        RankError: a rank raised (its traceback included) or died (the signal named).
        LaunchTimeout: ranks did not finish in ``timeout`` s; names them.
    """
    if not callable(fn):
        raise TypeError(f"run() needs a function to call on every rank, got {type(fn).__name__}: {fn!r}")
    if mp.current_process().name.startswith("course_lib-rank"):
        # We are a rank re-importing a script whose run() call is not under a __main__ guard.
        os._exit(verdict.MAIN_GUARD_EXIT)
    preflight.check_main_file()
    preflight.check_world_size(world_size)
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    if preflight.under_torchrun():
        return preflight.run_under_torchrun(fn, args, kwargs)
    return launch(fn, args, kwargs, world_size=world_size, backend=backend, timeout=timeout, fresh=fresh)


#: The pool the latest call ran on (a %%ranks cell asks whether its ranks survived the call).
LAST_POOL: list = [None]


def launch(fn, args, kwargs, *, world_size: int, backend: str | None = None, timeout: float | None,
           fresh: bool = False, stall_s: float | None = None, spelling=RUN_SPELLING, notify=None,
           pg_floor_s: float = 0.0, source: str | None = None) -> RunResult:
    """:func:`run` after its checks, for ``%%ranks`` too: ``timeout`` is a wall limit (None: none), ``stall_s`` a
    limit on waiting in a collective while no rank progresses, ``notify(text, pool)`` hears, before it happens, that warm
    ranks are stopped to make room, to get a longer process-group timeout or JAX (their variables go with them);
    ``pg_floor_s``: the least process-group timeout a pool started now gets (so a short limit now does not force a
    restart later); ``source``: a %%ranks cell's code (its imports choose the fork server too)."""
    from course_lib.runtime.devices import check_torch_version, choose_backend
    blob = preflight.pickle_call(fn, args, kwargs)
    kind = forkserver.needs(blob, source)   # which fork server: "jax" if the call names a JAX module, else "torch"
    server = forkserver.server_for(kind)    # before this process imports torch: on a cold start the imports overlap
    kernel_exit.install(shutdown)   # in a Jupyter kernel: stop the ranks and servers when it shuts down
    check_torch_version()
    b = choose_backend(world_size, prefer=backend).name
    key = (world_size, b)
    pool = _POOLS.get(key)
    # A rank may wait in a collective as long as the call may last, or the stall limit and a margin.
    pg_timeout = max(timeout or 0.0, stall_s + STALL_MARGIN_S if stall_s else 0.0)
    # The process-group timeout is fixed when a pool starts: a call that needs longer gets a new pool; a JAX call on
    # ranks forked with torch alone gets ranks forked from the jax server (a rank never imports a framework itself).
    why = None
    if pool is not None and fresh:
        why = "by run(..., fresh=True)"
    elif pool is not None and not pool.alive():
        why = "because a rank process had died"
    elif pool is not None and (pool.pg_timeout_s < pg_timeout or (kind == "jax" and pool.kind != "jax")):
        why = ("with JAX imported before the fork (this call uses JAX; theirs were forked with torch alone)"
               if kind == "jax" and pool.kind != "jax" else f"for a process-group timeout of {pg_timeout:g} s "
               f"(theirs, fixed when they started, was {pool.pg_timeout_s:g} s)")
        if notify:
            notify(f"the {world_size} ranks restart {why}: the variables of earlier %%ranks -n {world_size} "
                   "cells are gone", pool)
    if why:
        pool.stop(why)
        pool = None
    LAST_POOL[0] = pool
    try:
        if pool is None:
            while len(_POOLS) >= _MAX_POOLS:
                old = _POOLS[next(iter(_POOLS))]
                why = (f"to make room for {world_size} ranks (at most {_MAX_POOLS} world sizes stay warm)")
                if notify:
                    notify(f"the {old.world_size} warm ranks stop {why}: the variables of earlier %%ranks "
                           f"-n {old.world_size} cells are gone", old)
                old.stop(why)
            pg_timeout = max(pg_timeout, pg_floor_s)
            pool = _Pool(world_size, b, server, pg_timeout_s=pg_timeout, start_timeout_s=max(pg_timeout, 60.0))
            LAST_POOL[0] = pool
            _POOLS[key] = pool
            out = pool.call(blob, timeout, stall_s, spelling)
            out.startup = pool.startup  # this call started the ranks: how long each stage took
            return out
        return pool.call(blob, timeout, stall_s, spelling)
    except KeyboardInterrupt:
        if pool is not None:
            pool.kill("by the interrupt")
        raise


def shutdown() -> dict:
    """Stop every warm rank process (called automatically at exit); returns their exit codes."""
    codes = {key: pool.stop() for key, pool in list(_POOLS.items())}
    store_dirs.remove_stale()
    return codes


atexit.register(shutdown)
