"""A JAX process whose peer vanished says so in one line and exits, before XLA's own abort.

Under ``jax.distributed`` a dead process is noticed by the coordination service after its heartbeat timeout;
XLA then ends every survivor with ``LOG(FATAL)``: SIGABRT, a C++ stack and no word of which process died or
at which step. So each process runs a :class:`PeerWatch` thread on the service's key-value store:

* at start every process publishes its host and pid (``course_lib/peers/<i>``);
* every ``POLL_S`` the thread looks at each peer: on this host, whether its pid still runs (a zombie counts as
  gone); on another host, whether its heartbeat key (``course_lib/beat/<i>``) moved within ``stale_s``; and
  whether the store answers at all (it lives in process 0: no answer means process 0 is gone);
* a peer that vanished -> one ``course_lib`` line naming it (process, pid, host), this process's step and the
  last complete checkpoint, then ``os._exit(PEER_LOST_EXIT)``: no atexit shutdown barrier that would wait for
  the dead, no C++ dump. ``stale_s`` is below the service's heartbeat timeout, so this comes first.

**The coordinator (process 0).** It hosts the service, so its death is seen first by XLA itself, not by a
heartbeat: the survivor's error-polling RPC fails as the kernel closes the dead process's sockets -- before a
pidfd on it fires -- and XLA calls the client's ``missed_heartbeat_callback``, by default ``LOG(FATAL)`` with its
C++ stack, 0.02-0.07 s after the kill (measured here, 2 processes, idle or inside gloo collectives). No Python
thread can win that race, and jaxlib 0.10 cannot call a Python callback there: the callback's ``absl::Status``
argument has no Python type, so the call throws ``std::bad_cast`` on XLA's thread, i.e. ``std::terminate``. What
XLA allows is therefore: :func:`initialize` passes a callback (``jax.distributed.initialize`` offers none), so
the fatal path becomes ``std::terminate`` instead of ``LOG(FATAL)`` (no F-line, no C++ stack), and the
:class:`PeerWatch` owns ``std::terminate`` (libstdc++'s ``std::set_terminate``, through ctypes): it prints the
one course line -- the coordinator named, this process's step, the last checkpoint -- and exits
``PEER_LOST_EXIT``. XLA's own ``E``/``W`` log lines of the failed RPC ("Polled an error from coordination
service") still come first: they are printed before the callback runs. Where either hook is unavailable (another
jaxlib, libc++), the behaviour is XLA's abort, as before.

The training loop also asks :meth:`PeerWatch.verdict` when a collective fails (gloo reports a closed connection
at once, as a Python exception): the line and the exit come from here too, not a traceback. Before a normal
``jax.distributed.shutdown()`` each process marks itself done (:meth:`PeerWatch.stop`), so a peer that finished
first is not taken for dead.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

__all__ = ["PeerWatch", "PEER_LOST_EXIT"]

PEER_LOST_EXIT = 3   #: exit status of a process that stopped because a peer vanished (2: bad config, 1: error)
POLL_S = 0.25


def initialize(coordinator, **kwargs) -> None:
    """``jax.distributed.initialize(coordinator, **kwargs)``, its client made with a ``missed_heartbeat_callback``
    (see the module docstring: the fatal path becomes ``std::terminate``, which a :class:`PeerWatch` turns into
    one line). Falls back to the plain call when this jaxlib's client takes no such callback."""
    import jax
    import jax._src.distributed as jd
    real = jd._jax
    if "missed_heartbeat_callback" not in (getattr(real.get_distributed_runtime_client, "__doc__", "") or ""):
        return jax.distributed.initialize(coordinator, **kwargs)

    def no_status(*_):   # jaxlib 0.10 never gets here (std::bad_cast on its absl::Status); a jaxlib that can:
        for watch in list(_WATCHES):   # the same line as from std::terminate
            watch._on_terminate()
        os.abort()

    class _WithCallback:   # jax's module of bindings, with the client factory given the callback
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def get_distributed_runtime_client(*a, **kw):
            kw.setdefault("missed_heartbeat_callback", no_status)
            return real.get_distributed_runtime_client(*a, **kw)
    jd._jax = _WithCallback()
    try:
        jax.distributed.initialize(coordinator, **kwargs)
    finally:
        jd._jax = real


_TERMINATE = {}   # the installed std::terminate handler (kept alive) and the one it replaced
_WATCHES: list = []   # the PeerWatch of this process (one per jax.distributed job)


def _own_terminate(handler) -> bool:
    """Make ``handler`` (a Python function of no arguments) libstdc++'s ``std::terminate`` handler. False when
    the process has no libstdc++ to ask (then XLA's abort stays as it is)."""
    try:
        std = ctypes.CDLL("libstdc++.so.6")
        set_terminate = std._ZSt13set_terminatePFvvE
    except (OSError, AttributeError):
        return False
    proto = ctypes.CFUNCTYPE(None)
    set_terminate.restype, set_terminate.argtypes = ctypes.c_void_p, [proto]
    fn = proto(handler)
    old = set_terminate(fn)
    _TERMINATE.setdefault("previous", old)
    _TERMINATE["handler"] = fn
    return True


