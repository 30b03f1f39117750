"""Every rank's Python stack at the moment a call hangs, and which line of the learner's code each waits on.

Each rank arms :mod:`faulthandler` on ``SIGUSR1`` (:func:`arm`), writing into a file of the pool's private
directory. When a call times out, the notebook signals every live rank, reads the dumps and only then kills
the ranks (:func:`capture`); the :class:`~course_lib.launch.results.LaunchTimeout` carries them.

Why faulthandler and not py-spy: faulthandler is in the standard library (no new dependency, nothing to
install on a learner's machine) and dumps from inside the rank, in a C signal handler that needs neither the GIL
nor the eval loop -- so it answers while the main thread is blocked in gloo's C++ wait, or spins in C holding the
GIL. py-spy reads another process's memory with ``ptrace``, which containers, Yama's ``ptrace_scope`` and
sandboxes (the course's grader runs kernels under bubblewrap) often refuse, and it is one more binary to install.
What faulthandler lacks -- the source line of each frame -- the notebook adds: a cell's code is in the kernel's
:mod:`linecache`, never on the rank's disk.
"""
from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import sysconfig
import time
from dataclasses import dataclass

SIGNAL = signal.SIGUSR1
_FILES: list = []   # rank side: the dump file stays open for the life of the rank


@dataclass(frozen=True)
class Frame:
    """One frame of a rank's stack: where, and the source line as the notebook knows it."""
    file: str
    line: int
    name: str
    code: str

    def where(self) -> str:
        return f"{_short(self.file)}:{self.line}"


def dump_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"stack-{rank}.txt")


def arm(directory: str, rank: int) -> None:
    """Rank side: on SIGUSR1, write every thread's stack into ``dump_path(directory, rank)``."""
    f = open(dump_path(directory, rank), "w")
    _FILES.append(f)
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)


def capture(procs, directory: str, main_threads: dict, wait_s: float = 0.5) -> dict[int, list[Frame]]:
    """Notebook side: signal every live rank, wait (at most ``wait_s``) for its dump; each rank's main-thread
    frames, outermost first. A rank that died or did not answer in time is absent."""
    asked = []
    for r, p in enumerate(procs):
        if p.is_alive() and p.pid:
            try:
                os.kill(p.pid, SIGNAL)
                asked.append(r)
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    texts: dict[int, str] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.02)
        for r in list(asked):
            try:
                with open(dump_path(directory, r)) as f:
                    text = f.read()
            except OSError:
                continue
            if text.endswith("\n") and "File" in text:   # a dump of a blocked rank takes microseconds
                texts[r] = text
                asked.remove(r)
    if asked:
        time.sleep(0.02)   # a last look: a dump that was mid-write
        for r in asked:
            try:
                with open(dump_path(directory, r)) as f:
                    texts[r] = f.read()
            except OSError:
                pass
    return {r: parse(t, main_threads.get(r)) for r, t in texts.items()}


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse(text: str, main_thread: int | None = None) -> list[Frame]:
    """faulthandler's dump -> the frames of the main thread (``main_thread``: its ``threading.get_ident()``;
    None: the thread whose stack is longest), outermost first, each with its source line from linecache."""
    threads: dict[int, list] = {}
    current = None
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            current = threads.setdefault(int(m.group(1), 16), [])
            continue
        m = _FRAME.match(line)
        if m and current is not None:
            current.append((m.group(1), int(m.group(2)), m.group(3)))
    if not threads:
        return []
    raw = list(reversed(threads.get(main_thread) if main_thread in threads else max(threads.values(), key=len)))
    # From the launcher's call of fn on: multiprocessing's bootstrap frames say nothing about a hang.
    entry = [i for i, (f, _, name) in enumerate(raw) if name == "worker_main" and f.endswith("rank.py")]
    if entry and entry[-1] + 1 < len(raw):
        raw = raw[entry[-1] + 1:]
    elif entry:
        raw = raw[entry[-1]:]
    return [Frame(f, n, name, linecache.getline(f, n).strip()) for f, n, name in raw]


def _library_roots() -> tuple:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # course_lib/
    return tuple(os.path.realpath(p) + os.sep for p in roots if p)


def _is_library(file: str) -> bool:
    if file.startswith("<frozen"):
        return True
    return os.path.realpath(file).startswith(_library_roots())


def innermost_user_frame(frames: list[Frame]) -> Frame | None:
    """The innermost frame outside the standard library, site-packages and course_lib: the learner's line."""
    for fr in reversed(frames):
        if not _is_library(fr.file):
            return fr
    return None


def waiting_on(frames: list[Frame], finished: bool) -> str:
    """One line: where this rank's own code is waiting (``file:line in fn: code``)."""
    if finished:
        return "finished the call (idle)"
    if not frames:
        return "no stack (the rank did not answer)"
    fr = innermost_user_frame(frames)
    inner = frames[-1]
    if fr is None:
        return f"{inner.where()} in {inner.name}: {inner.code}"
    text = f"{fr.where()} in {fr.name}: {fr.code or '<source unavailable>'}"
    if fr is not inner:
        text += f"  (inside {inner.name})"
    return text


def format_stack(frames: list[Frame]) -> str:
    """Like a traceback: outermost first, each frame with its source line."""
    out = []
    for fr in frames:
        out.append(f'  File "{fr.file}", line {fr.line}, in {fr.name}\n')
        if fr.code:
            out.append(f"    {fr.code}\n")
    return "".join(out)


def _short(file: str) -> str:
    """A path as the learner knows it: ``Cell In[5]`` for a notebook cell, else relative to the working directory."""
    if file.startswith("<"):
        return file
    cell = _cell_name(file)
    if cell:
        return cell
    try:
        rel = os.path.relpath(file)
    except ValueError:
        rel = file
    return rel if not rel.startswith("..") else file


def _cell_name(file: str) -> str | None:
    import sys
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython
    shell = get_ipython()
    n = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(file)
    return f"Cell In[{n}]" if n is not None else None
