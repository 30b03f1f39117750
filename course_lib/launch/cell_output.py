"""How the ranks' output is shown in the notebook, every line labelled with its rank: the one owner of labelling.

A ``run()`` call prints each rank's line as it comes, ``[rank r] ...`` (:func:`print_labelled`, :func:`flush_labelled`,
called by :mod:`.pool`). While a ``%%ranks`` cell runs, its :class:`CellOutput` (attached by :mod:`.magic`, on
:data:`SINKS` until it finishes) takes the lines instead:

A rank's line shows as it comes, ``[rank r] ...``, once it is :data:`STREAM_AFTER_S` old; when the cell ends its output
is replaced (``clear_output``) by the grouped view, ranks that printed the same lines shown once
(``[ranks 0–3] ...``), which is shorter and reads rank by rank. Why held a second, then replaced: nbval compares a
cell's stored output and ignores ``clear_output``, so a cell that streamed would be compared with its live lines
*and* the grouped view. A cell that prints and ends within a second -- every ``%%ranks`` cell of Labs 00 and 04 --
streams nothing and emits the grouped view alone, exactly the stored form; a long cell shows its progress live.
"""
from __future__ import annotations

import sys
import time

STREAM_AFTER_S = 1.0    #: a rank's line shows before the cell ends once it is this old
SINKS: list = []        #: while a %%ranks cell runs: its CellOutput (CellOutput.attach, .finish)
_partial: dict = {}     # (rank, stream) -> the unfinished last line a run() call's rank printed


def print_labelled(rank: int, stream: str, text: str) -> None:
    """A rank's output: to the running %%ranks cell's :class:`CellOutput`, else printed line by line as
    ``[rank r] line`` (an unfinished line waits for its end or :func:`flush_labelled`)."""
    if SINKS:
        SINKS[-1].add(rank, stream, text)
        return
    *lines, rest = (_partial.get((rank, stream), "") + text).split("\n")
    target = sys.stdout if stream == "stdout" else sys.stderr
    for line in lines:
        target.write(f"[rank {rank}] {line}\n")
    _partial[(rank, stream)] = rest


def tick() -> None:
    """Often, while the ranks run: the %%ranks cell streams the lines that waited long enough."""
    for sink in SINKS:
        sink.tick()


def flush_labelled() -> None:
    """The unfinished last lines of a run() call's ranks, printed."""
    for (rank, stream), rest in list(_partial.items()):
        if rest:
            (sys.stdout if stream == "stdout" else sys.stderr).write(f"[rank {rank}] {rest}\n")
    _partial.clear()
    sys.stdout.flush()


class CellOutput:
    """A ``%%ranks`` cell's rank output: every rank's text, for the grouped view at the end; lines shown as they come
    once they are STREAM_AFTER_S old. The pool calls ``add`` (a rank's text arrived) and ``tick`` (often)."""

    def __init__(self, notes: list):
        self.parts: dict = {}      # (rank, stream) -> [text, ...]
        self.held: list = []       # (arrived, rank, stream, text) not shown yet
        self.partial: dict = {}    # (rank, stream) -> the shown text's unfinished last line
        self.streamed = False
        self.notes = notes         # what the cell printed before the ranks' output: said again after the clear

    def attach(self) -> None:
        """From now on the ranks' output comes here (:func:`print_labelled`), until :meth:`finish`."""
        SINKS.append(self)

    def add(self, rank: int, stream: str, text: str) -> None:
        self.parts.setdefault((rank, stream), []).append(text)
        self.held.append((time.monotonic(), rank, stream, text))

    def tick(self) -> None:
        if not self.held or time.monotonic() - self.held[0][0] < STREAM_AFTER_S:
            return
        for _, rank, stream, text in self.held:
            *lines, rest = (self.partial.get((rank, stream), "") + text).split("\n")
            target = sys.stdout if stream == "stdout" else sys.stderr
            for ln in lines:
                target.write(f"[rank {rank}] {ln}\n")
                self.streamed = True
            self.partial[(rank, stream)] = rest
        self.held.clear()
        sys.stdout.flush()
        sys.stderr.flush()

    def finish(self) -> None:
        if self in SINKS:
            SINKS.remove(self)
        if self.streamed:   # the live lines give way to the grouped view
            from IPython.display import clear_output
            clear_output(wait=True)
            for note in self.notes:
                print(note, file=sys.stderr)
            sys.stderr.flush()
        _print_grouped(self.parts)


def _print_grouped(parts: dict) -> None:
    """Each rank's output, ranks that printed the same text shown once: ``[ranks 0–3] line``."""
    from course_lib.launch.results import ranks_text
    for stream, target in (("stdout", sys.stdout), ("stderr", sys.stderr)):
        texts = {r: "".join(p) for (r, s), p in sorted(parts.items()) if s == stream}
        groups: dict = {}
        for r, text in texts.items():
            groups.setdefault(text, []).append(r)
        for text, rs in sorted(groups.items(), key=lambda kv: kv[1][0]):
            label = ranks_text(rs)
            for line in text.rstrip("\n").split("\n") if text else []:
                target.write(f"[{label}] {line}\n")
        target.flush()
