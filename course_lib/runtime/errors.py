"""Looking inside an error: the one walk of causes, groups and DCP's per-rank failures.

The error a check or a checkpointer catches is often a wrapper around the one that matters:

* ``raise B from A`` -- ``A`` is ``B.__cause__``; an error raised while handling another has it as
  ``__context__`` (not a cause: a check does not mistake a crash in an ``except`` block for the error it handled);
* an ``ExceptionGroup`` holds its members in ``exceptions``;
* DCP's ``CheckpointException`` (``torch.distributed.checkpoint.api``) holds each failed rank's error in
  ``failures``: ``{rank: (exception, traceback.StackSummary)}``.

:func:`rank_failures` unwraps the last, :func:`inner_errors` walks all of them (each error once, so a cycle of
causes ends), :func:`root_cause` follows ``__cause__`` to its end. Used by :mod:`course_lib.checks.core` (is
this a stub's ``NotImplementedError``?), Lab 07's checks (the learner's own crash inside DCP's) and
:mod:`course_lib.checkpoint.manager` (a full disk anywhere inside a failed save; the first real error). Imports
neither torch nor JAX: it reads attributes.
"""
from __future__ import annotations

from collections.abc import Iterator

__all__ = ["rank_failures", "inner_errors", "root_cause"]


def rank_failures(exc: BaseException) -> dict[int, tuple[BaseException, list]]:
    """``{rank: (exception, stack frames)}`` of DCP's ``CheckpointException``, ranks in order; ``{}`` for any
    other error. A failure that is not an ``(exception, stack)`` pair is read through its ``exc`` attribute,
    frames ``[]``; one that holds no exception is left out."""
    failures = getattr(exc, "failures", None)
    out = {}
    for rank, f in sorted(failures.items()) if isinstance(failures, dict) else ():
        inner, stack = (f[0], f[1]) if isinstance(f, tuple) and len(f) == 2 else (getattr(f, "exc", f), None)
        if isinstance(inner, BaseException):
            out[rank] = (inner, list(stack or []))
    return out


def inner_errors(exc: BaseException | None, *, context: bool = False, failures: bool = True
                 ) -> Iterator[BaseException]:
    """``exc``, then every error inside it, each once: its ``__cause__`` (and ``__context__`` when
    ``context=True``), an exception group's members, and (``failures=True``) DCP's per-rank failures."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if failures:
            todo += [inner for inner, _ in rank_failures(e).values()]
        todo += [e.__cause__, *(getattr(e, "exceptions", None) or ())]
        if context:
            todo.append(e.__context__)


def root_cause(exc: BaseException) -> BaseException:
    """The end of ``exc``'s chain of ``__cause__`` (``exc`` itself when it has none); a cycle stops where it
    would repeat."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc
