"""The grading kernel as the grader talks to it: its kernel manager and client, its environment, output caps, and
the pipe its guard writes to. :mod:`.sandbox` puts these together around one notebook (``run_boxed``).

* the kernel manager starts the command :mod:`.sandbox` builds (limits, bubblewrap, the guard) with Unix-socket
  transport in the scratch folder (sockets cross the network namespace, TCP would not) and message-mode interrupts
  (a signal to the sandbox would not reach the kernel inside);
* its client cuts each wait into one-second slices (a lost wake-up costs a second, not the cell limit);
* the environment is built from nothing but the course's own switches: the grader's (the class folder in ``PWD``
  included) stays outside;
* :func:`capped_client` keeps at most the limits' bytes of output per cell and per notebook;
* :class:`GuardChannel` reads the guard's records as they are written.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

__all__ = ["OUTBOX_DIR", "kernel_manager_class", "client_class", "kernel_environment", "capped_client", "GuardChannel", "TAG_VAR"]

COURSE_ROOT = Path(__file__).resolve().parents[3]          # the checkout holding course_lib
TAG_VAR = "COURSE_LIB_GRADE_TAG"
#: The scratch folder's sub-folder where each check's run half writes its plain data (course_lib.checks.judge).
OUTBOX_DIR = ".outbox"


#: How long one wait on a kernel channel lasts before it looks again (see :func:`client_class`).
POLL_SLICE_S = 1.0


def client_class():
    """An async kernel client whose shell and IOPub waits are cut into :data:`POLL_SLICE_S` slices.

    Why: a single long wait can miss a message that has already arrived (the socket's wake-up is lost when
    widget comm traffic crosses the channel), and then nbclient sits out the whole cell limit beside an idle
    kernel -- seen here on Lab 02's ``interact`` cell in 2 of 30 runs, an open nbclient issue
    (jupyter/nbclient#312). Looking again every second finds the message; the limits are unchanged."""
    from queue import Empty

    from jupyter_client.asynchronous import AsyncKernelClient
    from jupyter_client.channels import AsyncZMQSocketChannel
    from traitlets import Type

    class SlicedChannel(AsyncZMQSocketChannel):
        async def get_msg(self, timeout: float | None = None):
            end = None if timeout is None else time.monotonic() + timeout
            while True:
                left = POLL_SLICE_S if end is None else min(POLL_SLICE_S, max(0.0, end - time.monotonic()))
                try:
                    return await super().get_msg(timeout=left)
                except Empty:
                    if end is not None and time.monotonic() >= end:
                        raise

    class SlicedClient(AsyncKernelClient):
        shell_channel_class = Type(SlicedChannel)
        iopub_channel_class = Type(SlicedChannel)
    return SlicedClient


def kernel_manager_class(limits, socket_dir: Path, kernel_cmd: list[str]):
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    client = client_class()

    class BoxedSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            spec = ipykernel.kernelspec.get_kernel_dict()
            spec["argv"] = kernel_cmd + ["-f", "{connection_file}"]
            spec["interrupt_mode"] = "message"      # a signal to the sandbox would not reach the kernel inside
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES, **spec)

    class BoxedKernelManager(AsyncKernelManager):
        def __init__(self, **kw):
            kw.setdefault("kernel_spec_manager", BoxedSpecs())
            kw.setdefault("transport", "ipc")                  # Unix sockets in the scratch folder: they cross
            kw.setdefault("ip", str(socket_dir / "kernel"))    # the network namespace, which TCP would not
            kw.setdefault("connection_file", str(socket_dir / "kernel.json"))
            kw.setdefault("client_factory", client)
            super().__init__(**kw)
    return BoxedKernelManager


#: Variables of the grader's environment a kernel may see (everything else, the class folder's path in PWD
#: included, stays outside): the course's own switches, locale and the thread count.
_PASSED = ("LANG", "LC_ALL", "OMP_NUM_THREADS", "JAX_PLATFORMS")


def kernel_environment(scratch: Path, tag: str, sandboxed: bool) -> dict[str, str]:
    home = scratch / ".home"
    for sub in ("tmp", "cache", "config", "mpl", "ipython"):
        (home / sub).mkdir(parents=True, exist_ok=True)
    from course_lib.checks.judge import OUTBOX_VAR
    (scratch / OUTBOX_DIR).mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k in _PASSED or k.startswith("COURSE_LIB_")}
    env[OUTBOX_VAR] = str(scratch / OUTBOX_DIR)        # the checks run their run half only: the judge is outside
    env.update({TAG_VAR: tag, "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
                "TMPDIR": "/tmp" if sandboxed else str(home / "tmp"), "XDG_CACHE_HOME": str(home / "cache"),
                "XDG_CONFIG_HOME": str(home / "config"), "MPLCONFIGDIR": str(home / "mpl"),
                "IPYTHONDIR": str(home / "ipython"), "COURSE_LIB_STRICT_CHECKS": "0",   # lab mode: ❌, never raise
                "PYTHONPATH": str(COURSE_ROOT), "PYTHONDONTWRITEBYTECODE": "1",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return env


def capped_client(cls, limits, run):
    """``cls`` (nbclient's NotebookClient) keeping at most the limits' bytes of output per cell and per notebook."""
    import nbformat

    class Capped(cls):
        def output(self, outs, msg, display_id, cell_index):
            if msg.get("msg_type") in ("stream", "display_data", "execute_result", "error", "update_display_data"):
                content = msg.get("content", {})
                size = len(content.get("text", "")) + sum(len(str(v)) for v in (content.get("data") or {}).values()) \
                    + sum(len(str(line)) for line in content.get("traceback", []))
                used = self._used.get(cell_index, 0)
                room = min(limits.cell_output_bytes - used, limits.notebook_output_bytes - self._total)
                if size > room:
                    which = "cell" if limits.cell_output_bytes - used <= limits.notebook_output_bytes - self._total \
                        else "notebook"
                    if cell_index not in run.truncated_cells:
                        run.truncated_cells.append(cell_index)
                        if msg["msg_type"] == "stream" and room > 0:      # keep what fits of a stream
                            content["text"] = content["text"][:room]
                            super().output(outs, msg, display_id, cell_index)
                        cap = limits.cell_output_bytes if which == "cell" else limits.notebook_output_bytes
                        outs.append(nbformat.v4.new_output("stream", name="stderr", text=(
                            f"\n[the grader kept the first {cap / 2**20:g} MiB of this {which}'s output; "
                            f"the rest was dropped]\n")))
                    self._used[cell_index], self._total = used + max(room, 0), self._total + max(room, 0)
                    return None
                self._used[cell_index], self._total = used + size, self._total + size
            return super().output(outs, msg, display_id, cell_index)
    Capped._used, Capped._total = {}, 0
    return Capped


class GuardChannel:
    """The guard's pipe, read here into ``run.records`` as the kernel writes it (a FIFO whose path the guard
    removes once it is open; the grader keeps a writer open so the pipe never reads as ended while it waits)."""

    def __init__(self, path: Path, run):
        os.mkfifo(path, 0o600)                  # the box's uid nobody is the grader's own user outside it
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._keep = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        self.run, self._buffer = run, b""
        asyncio.get_running_loop().add_reader(self.fd, self._read)

    def _read(self) -> None:
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        self._take(data)

    def _take(self, data: bytes) -> None:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                rec = {"kind": "garbled", "text": line[:200].decode(errors="replace")}
            if isinstance(rec, dict) and len(self.run.records) < 10_000:
                self.run.records.append(rec)

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.fd)
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            self._take(data)
        os.close(self._keep)
        os.close(self.fd)