def _previous_terminate() -> None:
    old = _TERMINATE.get("previous")
    if old:
        ctypes.CFUNCTYPE(None)(old)()   # libstdc++'s verbose handler: prints, aborts
    os.abort()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class PeerWatch:
    """Watch the other processes of this ``jax.distributed`` job (see the module docstring). ``where``: a dict
    the training loop keeps current (``step``); ``ckpt_dir``: where the last complete checkpoint is looked up
    for the line; ``cleanup``: called before the exit (e.g. release the checkpoint folder's lock)."""

    def __init__(self, client, process: int, nproc: int, *, stale_s: float, ckpt_dir=None, cleanup=None,
                 prog: str = "course_lib.train_jax"):
        self.client, self.process, self.nproc, self.stale_s = client, process, nproc, stale_s
        self.ckpt_dir, self.cleanup, self.prog = ckpt_dir, cleanup, prog
        self.where: dict = {"step": 0}
        self.host = socket.gethostname()
        client.key_value_set(f"course_lib/peers/{process}", json.dumps({"host": self.host, "pid": os.getpid()}),
                             allow_overwrite=True)
        self.peers = {q: json.loads(client.blocking_key_value_get(f"course_lib/peers/{q}", 120_000))
                      for q in range(nproc) if q != process}
        self._beats = {q: (None, time.monotonic()) for q in self.peers}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="course_lib-peer-watch", daemon=True)
        self._thread.start()
        _own_terminate(self._on_terminate)
        _WATCHES[:] = [self]
        local = {q: info["pid"] for q, info in self.peers.items() if info["host"] == self.host}
        if local and hasattr(os, "pidfd_open"):   # Linux: woken the instant a peer on this host exits
            threading.Thread(target=self._wait_for_exit, args=(local,), name="course_lib-peer-exit",
                             daemon=True).start()

    # -- the thread ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        beat = 0
        while not self._stop.wait(POLL_S):
            beat += 1
            try:
                self.client.key_value_set(f"course_lib/beat/{self.process}", str(beat), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the store is process 0's: checked below
                pass
            self.check()

    def _wait_for_exit(self, local: dict) -> None:
        """Block on a pidfd per peer on this host: its exit wakes this thread at once (sooner than the heartbeat;
        for the coordinator XLA's error poll is sooner still: :meth:`_on_terminate` speaks then)."""
        import select
        fds = {}
        for q, pid in local.items():
            try:
                fds[os.pidfd_open(pid)] = q
            except OSError:   # already gone
                self._lost(q, "its process is gone")
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            for fd, _ in poller.poll(500):
                q = fds[fd]
                if not self._done(q):
                    self._lost(q, "its process is gone")
                poller.unregister(fd)

    def _on_terminate(self) -> None:
        """``std::terminate`` on any thread -- XLA's fatal error of the distributed service (see the module
        docstring) or another C++ failure: one course line and ``PEER_LOST_EXIT`` while watching, else the
        previous handler (after :meth:`stop`, a C++ failure is not a peer's death)."""
        if self._stop.is_set():
            _previous_terminate()
        for q, info in self.peers.items():   # no RPC here: the service may be gone
            if info["host"] == self.host and not _alive(info["pid"]):
                self._lost(q, "its process is gone")
        if self.process != 0:
            self._lost(0, "XLA lost jax.distributed's service, which runs in it")
        self._lost(None, "XLA's distributed service reported a fatal error: a process died or the network failed")
        _previous_terminate()

    def check(self) -> None:
        """One look at every peer; exits the process (never returns) when one vanished."""
        if self._stop.is_set():
            return
        for q, info in self.peers.items():
            if info["host"] == self.host and not _alive(info["pid"]) and not self._done(q):
                self._lost(q, "its process is gone")
        try:
            beats = dict(self.client.key_value_dir_get("course_lib/beat/"))
            done = {k.rpartition("/")[2] for k, _ in self.client.key_value_dir_get("course_lib/done/")}
        except Exception:  # noqa: BLE001 - the key-value store lives in process 0
            if self.process != 0 and not self._stop.is_set():
                self._lost(0, "the coordinator no longer answers")
            return
        now = time.monotonic()
        for q in self.peers:
            value = beats.get(f"course_lib/beat/{q}")
            last, since = self._beats[q]
            if value != last:
                self._beats[q] = (value, now)
            elif str(q) not in done and now - since > self.stale_s:
                self._lost(q, f"no heartbeat for {now - since:.1f} s")

    def _done(self, q: int) -> bool:
        try:
            self.client.key_value_try_get(f"course_lib/done/{q}")
            return True
        except Exception:  # noqa: BLE001 - not found (or the store is gone: then it is not done either)
            return False

    def _lost(self, q: int, why: str) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            info = self.peers.get(q, {})
            last = self._last_checkpoint()
            who = (f"process {q} of {self.nproc} (pid {info.get('pid', '?')} on {info.get('host', '?')}) vanished "
                   f"({why})" if q is not None else f"a process of {self.nproc} is gone ({why})")
            print(f"\n{self.prog}: {who} while this process {self.process} was at step {self.where.get('step')}; "
                  f"stopping (exit {PEER_LOST_EXIT}). The last complete checkpoint is {last}: start every process "
                  "again with --resume", file=sys.stderr, flush=True)
            try:
                if self.cleanup:
                    self.cleanup()
            finally:
                sys.stdout.flush()
                os._exit(PEER_LOST_EXIT)

    def _last_checkpoint(self) -> str:
        if not self.ckpt_dir or not Path(self.ckpt_dir).is_dir():
            return "none (no --ckpt-dir)" if not self.ckpt_dir else "none"
        steps = sorted(int(p.name) for p in Path(self.ckpt_dir).iterdir() if p.is_dir() and p.name.isdigit())
        return f"step {steps[-1]} in {self.ckpt_dir}" if steps else f"none in {self.ckpt_dir}"

    # -- the training loop's side -------------------------------------------------------------------------
    def verdict(self, timeout: float) -> None:
        """A collective failed: look until ``timeout`` for a vanished peer (exits if one is found); return
        otherwise, for the caller to raise its own error."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.check()
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Before a normal shutdown: say this process is done (its exit is no fault), stop watching."""
        try:
            self.client.key_value_set(f"course_lib/done/{self.process}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass
        with self._lock:
            self._stop.set()
        self._thread.join(timeout=2)
