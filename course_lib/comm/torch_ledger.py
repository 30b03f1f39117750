"""Capture every torch collective at the c10d process-group level, into a :class:`Ledger`.

Wrapping ``torch.distributed.all_reduce`` & co. in Python misses most of what matters: DDP's reducer
calls the process group from C++, and FSDP2 issues ``all_gather_single`` / ``reduce_scatter_single``
on the group object directly. So instead of wrapping functions we wrap the *process group*: the
``"ledger"`` backend registered here is a ``ProcessGroup`` subclass that forwards every call to a
real gloo (CPU) or NCCL (CUDA) backend and writes one :class:`CollectiveRecord` per call. Whatever
issues a collective -- the learner, DDP, FSDP2, DTensor, DCP -- goes through it.

Times: ``start`` is when the op was issued, ``end`` when its future completed (gloo and NCCL run
ops asynchronously, so issue order and completion can differ; gloo's reduce-scatter exposes no
completion, so its ``end`` is None), both in seconds since the recorder
was last reset. ``phase`` is "backward" automatically while autograd runs a backward pass,
otherwise whatever the run marked with :func:`phase` (e.g. "forward", "optimizer"), else None.

One recorder per process (the backend is created by torch, which cannot be handed an object), so
this module keeps it in ``_RECORDER``; everything else is passed explicitly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import torch
import torch.distributed as dist

from course_lib.comm.ledger import CollectiveRecord, Ledger

BACKEND_NAME = "ledger"


class Recorder:
    """Collects records for this process; reset at the start of every launched call."""

    def __init__(self):
        self.records: list[CollectiveRecord] = []
        self.t0 = time.perf_counter()
        self.phase: str | None = None
        self.step: int | None = None
        self.enabled = True
        self._lock = threading.Lock()

    def reset(self):
        with self._lock:
            self.records = []
        self.t0 = time.perf_counter()
        self.phase, self.step = None, None

    def ledger(self) -> Ledger:
        with self._lock:
            return Ledger(list(self.records))


_RECORDER = Recorder()


def recorder() -> Recorder:
    return _RECORDER


@contextlib.contextmanager
def phase(name: str | None, step: int | None = None):
    """Mark the collectives issued inside the block with a phase (and optionally a step)."""
    old = (_RECORDER.phase, _RECORDER.step)
    _RECORDER.phase = name
    if step is not None:
        _RECORDER.step = step
    try:
        yield
    finally:
        _RECORDER.phase, _RECORDER.step = old


def set_step(step: int | None):
    """Label the following collectives with a training step index."""
    _RECORDER.step = step


@contextlib.contextmanager
def paused():
    """Issue collectives without recording them (e.g. set-up or a parity check)."""
    old = _RECORDER.enabled
    _RECORDER.enabled = False
    try:
        yield
    finally:
        _RECORDER.enabled = old


def unrecorded_mean(value: torch.Tensor, group=None) -> float:
    """The mean of a scalar (e.g. each rank's loss) over the group, without entering the ledger.

    Reporting a global loss is bookkeeping, not training traffic: recording it would put an extra
    all-reduce next to the strategy's own collectives and spoil their ratio to the formula.
    """
    t = value.detach().clone()
    with paused():
        dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class LedgerProcessGroup(dist.ProcessGroup):
    """A process group that records, then forwards to real backends (gloo for CPU, NCCL for CUDA)."""

    def __init__(self, inner: dict, rank: int, size: int, global_ranks: tuple[int, ...]):
        super().__init__(rank, size)
        self._inner = inner  # device type -> backend
        self._global_ranks = global_ranks
        self._name = ""
        self._desc = ""

    # -- identity (DeviceMesh and c10d read these from Python) --------------------------------
    def getBackendName(self):
        return BACKEND_NAME

    def _set_group_name(self, name):
        self._name = name

    @property
    def group_name(self):
        return self._name

    def _set_group_desc(self, desc):
        self._desc = desc

    @property
    def group_desc(self):
        return self._desc

    # -- recording ---------------------------------------------------------------------------
    def _backend(self, tensors):
        dev = tensors[0].device.type if tensors else "cpu"
        try:
            return self._inner[dev]
        except KeyError:
            raise RuntimeError(
                f"the ledger process group has no backend for {dev} tensors (it has {sorted(self._inner)}); "
                "run with a backend that covers this device (gloo: CPU, nccl: CUDA)"
            ) from None

    def _record(self, op, name, payload_tensors, work):
        rec = _RECORDER
        if not rec.enabled:
            return work
        t = payload_tensors[0] if payload_tensors else None
        axis = self._desc[5:] if self._desc.startswith("mesh_") else None
        phase_ = "backward" if torch._C._current_graph_task_id() != -1 else rec.phase
        fields = dict(
            op=op, nbytes=_nbytes(payload_tensors), dtype=_dtype_name(t) if t is not None else "none",
            group_size=self.size(), rank=dist.get_rank() if dist.is_initialized() else self.rank(),
            group_ranks=self._global_ranks, axis=axis, start=time.perf_counter() - rec.t0,
            phase=phase_, step=rec.step, source="torch", name=name,
        )

        with rec._lock:  # recorded at issue time; the completion time is filled in when it is known
            rec.records.append(CollectiveRecord(**fields))
            index, records = len(rec.records) - 1, rec.records

        def done(_fut, t0=rec.t0):
            with rec._lock:
                if index < len(records) and records[index].end is None:
                    records[index] = dataclasses.replace(records[index], end=time.perf_counter() - t0)

        try:
            work.get_future().add_done_callback(done)
        except Exception:
            # gloo's reduce-scatter work has no future, and its is_completed() stays False: its end
            # time is not observable, so it stays None (widgets say "end not recorded"). Calling
            # wait() from here is no way out: for gloo's reduce-scatter, wait() is what copies this
            # rank's chunk into the output, so a second wait() would undo the caller's in-place
            # edits of the output (e.g. out /= N).
            pass
        return work

    # -- collectives: each records its payload V (see ledger.py) and forwards -----------------
    def allreduce(self, tensors, opts=None):
        return self._record("all_reduce", "allreduce", tensors, self._backend(tensors).allreduce(tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._record("all_reduce", "allreduce_coalesced", tensors,
                            self._backend(tensors).allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors, opts=None):
        return self._record("broadcast", "broadcast", tensors, self._backend(tensors).broadcast(tensors, opts))

    def allgather(self, output_lists, inputs, opts=None):
        outs = [t for lst in output_lists for t in lst]
        return self._record("all_gather", "allgather", outs, self._backend(inputs).allgather(output_lists, inputs, opts))

    def _allgather_base(self, output, inp, opts=None):
        return self._record("all_gather", "_allgather_base", [output], self._backend([inp])._allgather_base(output, inp, opts))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        backend = self._backend(inputs)
        if not hasattr(backend, "allgather_into_tensor_coalesced"):
            # gloo has no coalesced all-gather (DTensor.full_tensor() asks for one): issue them one by
            # one, each waited for, so the single work returned stands for all of them.
            work = None
            for out, inp in zip(outputs, inputs):
                work = self._allgather_base(out, inp, opts)
                work.wait()
            return work
        return self._record("all_gather", "allgather_into_tensor_coalesced", outputs,
                            backend.allgather_into_tensor_coalesced(outputs, inputs, opts))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        ins = [t for lst in input_lists for t in lst]
        return self._record("reduce_scatter", "reduce_scatter", ins,
                            self._backend(outputs).reduce_scatter(outputs, input_lists, opts))

    def _reduce_scatter_base(self, output, inp, opts=None):
        return self._record("reduce_scatter", "_reduce_scatter_base", [inp],
                            self._backend([inp])._reduce_scatter_base(output, inp, opts))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._record("reduce_scatter", "reduce_scatter_tensor_coalesced", inputs,
                            self._backend(inputs).reduce_scatter_tensor_coalesced(outputs, inputs, opts))

    def alltoall_base(self, output, inp, output_split_sizes, input_split_sizes, opts=None):
        return self._record("all_to_all", "alltoall_base", [inp], self._backend([inp]).alltoall_base(
            output, inp, output_split_sizes, input_split_sizes, opts))

    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        return self._record("all_to_all", "alltoall", inputs, self._backend(inputs).alltoall(outputs, inputs, opts))

    def reduce(self, tensors, opts=None):
        return self._record("reduce", "reduce", tensors, self._backend(tensors).reduce(tensors, opts))

    def gather(self, output_lists, inputs, opts=None):
        return self._record("gather", "gather", inputs, self._backend(inputs).gather(output_lists, inputs, opts))

    def scatter(self, outputs, input_lists, opts=None):
        return self._record("scatter", "scatter", outputs, self._backend(outputs).scatter(outputs, input_lists, opts))

    def send(self, tensors, dst, tag=0):
        return self._record("send", "send", tensors, self._backend(tensors).send(tensors, dst, tag))

    def recv(self, tensors, src, tag=0):
        return self._record("recv", "recv", tensors, self._backend(tensors).recv(tensors, src, tag))

    def recv_anysource(self, tensors, tag=0):
        return self._record("recv", "recv_anysource", tensors, self._backend(tensors).recv_anysource(tensors, tag))

    def barrier(self, opts=None):
        inner = self._inner.get("cuda") or self._inner["cpu"]
        return self._record("barrier", "barrier", [], inner.barrier(opts) if opts is not None else inner.barrier())

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return self._inner["cpu"].monitored_barrier(timeout, wait_all_ranks)


def _create(opts, _pg_options):
    """Backend factory torch calls for every new group (default group, new_group, DeviceMesh dims)."""
    inner = {"cpu": dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)}
    if _WANT_CUDA and torch.cuda.is_available():  # untested here: no GPU on the CI machine
        nccl_opts = dist.ProcessGroupNCCL.Options()
        nccl_opts._timeout = opts.timeout
        inner["cuda"] = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", opts.store), opts.group_rank,
                                              opts.group_size, nccl_opts)
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(opts.group_size))  # empty for the default group
    pg = LedgerProcessGroup(inner, opts.group_rank, opts.group_size, ranks)
    pg._set_group_name(opts.group_id)
    return pg


_WANT_CUDA = False


def register(with_cuda: bool = False) -> str:
    """Register the ``"ledger"`` backend (idempotent) and return its name for ``init_process_group``."""
    global _WANT_CUDA
    _WANT_CUDA = with_cuda
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    return BACKEND_NAME
