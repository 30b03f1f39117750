"""Read a compiled HLO module's *schedule*: is each collective synchronous, or an async start/done pair
with compute placed in between? That window is where XLA overlaps communication with compute.

The JAX/Flax NNX guide "FSDP: Fully Sharded Data Parallel" says XLA overlaps FSDP's all-gathers with
compute; the FSDP paper (Zhao et al., "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
Parallel", VLDB 2023) does the same by hand with streams and prefetch. In a compiled XLA program the
overlap is visible in the text, before anything runs:

* **synchronous form** -- one instruction, ``%all-gather.3 = f32[64,64] all-gather(...)``: the op
  starts and finishes where it stands; nothing is scheduled "during" it. XLA:CPU emits only this form.
* **asynchronous form** -- a pair, ``%all-gather-start = ... all-gather-start(...)`` ...
  ``%all-gather-done = ... all-gather-done(%all-gather-start)``. The compiler's (latency-hiding)
  scheduler moves independent compute -- ``fusion``, ``dot``, ``custom-call`` (cuBLAS) -- between the
  two, and at run time the collective runs on its own stream while those kernels run. Ops without a
  dedicated pair are wrapped: ``async-start(...), calls=%wrapped`` / ``async-done``, which HLO may
  also print as ``reduce-scatter-start`` / ``reduce-scatter-done``. XLA:GPU and XLA:TPU emit these.

The text of a compiled module (``compiled.as_text()``, ``is_scheduled=true``) lists each computation's
instructions in their scheduled order, so counting the compute instructions between a start and its
done measures the window the scheduler opened. Pure text: this module imports neither JAX nor torch.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

__all__ = ["COLLECTIVES", "COMPUTE", "Instruction", "AsyncPair", "instructions", "entry", "collective_forms",
           "async_pairs", "summary"]

#: collective kinds, as HLO spells them
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")
#: opcodes that do the arithmetic of a step (GPU: fusions and cuBLAS/cuDNN custom-calls; CPU: also dots)
COMPUTE = ("fusion", "dot", "convolution", "custom-call")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*(?P<rest>.*)$")
_COMP = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[^\s(]+)\s*(?:\(.*\))?.*\{\s*$")
_OPCODE = re.compile(r"(?:^|[\s)\]}])([a-z][a-z0-9-]*)\(")


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, opcode, operands (names) and the computation holding it."""

    name: str
    opcode: str
    operands: tuple[str, ...]
    computation: str
    calls: str | None = None    #: ``calls=%comp`` of an ``async-start`` (the wrapped op lives there)


def instructions(text: str) -> list[Instruction]:
    """Every instruction of an HLO module's text, in textual (for a scheduled module: scheduled) order."""
    out, comp = [], "?"
    for line in text.splitlines():
        if not line.startswith(" ") and (c := _COMP.match(line)):
            comp = ("ENTRY " if c.group("entry") else "") + c.group("name")
            continue
        if not (m := _INSTR.match(line)):
            continue
        rest = re.sub(r"/\*.*?\*/", "", m.group("rest"))
        if not (o := _OPCODE.search(rest)):
            continue
        args = rest[o.end():]
        depth, end = 1, 0
        for end, ch in enumerate(args):          # the operand list: up to the matching ")"
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        operands = tuple(re.findall(r"%([^\s,()]+)", args[:end]))
        calls = re.search(r"calls=%?([^\s,}]+)", args[end:])
        out.append(Instruction(m.group("name"), o.group(1), operands, comp, calls.group(1) if calls else None))
    return out


def entry(text: str) -> list[Instruction]:
    """The instructions of the ENTRY computation, in scheduled order."""
    return [i for i in instructions(text) if i.computation.startswith("ENTRY ")]


def _kind(ins: Instruction, by_comp: dict[str, list[Instruction]]) -> tuple[str, str] | None:
    """``(collective kind, form)`` with form "sync", "start" or "done"; None for anything else."""
    op = ins.opcode
    if op in COLLECTIVES:
        return op, "sync"
    for form in ("start", "done"):
        base = op[: -len(form) - 1]
        if op.endswith("-" + form) and base in COLLECTIVES:
            return base, form
    if op == "async-start" and ins.calls:        # the wrapped collective, e.g. a reduce-scatter
        wrapped = [i.opcode for i in by_comp.get(ins.calls, []) if i.opcode in COLLECTIVES]
        return (wrapped[0], "start") if wrapped else None
    return None


def collective_forms(text: str) -> Counter:
    """``Counter({("all-gather", "sync"): 10, ("all-gather", "start"): 12, ...})`` over the ENTRY
    computation. Collectives *inside* an async wrapper's computation are not counted again."""
    ins = instructions(text)
    by_comp: dict[str, list[Instruction]] = {}
    for i in ins:
        by_comp.setdefault(i.computation, []).append(i)
    found, starts = Counter(), {}
    for i in ins:
        if not i.computation.startswith("ENTRY "):
            continue
        k = _kind(i, by_comp)
        if k is None and i.opcode == "async-done" and i.operands and i.operands[0] in starts:
            k = (starts[i.operands[0]], "done")
        if k:
            found[k] += 1
            if k[1] == "start":
                starts[i.name] = k[0]
    return found


@dataclass(frozen=True)
class AsyncPair:
    """One async collective in the ENTRY schedule and what the scheduler put inside its window."""

    kind: str           #: e.g. "all-gather"
    start: str          #: name of the ``*-start`` instruction
    done: str           #: name of the matching ``*-done``
    between: int        #: instructions scheduled between the two
    compute: int        #: of those, compute (:data:`COMPUTE`): the work that can run during the transfer


def async_pairs(text: str) -> list[AsyncPair]:
    """Every start/done pair of the ENTRY computation, in scheduled order of the starts."""
    ins = instructions(text)
    by_comp: dict[str, list[Instruction]] = {}
    for i in ins:
        by_comp.setdefault(i.computation, []).append(i)
    sched = [i for i in ins if i.computation.startswith("ENTRY ")]
    pos = {i.name: n for n, i in enumerate(sched)}
    out = []
    for n, i in enumerate(sched):
        k = _kind(i, by_comp)
        if not k or k[1] != "start":
            continue
        done = next((d for d in sched[n + 1:] if i.name in d.operands and d.opcode.endswith("-done")), None)
        if done is None:
            raise ValueError(f"{i.name} ({i.opcode}) has no matching *-done in the ENTRY computation: "
                             "pass the text of a whole compiled module (compiled.as_text())")
        window = sched[n + 1: pos[done.name]]
        out.append(AsyncPair(k[0], i.name, done.name, len(window), sum(w.opcode in COMPUTE for w in window)))
    return out


def summary(text: str) -> dict[str, dict[str, int]]:
    """Per collective kind: ``sync`` instructions, async ``pairs``, and pairs with compute inside
    (``overlapped``) -- the numbers a lab prints and a test asserts."""
    forms, pairs = collective_forms(text), async_pairs(text)
    kinds = sorted({k for k, _ in forms})
    return {k: {"sync": forms[(k, "sync")], "pairs": sum(p.kind == k for p in pairs),
                "overlapped": sum(p.kind == k and p.compute > 0 for p in pairs)} for k in kinds}
