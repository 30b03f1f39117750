"""Run a function defined in a notebook cell on N ranks and get every rank's result back.

``run(fn, world_size=4)`` starts N rank processes (once; later calls reuse them), initialises
``torch.distributed`` in each (gloo on CPU, NCCL with one GPU per rank when there are enough), calls
``fn(*args, **kwargs)`` on every rank and returns the N return values in rank order, plus the
ledger of every collective they issued. Prints inside ``fn`` appear in the cell, labelled
``[rank r]``.

How it avoids the traps we measured on this kind of machine:

* Functions defined in a notebook live in ``__main__`` and cannot be pickled by reference, so the
  function and its arguments travel by value with ``cloudpickle``.
* Rank processes are forked from a *fork server* (a fresh interpreter that imported torch and
  nothing else), never from the notebook kernel, whose JAX/CUDA threads would make ``fork`` unsafe.
  Forking from a warm server is also what makes a cold start fast: torch is imported once.
* The rendezvous store is hosted by the notebook process on a port the OS picks, so two notebooks
  running at once never collide and there is no race for a "free" port.
* Process groups get a short timeout, and the notebook side has its own deadline: a rank that
  raised, died or skipped a collective ends in a :class:`RankError` / :class:`LaunchTimeout` naming
  the ranks. The pool is killed, and the next call starts a fresh one, unless every rank answered and
  no raise came from inside a collective (one rank raised, the others finished): its process group is
  then in step, and the ranks' state (a ``%%ranks`` cell's variables) stays. Interrupting the kernel
  kills the pool too. ``%%ranks`` limits waiting in a collective while no rank progresses
  (``stall_s``), not computing.
* Workers leave with ``os._exit`` after flushing: gloo's threads sometimes abort the process at
  interpreter exit ("terminate called without an active exception"); skipping the exit handlers
  removes that crash, so it can never surface as a failure.

Inside ``fn`` use ``torch.distributed`` as usual (``dist.get_rank()``, ``dist.get_world_size()``)
or :func:`rank_info`. Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) ``run`` simply calls ``fn``
on this rank, so notebook code also runs as a multi-node script.

Longer than ~300 lines: the pool's life cycle (fork server, start, call, fail, shut down) reads
best in one place; the rank side and the result types live in :mod:`.rank` and :mod:`.results`.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import shutil
import sys
import tempfile
import time

import cloudpickle

from course_lib.launch import kernel_exit, stacks
from course_lib.launch.rank import to_cpu, worker_main
from course_lib.comm.ledger import Ledger
from course_lib.launch.results import RUN_SPELLING, LaunchTimeout, RankError, RunResult

DEFAULT_TIMEOUT_S = 45.0  # notebook-side deadline for one call; well under a minute
#: A limit on *waiting in a collective* (``stall_s``, what ``%%ranks`` uses by default) is reported this much before
#: the process group's own timeout, so the report -- every rank's stack -- comes before gloo's bare timeout error.
STALL_MARGIN_S = 5.0
#: After a rank raised, how long the others may go on computing to finish the call (and keep the ranks) before
#: the pool is killed; a rank that waits for a collective the failed rank never issued ends the wait at once.
ERROR_GRACE_S = 10.0
_POOLS: dict = {}         # (world_size, backend) -> _Pool, at most _MAX_POOLS kept warm
_MAX_POOLS = 2
_STALE_DIRS: list = []    # rendezvous directories of killed pools, removed by _remove_stale_dirs
_STORE_PREFIX = "course_lib-store-"


# ---------------------------------------------------------------------------------------------
# notebook side
# ---------------------------------------------------------------------------------------------
#: What the fork server imports once for every rank (:mod:`.preload`, the garbage collector paused and frozen).
#: "full" (the default) adds FSDP2/DDP, DTensor, dynamo (which the first optimizer or DDP imports) and the
#: course's models: 4 ranks importing them on 2 cores cost 4-7 s per lab, once in the server under 1 s.
#: "auto": "minimal", plus those of "full"'s extras the notebook itself imported when the server starts (so a
#: torch-only first call pays for torch alone; JAX never). Not the default: a lab whose ranks then import FSDP
#: themselves while the notebook computes (Lab 05 starts its ranks from a thread beside JAX) was measured stuck
#: 45 s in that import on 4 ranks under nbval -n 2 (2026-11-27). "minimal" makes the first call ~0.6 s faster.
PRELOAD = {
    "minimal": ["torch", "torch.distributed", "cloudpickle", "course_lib.comm.torch_ledger"],
    "full": ["torch", "torch.distributed", "cloudpickle", "course_lib.comm.torch_ledger", "torch.distributed.fsdp",
             "torch.distributed.tensor", "torch.nn.parallel", "torch._dynamo", "torch.optim", "course_lib.models"],
}
_PRELOAD_ENV = "COURSE_LIB_PRELOAD_MODULES"   # the fork server's module list, as its environment hands it over


def preload_modules(mode: str | None = None) -> list:
    """The modules a fork server started now would import, for ``COURSE_LIB_PRELOAD`` (auto, minimal, full)."""
    mode = mode or os.environ.get("COURSE_LIB_PRELOAD", "full")
    if mode == "auto":
        return PRELOAD["minimal"] + [m for m in PRELOAD["full"] if m not in PRELOAD["minimal"] and m in sys.modules]
    if mode not in PRELOAD:
        raise ValueError(f"COURSE_LIB_PRELOAD={mode!r} must be one of ['auto', 'full', 'minimal']")
    return list(PRELOAD[mode])


def _context():
    ctx = mp.get_context("forkserver")
    # The fork server imports torch once; every rank is then a cheap fork of a process that never
    # started JAX or CUDA. COURSE_LIB_PRELOAD=auto|minimal|full picks what else it imports (see PRELOAD).
    ctx.set_forkserver_preload(["course_lib.launch.preload"])   # imports $COURSE_LIB_PRELOAD_MODULES, collector paused
    return ctx


_FORK_SERVER_ASKED = [None]  # wall time this process first asked for the fork server (cold-start breakdown)
_SERVER = {"pid": None, "modules": [], "used": False}   # the fork server this process started: what it preloads


def _start_fork_server():
    """Start the fork server now (cheap if it runs): its imports then overlap with the notebook's.

    A server no rank came from yet is restarted when the notebook has since imported more of ``PRELOAD["full"]``
    (a lab's first cell imported FSDP after ``import course_lib`` started the server): it then preloads those too."""
    import multiprocessing.forkserver
    if _FORK_SERVER_ASKED[0] is None:
        _FORK_SERVER_ASKED[0] = time.time()
    ctx = _context()
    server = multiprocessing.forkserver._forkserver
    modules = preload_modules()
    if (server._forkserver_pid is not None and server._forkserver_pid == _SERVER["pid"] and not _SERVER["used"]
            and not set(modules) <= set(_SERVER["modules"])):
        try:
            os.kill(server._forkserver_pid, signal.SIGKILL)   # still importing, or idle: nothing forked from it
        except OSError:
            pass
        server._stop()    # CPython's own: close its pipe, reap it
    os.environ[_PRELOAD_ENV] = ",".join(modules)    # read by a server started now (launch.preload), else unused
    multiprocessing.forkserver.ensure_running()     # (re)starts it if it is not running
    if server._forkserver_pid != _SERVER["pid"]:
        _SERVER.update(pid=server._forkserver_pid, modules=modules, used=False)
    kernel_exit.install(shutdown)   # in a Jupyter kernel: stop the ranks and helpers when it shuts down
    return ctx


def start_early() -> bool:
    """In a Jupyter kernel (``import course_lib``): start the fork server now, so that its imports overlap the rest
    of the cell and the learner's reading; after that cell, restart it with what the cell imported if no rank came
    from it yet. Elsewhere (a script, a rank, the fork server) it does nothing. ``COURSE_LIB_EAGER=0`` turns it off."""
    if "IPython" not in sys.modules or os.environ.get("COURSE_LIB_EAGER", "1") == "0":
        return False
    from IPython import get_ipython
    shell = get_ipython()
    if getattr(shell, "kernel", None) is None or mp.current_process().name != "MainProcess":
        return False
    _start_fork_server()

    def after_cell(*_):
        shell.events.unregister("post_run_cell", after_cell)
        if not _SERVER["used"]:
            _start_fork_server()
    shell.events.register("post_run_cell", after_cell)
    return True


class _Pool:
    def __init__(self, world_size: int, backend: str, pg_timeout_s: float, start_timeout_s: float):
        self.world_size, self.backend, self.pg_timeout_s = world_size, backend, pg_timeout_s
        self.stall_s, self.spelling, self.ended = None, RUN_SPELLING, None   # the call's; why the pool was killed
        self.conns, self.procs, self._child_ends = [], [], []
        # Rendezvous through a file in a private directory: no socket at all, so nothing listens
        # beyond this machine (a TCPStore master binds every interface) and no name lookup.
        t_pool = time.time()
        self.tmpdir = tempfile.mkdtemp(prefix=f"{_STORE_PREFIX}{os.getpid()}-")   # the owner's pid: see _remove_stale_dirs
        store_path = os.path.join(self.tmpdir, "store")
        ctx = _context()
        _SERVER["used"] = True
        self.progress = ctx.Array("q", 3 * world_size, lock=False)  # per rank: collectives, op, bytes
        try:  # an interrupt while forking/connecting must not leave half a pool behind
            for r in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=worker_main, args=(r, world_size, backend, store_path, 0, child, pg_timeout_s,
                                                          self.progress),
                                name=f"course_lib-rank{r}", daemon=True)
                self.conns.append(parent)
                self._child_ends.append(child)
                p.start()
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
        self.startup = {"fork_server_asked": _FORK_SERVER_ASKED[0] or t_pool, "pool_asked": t_pool,
                        "first_rank_forked": min(m[2]["enter"] for m in ready.values()),
                        "last_rank_forked": max(m[2]["enter"] for m in ready.values()),
                        "all_ranks_ready": max(m[2]["ready"] for m in ready.values())}

        _remove_stale_dirs()  # any rank of an earlier, killed pool has had this whole start to leave

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
            for sink in OUTPUT_SINKS:
                sink.tick()   # %%ranks: stream the lines that waited long enough
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
                        and _stuck_after_error(errors, pending, prog)):
                    break
                if (stall_s and pending and any(prog[r] > min(prog) for r in pending)
                        and time.monotonic() - last_change >= stall_s):
                    self._stalled = True    # a rank waits in a collective and no rank made progress for stall_s
                    break
            if (errors or dead) and grace_deadline is None:
                first_error = time.monotonic()
                # Others are probably blocked in a collective with the failed rank: give them a moment to report
                # their own errors, then stop waiting. Ranks still computing get longer, to finish the call.
                broken = dead or what != "call" or any(_facts(e).get("in_collective", True) for e in errors.values())
                grace_deadline = time.monotonic() + (1.0 if broken else ERROR_GRACE_S)
        return self._verdict(finals, errors, dead, what, timeout_s, stall_s)

    def _handle(self, r, msg, finals, errors, is_final):
        kind = msg[0]
        if kind == "out":
            _print_labelled(r, msg[1], msg[2])
        elif kind == "error":
            errors[r] = msg[1:]
        elif is_final(r, msg):
            finals[r] = msg

    def _verdict(self, finals, errors, dead, what, timeout_s, stall_s=None):
        if not errors and not dead and len(finals) == self.world_size:
            return finals
        _flush_labelled()
        spell = getattr(self, "spelling", RUN_SPELLING)
        frames = {}
        if what == "call" and not errors and not dead:   # a hang: every rank's stack before the ranks go
            frames = stacks.capture(self.procs, self.tmpdir, getattr(self, "main_threads", {}))
        missing = [r for r in range(self.world_size) if r not in finals and r not in errors and r not in dead]
        in_collective = any(_facts(e).get("in_collective", True) for e in errors.values())
        # Keep the ranks (and what a %%ranks cell left in them) when every rank answered and none of the raises came
        # from inside a collective: the process group is then in step. Else someone may be stuck in a collective.
        if not (what == "call" and errors and not dead and not missing
                and (len(errors) == self.world_size or not in_collective)):
            if dead:
                why = f"after {_describe_deaths(dead)}"
            elif errors and missing:
                why = (f"after rank {min(errors)}'s error ({ranks_text(missing)} "
                       f"{'was' if len(missing) == 1 else 'were'} still running or waiting for it)")
            elif errors:
                why = f"after rank {min(errors)}'s error inside a collective (the process group may be broken)"
            else:
                why = "after the hang"
            self.kill(why)
        if dead:  # a dead rank is the cause; the others' errors are usually its echo
            first = min(dead)
            if what == "start" and set(dead.values()) == {MAIN_GUARD_EXIT}:
                raise RankError(first, "RankDied", _MAIN_GUARD_TEXT, "", {})
            desc = _describe_deaths(dead)
            others = {r: e[0] for r, e in errors.items()}
            raise RankError(first, "RankDied", f"{desc} during the {what}; {spell.died}", "", others)
        if errors:
            first = min(errors)
            exc_type, message, tb = errors[first][:3]
            others = {r: e[0] for r, e in errors.items() if r != first}
            raise RankError(first, exc_type, message, tb, others, own_traceback=_facts(errors[first]).get("own"))
        missing = [r for r in range(self.world_size) if r not in finals]
        where, slow = self._where(missing) if what == "call" else ("", missing[0])
        if self._stalled and what == "call":
            text = (f"{ranks_text(missing)} did not finish: a rank waited in a collective for {stall_s:g} s while no "
                    f"rank made progress (finished: {ranks_text(sorted(finals), bare=True) or 'none'}){where}. A rank "
                    f"that skips a collective leaves the others waiting in it. {spell.ended} ({spell.wait})")
        else:
            text = (f"{ranks_text(missing)} did not finish the {what} within {timeout_s:g} s "
                    f"(finished: {ranks_text(sorted(finals), bare=True) or 'none'}){where}. A rank that skips a "
                    f"collective leaves the others waiting in it. {spell.ended} ({spell.longer})")
        raise LaunchTimeout(slow, "LaunchTimeout", text, "", frames=frames, finished=set(finals),
                            stacks_hint=spell.stacks)

    def _where(self, missing):
        """Where the unfinished ranks wait, from the collective counts every rank publishes live."""
        prog = list(self.progress)
        count = {r: prog[3 * r] for r in range(self.world_size)}
        top = max(count[r] for r in missing)
        if top == 0:
            return "; none of them issued a collective in this call (still computing?)", missing[0]
        ahead = [r for r in missing if count[r] == top]
        behind = [r for r in range(self.world_size) if count[r] < top]
        r0 = ahead[0]
        op = _OP_NAMES[prog[3 * r0 + 1]] if prog[3 * r0 + 1] < len(_OP_NAMES) else "a collective"
        if not behind:
            return f"; all wait in {op} #{top} ({prog[3 * r0 + 2]} B)", missing[0]
        done = [r for r in behind if r not in missing]
        verb = "waits" if len(ahead) == 1 else "wait"
        text = (f": {ranks_text(ahead)} {verb} in {op} #{top} ({prog[3 * r0 + 2]} B); "
                f"{ranks_text(behind)} never issued it")
        if done:
            text += f" ({ranks_text(done)} returned without it)"
        return text, behind[0]

    def call(self, fn, args, kwargs, timeout_s: float | None, stall_s: float | None = None,
             spelling=RUN_SPELLING) -> RunResult:
        blob = _pickle_call(fn, args, kwargs)
        for i in range(len(self.progress)):
            self.progress[i] = 0
        self.spelling = spelling
        t0 = time.perf_counter()
        for c in self.conns:
            c.send(("run", blob))
        self.stall_s = stall_s
        finals = self._collect(lambda r, msg: msg[0] == "result", timeout_s, what="call")
        _flush_labelled()
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
        # The store's directory goes later (the next pool's start, or exit): a rank forked just as an
        # interrupt landed is unknown to us, and a FileStore whose directory vanished spins in C++ holding
        # the GIL, so the rank could not see its closed pipe. With the file there it reaches the
        # rendezvous, sees the pipe closed and leaves.
        if getattr(self, "tmpdir", None):
            _STALE_DIRS.append(self.tmpdir)
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


