"""The catalogue of wrong answers: a learner's classic mistakes, written as code, one module per lab.

Each module holds ``WRONG``, a list of :class:`Wrong`, and may hold ``RIGHT``, a list of :class:`Right`: valid
alternatives to the reference solution that the checks must keep accepting (no false rejections). ``tests/test_wrong_answer_kinds.py`` runs every one
against its check exactly as the lab's check cell calls it, in lab mode, and asserts the ❌ line and its
diagnosis. Kinds of mistake: :data:`course_lib.checks.registry.KINDS`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Wrong:
    """One wrong answer to one exercise."""

    lab: str          #: "03"
    exercise: str     #: the registry's name ("flat_shard")
    kind: str         #: one of registry.KINDS
    tag: str          #: the mistake the ❌ line must name (a key of the exercise's ``mistakes``)
    source: str       #: the learner's cell: the wrong answer (plus what earlier cells of the lab defined)
    call: str         #: the lab's check call, as its check cell writes it ("lab03.check_flat_shard(flat_shard)")
    why: str          #: one line: what the learner got wrong
    more: tuple[str, ...] = ()   #: more text the ❌ block must hold (e.g. "on rank")


@dataclass(frozen=True)
class Right:
    """A valid alternative answer to one exercise (not the reference's code): its check must pass."""

    lab: str
    exercise: str
    source: str
    call: str
    why: str          #: one line: how it differs from the reference
