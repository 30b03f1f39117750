"""The rank side of :mod:`course_lib.launch`: what runs inside each rank process.

Each rank is forked from the fork server, joins the process group through a file store in the pool's
private temporary directory (no socket, no name lookup; with the ledger backend, so every collective is recorded), then serves calls from the notebook over
its pipe: run a cloudpickled function, send back its result and this rank's ledger, or an error with
the traceback. Output is sent over the same pipe, so the notebook prints it labelled by rank.
"""
from __future__ import annotations

import datetime
import io
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass

import cloudpickle

from course_lib.launch.verdict import OP_NAMES as _OPS   # the notebook names a rank's last op by its index

@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    backend: str
    device: str  #: "cpu" or "cuda:<i>"


_RANK_INFO: RankInfo | None = None


def rank_info() -> RankInfo:
    """Inside a launched function: this rank, the world size, backend and device."""
    if _RANK_INFO is not None:
        return _RANK_INFO
    import torch.distributed as dist
    if dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), dist.get_backend(), "cpu")
    raise RuntimeError("rank_info() is only meaningful inside a function started by course_lib.run(...)")


# ---------------------------------------------------------------------------------------------
# rank side
# ---------------------------------------------------------------------------------------------
class _PipeWriter(io.TextIOBase):
    """sys.stdout/sys.stderr of a rank: every write goes to the notebook over the control pipe."""

    def __init__(self, conn, stream: str):
        self._conn, self._stream = conn, stream

    def writable(self):
        return True

    def write(self, s):
        if s:
            try:
                self._conn.send(("out", self._stream, s))
            except (OSError, ValueError):
                pass
        return len(s)

    def flush(self):
        pass


def to_cpu(value):
    import torch
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    return value




def _publish_progress(rec, progress, rank: int):
    """Background thread: publish this rank's collective count, last op and bytes (for hang messages)."""
    import time
    while True:
        time.sleep(0.05)
        recs = rec.records
        if recs:
            last = recs[-1]
            progress[3 * rank + 1] = _OPS.index(last.op) if last.op in _OPS else len(_OPS)
            progress[3 * rank + 2] = int(last.nbytes)
        progress[3 * rank] = len(recs)


def _leave_if_abandoned(conn, started: threading.Event):
    """During the start the notebook sends nothing: a readable pipe means it closed (interrupted)."""
    import multiprocessing.connection as mpc
    while not started.is_set():
        if mpc.wait([conn], timeout=0.1) and not started.is_set():
            os._exit(1)


_LAUNCH_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def error_facts(exc: BaseException, collectives: int) -> dict:
    """What the notebook needs to judge a rank's raise: the traceback from the learner's own first frame on (the
    launcher's frames -- this module, ``magic.exec_cell``, ``ast.parse`` -- left out), how many collectives the rank
    had issued, and whether the raise came from inside a collective (its process group may be broken)."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename.startswith(_LAUNCH_DIR)
                              or os.path.basename(tb.tb_frame.f_code.co_filename) == "ast.py"):
        tb = tb.tb_next
    own = "".join(traceback.format_exception(type(exc), exc, tb))
    in_collective = any(f.filename.endswith("distributed_c10d.py") for f in traceback.extract_tb(exc.__traceback__))
    try:
        import torch.distributed as dist
        in_collective = in_collective or isinstance(exc, dist.DistError)
    except (ImportError, AttributeError):
        pass
    return {"own": own, "collectives": collectives, "in_collective": in_collective}


def worker_main(rank: int, world_size: int, backend: str, host: str, port: int, conn, pg_timeout_s: float,
                progress=None):
    """Body of one rank process (forked from the fork server).

    ``host`` is the path of the rendezvous file store when ``port`` is 0, else a TCP store's host.
    """
    # The fork server froze what it imported (launch.preload), and a rank keeps it frozen: its collections never
    # walk (and so never copy) the pages it shares with the server. Unfrozen, each rank's first full collection
    # wrote to every inherited object: twice the page faults, +10 % of the ranks' CPU time in Lab 07. Frozen
    # objects are not counted in the collector's thresholds, so full collections come sooner than in a plain
    # process; a number that depends on when a reference cycle is freed is measured after gc.collect() (Lab 04).
    global _RANK_INFO
    import time
    t_enter = time.time()  # wall clock: the pool compares it with its own (cold-start breakdown)
    server = os.getppid()
    try:  # die with the fork server / notebook: no orphans even after a kernel crash
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != server:
        os._exit(1)  # the fork server died before the line above armed PDEATHSIG
    from course_lib.launch import forkserver
    forkserver.release_in_rank()   # the server outlives no notebook because of us: its docstring says why
    if port == 0:
        from course_lib.launch import stacks
        stacks.arm(os.path.dirname(host), rank)   # a hang's report: this rank's stack on SIGUSR1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook handles Ctrl-C and kills us
    os.environ["OMP_NUM_THREADS"] = "1"
    # gloo binds loopback by interface name: no hostname resolution, nothing reachable from outside.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.stdout, sys.stderr = _PipeWriter(conn, "stdout"), _PipeWriter(conn, "stderr")
    import warnings
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated", category=FutureWarning)
    import torch
    import torch.distributed as dist
    from course_lib.comm import torch_ledger

    torch.set_num_threads(1)  # 2 cores shared by N ranks: oversubscription makes everything slower
    device = "cpu"
    if backend == "nccl":
        local = rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    _RANK_INFO = RankInfo(rank, world_size, backend, device)
    starting = threading.Event()
    threading.Thread(target=_leave_if_abandoned, args=(conn, starting), daemon=True).start()
    try:
        if port == 0:
            store = dist.FileStore(host, world_size)
            store.set_timeout(datetime.timedelta(seconds=pg_timeout_s))
        else:
            store = dist.TCPStore(host, port, world_size=None, is_master=False,
                                  timeout=datetime.timedelta(seconds=pg_timeout_s))
        name = torch_ledger.register(with_cuda=(backend == "nccl"))
        dist.init_process_group(name, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        starting.set()
        conn.send(("ready", rank, {"enter": t_enter, "ready": time.time(), "thread": threading.get_ident()}))
    except BaseException as exc:
        conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))
        os._exit(1)
    rec = torch_ledger.recorder()
    if progress is not None:
        threading.Thread(target=_publish_progress, args=(rec, progress, rank), daemon=True).start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # the notebook went away
        if msg[0] == "stop":
            os._exit(0)
        fn, args, kwargs = cloudpickle.loads(msg[1])
        rec.reset()
        try:
            value = to_cpu(fn(*args, **kwargs))
            try:
                payload = ("ok", cloudpickle.dumps(value))
            except Exception as exc:  # noqa: BLE001 - named on the notebook side
                payload = ("unpicklable", f"{type(value).__name__} ({type(exc).__name__}: {exc})")
            conn.send(("result", payload, rec.ledger().to_dicts()))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the notebook
            conn.send(("error", type(exc).__name__, str(exc), traceback.format_exc(), error_facts(exc, len(rec.records))))