MAIN_GUARD_EXIT = 87  #: a rank's exit code when the script it re-imports calls run() at import time
_MAIN_GUARD_TEXT = ("this script calls course_lib.run() at import time: every rank re-imports the script, so "
                    "put the call under `if __name__ == \"__main__\":`")
_OP_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier", "send", "recv",
             "reduce", "gather", "scatter")


def max_world_size() -> int:
    """Most ranks this machine runs: each rank is a process of ~150 MB that gloo connects to every other."""
    env = os.environ.get("COURSE_LIB_MAX_WORLD_SIZE")
    if env:
        return int(env)
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 8 << 30
    return max(2, min(64, int(avail // (150 << 20))))


def ranks_text(ranks, bare: bool = False) -> str:
    """``[0..999] minus 7`` -> "ranks 0–6, 8–999": never more than a handful of numbers."""
    ranks = sorted(set(ranks))
    if not ranks:
        return ""
    runs, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            runs.append((start, a))
            start = b
    parts = [f"{a}" if a == b else (f"{a},{b}" if b == a + 1 else f"{a}–{b}") for a, b in runs]
    if len(parts) > 4:
        parts = parts[:3] + [f"… ({len(ranks)} ranks in all)"]
    body = ",".join(parts)
    if bare:
        return body
    return f"rank {body}" if len(ranks) == 1 else f"ranks {body}"


def _facts(error: tuple) -> dict:
    """The rank's judgement of its own raise (:func:`.rank.error_facts`); empty for a raise during the start."""
    return error[3] if len(error) > 3 else {}


def _stuck_after_error(errors: dict, pending: list, prog: list) -> bool:
    """A rank still running has issued more collectives than a rank that raised: it waits for one that never comes."""
    counts = [_facts(e).get("collectives") for e in errors.values()]
    if not pending or None in counts:
        return False
    return any(prog[r] > min(counts) for r in pending)


def _describe_deaths(dead: dict) -> str:
    by_code: dict = {}
    for r, c in dead.items():
        by_code.setdefault(c, []).append(r)
    return "; ".join(f"{ranks_text(rs)} {_describe_exit(c)}" for c, rs in sorted(by_code.items(), key=lambda x: min(x[1])))


def _pickle_call(fn, args, kwargs) -> bytes:
    """Pickle the call by value; if that fails, name the piece that cannot travel to the ranks."""
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        pieces = [("the function " + getattr(fn, "__name__", repr(fn)), fn)]
        pieces += [(f"argument {i} ({type(a).__name__})", a) for i, a in enumerate(args)]
        pieces += [(f"keyword argument {k}= ({type(v).__name__})", v) for k, v in kwargs.items()]
        for what, obj in pieces:
            try:
                cloudpickle.dumps(obj)
            except Exception as inner:
                raise TypeError(f"run() cannot send {what} to the ranks: {type(inner).__name__}: {inner}. "
                                "Pass plain data (tensors, numbers, configs) and build the rest inside fn") from None
        raise TypeError(f"run() cannot pickle the call: {exc}") from None


def _describe_exit(code) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_partial: dict = {}
OUTPUT_SINKS: list = []   # while a %%ranks cell runs: its output collector (.magic): add(rank, stream, text), tick()


def _print_labelled(rank: int, stream: str, text: str):
    """Print a rank's output line by line, each line prefixed with ``[rank r]``."""
    if OUTPUT_SINKS:
        OUTPUT_SINKS[-1].add(rank, stream, text)
        return
    buf = _partial.get((rank, stream), "") + text
    *lines, rest = buf.split("\n")
    target = sys.stdout if stream == "stdout" else sys.stderr
    for line in lines:
        target.write(f"[rank {rank}] {line}\n")
    _partial[(rank, stream)] = rest


def _flush_labelled():
    for (rank, stream), rest in list(_partial.items()):
        if rest:
            (sys.stdout if stream == "stdout" else sys.stderr).write(f"[rank {rank}] {rest}\n")
    _partial.clear()
    sys.stdout.flush()


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


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
        os._exit(MAIN_GUARD_EXIT)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if main_file is not None and not os.path.exists(main_file) and not _under_torchrun():
        # Each rank re-imports the main script by its path (multiprocessing's rule): `python - <<EOF` has none.
        raise RuntimeError(f"run() cannot start ranks from a program read from {main_file!r}: every rank re-imports "
                           "the main script from its file. Save the code to a file (the run() call under "
                           "`if __name__ == \"__main__\":`) and run `python file.py`, or run it in a notebook")
    check_world_size(world_size)
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be > 0 seconds")
    if _under_torchrun():
        return _run_under_torchrun(fn, args, kwargs)
    return launch(fn, args, kwargs, world_size=world_size, backend=backend, timeout=timeout, fresh=fresh)


#: The pool the latest call ran on (a %%ranks cell asks whether its ranks survived the call).
LAST_POOL: list = [None]


def launch(fn, args, kwargs, *, world_size: int, backend: str | None = None, timeout: float | None,
           fresh: bool = False, stall_s: float | None = None, spelling=RUN_SPELLING, notify=None,
           pg_floor_s: float = 0.0) -> RunResult:
    """:func:`run` after its checks, for ``%%ranks`` too: ``timeout`` is a wall limit (None: none), ``stall_s`` a
    limit on waiting in a collective while no rank progresses, ``notify(text, pool)`` hears, before it happens, that warm
    ranks are stopped to make room or to get a longer process-group timeout (their variables go with them);
    ``pg_floor_s``: the least process-group timeout a pool started now gets (so a short limit now does not force a
    restart later)."""
    from course_lib.runtime.devices import check_torch_version, choose_backend
    _start_fork_server()  # before this process imports torch: on a cold start the two imports overlap
    check_torch_version()
    b = choose_backend(world_size, prefer=backend).name
    key = (world_size, b)
    pool = _POOLS.get(key)
    # A rank may wait in a collective as long as the call may last, or the stall limit and a margin.
    pg_timeout = max(timeout or 0.0, stall_s + STALL_MARGIN_S if stall_s else 0.0)
    # The process-group timeout is fixed when a pool starts: a call that needs longer gets a new pool.
    if pool is not None and (fresh or not pool.alive() or pool.pg_timeout_s < pg_timeout):
        if fresh:
            why = "by run(..., fresh=True)"
        elif not pool.alive():
            why = "because a rank process had died"
        else:
            why = (f"for a process-group timeout of {pg_timeout:g} s (theirs, fixed when they started, was "
                   f"{pool.pg_timeout_s:g} s)")
            if notify:
                notify(f"the {world_size} ranks restart {why}: the variables of earlier %%ranks -n {world_size} "
                       "cells are gone", pool)
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
            pool = _Pool(world_size, b, pg_timeout_s=pg_timeout, start_timeout_s=max(pg_timeout, 60.0))
            LAST_POOL[0] = pool
            _POOLS[key] = pool
            out = pool.call(fn, args, kwargs, timeout, stall_s, spelling)
            out.startup = pool.startup  # this call started the ranks: how long each stage took
            return out
        return pool.call(fn, args, kwargs, timeout, stall_s, spelling)
    except KeyboardInterrupt:
        if pool is not None:
            pool.kill("by the interrupt")
        raise


def check_world_size(world_size, name: str = "world_size") -> None:
    """A world size this machine can run, or a ValueError naming the limit (``name``: how the caller spells it)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{name}={world_size!r} must be a positive int (2-8 ranks suit this machine)")
    limit = max_world_size()
    if world_size > limit and not _under_torchrun():
        raise ValueError(f"{name}={world_size} is more than this machine can run: at most {limit} ranks "
                         f"({os.cpu_count()} cores; each rank is a process of ~150 MB, and gloo connects every rank "
                         "to every other). Use 2-8 ranks; COURSE_LIB_MAX_WORLD_SIZE raises the limit")


def _run_under_torchrun(fn, args, kwargs) -> RunResult:
    import torch.distributed as dist
    from course_lib.comm import torch_ledger
    if not dist.is_initialized():
        dist.init_process_group(torch_ledger.register(with_cuda=_want_cuda()))
    torch_ledger.recorder().reset()
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    values = [None] * dist.get_world_size()
    with torch_ledger.paused():
        dist.all_gather_object(values, to_cpu(value))
    out = RunResult(values)
    out.seconds = time.perf_counter() - t0
    out.ledger = torch_ledger.recorder().ledger()
    out.backend = "torchrun"
    return out


def _want_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _remove_stale_dirs():
    """This process's killed pools' store directories, and those of processes that are gone.

    A process that ends without its exit handlers (a kernel killed by the grader, ``os._exit``) cannot remove its
    own directory: the next pool started on this machine does, by the owner's pid in the name."""
    while _STALE_DIRS:
        shutil.rmtree(_STALE_DIRS.pop(), ignore_errors=True)
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_STORE_PREFIX)]
    except OSError:
        return
    import psutil
    for name in names:
        pid = name[len(_STORE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def shutdown() -> dict:
    """Stop every warm rank process (called automatically at exit); returns their exit codes."""
    codes = {key: pool.stop() for key, pool in list(_POOLS.items())}
    _remove_stale_dirs()
    return codes


atexit.register(shutdown)
