"""What the ranks' answers to a start or a call mean when not every rank returned: whether the ranks are kept, and
the :class:`~.results.RankError` or :class:`~.results.LaunchTimeout` that names the ranks and what became of them.

:mod:`.pool` collects the answers (and, for a hang, every rank's stack: :mod:`.stacks`); this module judges them:
a dead rank is the cause (the others' errors its echo); else the first rank that raised, with its own frames; else
a hang, told with where each unfinished rank waits, from the collective counts every rank publishes live.
"""
from __future__ import annotations

from course_lib.launch.results import LaunchTimeout, RankError, describe_deaths, ranks_text

MAIN_GUARD_EXIT = 87  #: a rank's exit code when the script it re-imports calls run() at import time
MAIN_GUARD_TEXT = ("this script calls course_lib.run() at import time: every rank re-imports the script, so "
                   "put the call under `if __name__ == \"__main__\":`")
OP_NAMES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "barrier", "send", "recv",
            "reduce", "gather", "scatter")


def facts(error: tuple) -> dict:
    """The rank's judgement of its own raise (:func:`.rank.error_facts`); empty for a raise during the start."""
    return error[3] if len(error) > 3 else {}


def stuck_after_error(errors: dict, pending: list, prog: list) -> bool:
    """A rank still running has issued more collectives than a rank that raised: it waits for one that never comes."""
    counts = [facts(e).get("collectives") for e in errors.values()]
    if not pending or None in counts:
        return False
    return any(prog[r] > min(counts) for r in pending)


def kill_reason(finals: dict, errors: dict, dead: dict, world_size: int, what: str) -> str | None:
    """Why the ranks must go, or None to keep them (and what a %%ranks cell left in them): every rank answered and
    none of the raises came from inside a collective, so the process group is in step."""
    missing = [r for r in range(world_size) if r not in finals and r not in errors and r not in dead]
    in_collective = any(facts(e).get("in_collective", True) for e in errors.values())
    if what == "call" and errors and not dead and not missing and (len(errors) == world_size or not in_collective):
        return None
    if dead:
        return f"after {describe_deaths(dead)}"
    if errors and missing:
        return (f"after rank {min(errors)}'s error ({ranks_text(missing)} "
                f"{'was' if len(missing) == 1 else 'were'} still running or waiting for it)")
    if errors:
        return f"after rank {min(errors)}'s error inside a collective (the process group may be broken)"
    return "after the hang"


def error(finals: dict, errors: dict, dead: dict, what: str, world_size: int, progress: list, *, timeout_s,
          stall_s, spell, frames: dict) -> RankError:
    """The error to raise; ``stall_s``: set when the call ended because no rank progressed for that long."""
    if dead:  # a dead rank is the cause; the others' errors are usually its echo
        first = min(dead)
        if what == "start" and set(dead.values()) == {MAIN_GUARD_EXIT}:
            return RankError(first, "RankDied", MAIN_GUARD_TEXT, "", {})
        others = {r: e[0] for r, e in errors.items()}
        return RankError(first, "RankDied", f"{describe_deaths(dead)} during the {what}; {spell.died}", "", others)
    if errors:
        first = min(errors)
        exc_type, message, tb = errors[first][:3]
        others = {r: e[0] for r, e in errors.items() if r != first}
        return RankError(first, exc_type, message, tb, others, own_traceback=facts(errors[first]).get("own"))
    missing = [r for r in range(world_size) if r not in finals]
    where, slow = _where(progress, world_size, missing) if what == "call" else ("", missing[0])
    done = ranks_text(sorted(finals), bare=True) or "none"
    if stall_s and what == "call":
        text = (f"{ranks_text(missing)} did not finish: a rank waited in a collective for {stall_s:g} s while no "
                f"rank made progress (finished: {done}){where}. A rank that skips a collective leaves the others "
                f"waiting in it. {spell.ended} ({spell.wait})")
    else:
        text = (f"{ranks_text(missing)} did not finish the {what} within {timeout_s:g} s (finished: {done}){where}. "
                f"A rank that skips a collective leaves the others waiting in it. {spell.ended} ({spell.longer})")
    return LaunchTimeout(slow, "LaunchTimeout", text, "", frames=frames, finished=set(finals), stacks_hint=spell.stacks)


def _where(prog: list, world_size: int, missing: list):
    """Where the unfinished ranks wait, from the collective counts every rank publishes live (3 numbers per rank:
    collectives issued, the last one's op, its bytes)."""
    count = {r: prog[3 * r] for r in range(world_size)}
    top = max(count[r] for r in missing)
    if top == 0:
        return "; none of them issued a collective in this call (still computing?)", missing[0]
    ahead = [r for r in missing if count[r] == top]
    behind = [r for r in range(world_size) if count[r] < top]
    r0 = ahead[0]
    op = OP_NAMES[prog[3 * r0 + 1]] if prog[3 * r0 + 1] < len(OP_NAMES) else "a collective"
    if not behind:
        return f"; all wait in {op} #{top} ({prog[3 * r0 + 2]} B)", missing[0]
    done = [r for r in behind if r not in missing]
    verb = "waits" if len(ahead) == 1 else "wait"
    text = f": {ranks_text(ahead)} {verb} in {op} #{top} ({prog[3 * r0 + 2]} B); {ranks_text(behind)} never issued it"
    if done:
        text += f" ({ranks_text(done)} returned without it)"
    return text, behind[0]
