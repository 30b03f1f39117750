"""Read the collectives of a compiled JAX program from its HLO text into a :class:`~course_lib.comm.ledger.Ledger`.

One SPMD program runs on every device, so each record has ``rank=-1`` and ``source="jax-hlo"``;
payloads follow the ledger's convention ``V`` (all-gather: the gathered output; reduce-scatter: the full
input = output x group size; all-reduce, all-to-all, collective-permute: the tensor). Tuple-shaped
(combined) ops count once with the sum of their parts; async pairs count once, at ``*-start``; an op
inside a ``while`` body with a ``known_trip_count`` is recorded once per iteration (a ``lax.scan`` over
layers issues its all-gather ``L`` times). ``phase`` is a guess from ``metadata={op_name=...}``:
``transpose(jvp(...))`` is backward, ``jvp(...)`` forward, anything else ``None``.

What XLA:CPU emits (jax 0.10.2, 8 simulated devices; compiled in ``tests/test_ledger_jax.py``):

* ``shard_map`` keeps what you wrote: ``lax.all_gather`` -> ``all-gather``, ``lax.psum_scatter`` ->
  ``reduce-scatter``, ``lax.psum`` -> ``all-reduce`` (several psum'd tensors -> one tuple all-reduce),
  ``ppermute`` -> ``collective-permute``, ``all_to_all`` -> a tuple ``all-to-all`` of N chunks.
* Automatic (``jit`` + ``NamedSharding``) FSDP: the partitioner all-gathers each sharded weight once
  and keeps it for backward (gathered again only under ``jax.checkpoint``, or per layer in a
  ``lax.scan``), and turns the sharded gradient into a full-size ``all-reduce`` + ``dynamic-slice``:
  XLA:CPU has no pass that rewrites that pair into a ``reduce-scatter`` (XLA:GPU runs
  ``ReduceScatterCreator``) and combines the all-reduces (and the loss's) into one tuple op. The
  total, (1 + 2)(N-1)/N Ψ, equals ZeRO-3's 3(N-1)/N Ψ by coincidence; the split differs. With a small
  batch the partitioner may move activations instead (``all-to-all`` + ``all-gather``).
* A ``bfloat16`` psum is promoted: the all-reduce runs in ``f32`` (twice the payload). No async
  ``*-start``/``*-done`` forms on CPU; parsed for GPU (jax 0.11: ``((operands...), outputs)`` start shapes).
* Replica groups come in three spellings, all parsed: explicit ``{{0,1},{2,3}}``, iota
  ``[2,4]<=[8]`` / ``[2,2]<=[2,2]T(1,0)``, and the mesh form ``mesh['axis_0'=8,'axis_1'=1] {'axis_0'}``
  (optionally ``, device_ids=([2,4]T(1,0))`` and sub-axes ``'a':(2)4``). XLA's axis names there are its
  own, not your mesh's: pass ``mesh`` to get your axis names back.

Device numbers in replica groups are *logical*: positions in the program's device assignment, which
for a ``jit`` over a ``Mesh`` is ``mesh.devices.flat``. This module never imports JAX.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import numpy as np

from course_lib.comm.ledger import CollectiveRecord, Ledger

__all__ = ["from_hlo_text", "from_compiled", "parse_collectives", "parse_replica_groups", "HloCollective"]

#: HLO opcode -> canonical op. ``*-done`` and generic ``async-start``/``async-done`` are not listed:
#: the op is counted at its start, or inside the async computation it wraps.
HLO_OPS = {"all-gather": "all_gather", "all-gather-start": "all_gather", "reduce-scatter": "reduce_scatter",
           "all-reduce": "all_reduce", "all-reduce-start": "all_reduce", "all-to-all": "all_to_all",
           "collective-permute": "collective_permute", "collective-permute-start": "collective_permute",
           "collective-broadcast": "broadcast", "reduce-scatter-start": "reduce_scatter"}
_SPECIAL = {"pred": (8, "bool"), "bf16": (16, "bfloat16"), "c64": (64, "complex64"),
            "c128": (128, "complex128"), "token": (0, "token")}


def _element(dtype: str) -> tuple[int, str]:
    """Bits and name of an HLO element type: ``f32`` -> (32, "float32"), ``f8e4m3fn`` -> (8, "float8_e4m3fn")."""
    if dtype in _SPECIAL:
        return _SPECIAL[dtype]
    m = re.fullmatch(r"([suf])(\d+)(\w*)", dtype)
    if not m:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    kind = {"s": "int", "u": "uint", "f": "float"}[m.group(1)]
    return int(m.group(2)), kind + m.group(2) + (f"_{m.group(3)}" if m.group(3) else "")


# -- shapes: f32[8,64]{1,0}, (f32[], bf16[2,3]{1,0}), nested tuples -----------------------------------
_LEAF = re.compile(r"(\w+)\[([^\]]*)\](?:\{[^}]*\})?")


def _parse_shape(s: str, i: int = 0):
    """Parse a shape at ``s[i:]``: a leaf ``(dtype, dims)`` or a list of shapes. Returns (shape, end)."""
    i += len(s[i:]) - len(s[i:].lstrip(" "))
    if s[i] == "(":
        items, i = [], i + 1
        while True:
            while s[i] in " ,":
                i += 1
            if s[i] == ")":
                return items, i + 1
            item, i = _parse_shape(s, i)
            items.append(item)
    m = _LEAF.match(s, i)
    if not m:
        raise ValueError(f"cannot parse an HLO shape at {s[i:i + 40]!r}")
    dims = tuple(int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip())
    return (m.group(1), dims), m.end()


def _leaves(shape) -> list:
    return [shape] if isinstance(shape, tuple) else [leaf for s in shape for leaf in _leaves(s)]


def _nbytes(leaves) -> int:
    return sum(math.ceil(math.prod(dims) * _element(dt)[0] / 8) for dt, dims in leaves)


# -- replica groups --------------------------------------------------------------------------------
def _iota(dims, perm=None) -> np.ndarray:
    a = np.arange(math.prod(dims)).reshape(dims)
    return a.transpose(perm) if perm is not None else a


def _ints(text: str) -> list[int]:
    return [int(v) for v in re.findall(r"\d+", text)]


_EXPLICIT = re.compile(r"\{((?:\{[\d,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"(?:@mesh<(?P<a>[^>]*)>|mesh\[(?P<b>[^\]]*)\])"
                   r"(?:,\s*device_ids=\((?P<ids>\[[\d,]+\](?:T\([\d,]+\))?|[\d,\s]*)\))?\s*\{(?P<sel>[^}]*)\}")


def _mesh_groups(m: re.Match) -> np.ndarray:
    decl = [p.split("=") for p in (m.group("a") or m.group("b")).split(",")]
    names = [n.strip().strip("'") for n, _ in decl]
    sizes = [int(v) for _, v in decl]
    ids = m.group("ids") or ""
    if ids.startswith("["):  # an iota, as in the [G,S]<=[dims]T(perm) form
        dims, perm = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", ids).groups()
        grid = _iota(_ints(dims), _ints(perm) if perm else None).reshape(sizes)
    else:
        grid = (np.array(_ints(ids)) if ids else np.arange(math.prod(sizes))).reshape(sizes)
    refs = []  # (axis index, pre-size, size): 'a' is (a, 1, |a|); 'a':(2)4 is the size-4 factor after 2
    for sel in filter(None, (t.strip() for t in m.group("sel").split(","))):
        name, pre, size = re.fullmatch(r"'?([^':()]+)'?(?::\((\d+)\)(\d+))?", sel).groups()
        k = names.index(name)
        refs.append((k, int(pre or 1), int(size or sizes[k])))
    # split every axis into factors (major to minor) at the sub-axis boundaries the refs use
    factors, where = [], {}
    for k, s in enumerate(sizes):
        cuts = sorted({1, s} | {p for kk, p, _ in refs if kk == k} | {p * z for kk, p, z in refs if kk == k})
        for lo, hi in zip(cuts, cuts[1:]):
            where[(k, lo)] = len(factors)
            factors.append(hi // lo)
    chosen = []
    for k, pre, size in refs:
        cuts = sorted(p for kk, p in where if kk == k and pre <= p < pre * size)
        chosen += [where[(k, p)] for p in cuts]
    rest = [f for f in range(len(factors)) if f not in chosen]
    group = math.prod(factors[f] for f in chosen)
    return grid.reshape(factors).transpose(rest + chosen).reshape(-1, group)


def parse_replica_groups(text: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...]:
    """The groups of a ``replica_groups=`` value (``text`` starts at the value), as logical device ids.

    ``{}`` means one group of all ``num_devices`` devices.
    """
    text = text.lstrip()
    if m := _MESH.match(text):
        arr = _mesh_groups(m)
    elif m := _IOTA.match(text):
        g, s, dims, perm = m.groups()
        arr = _iota(_ints(dims), _ints(perm) if perm else None).reshape(int(g), int(s))
    elif m := _EXPLICIT.match(text):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", m.group(1)))
        if groups:
            return groups
        if num_devices is None:
            raise ValueError("replica_groups={} means all devices, but their number is unknown: the HLO "
                             "has no num_partitions/replica_count; pass num_devices=")
        return (tuple(range(num_devices)),)
    else:
        raise ValueError(f"cannot parse replica_groups at {text[:60]!r}")
    return tuple(tuple(int(v) for v in row) for row in arr)


# -- instructions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of an HLO module, as parsed."""

    name: str                   #: the HLO instruction name, e.g. ``all-gather.1``
    opcode: str                 #: e.g. ``all-gather`` or ``all-gather-start``
    op: str                     #: canonical op (:data:`course_lib.comm.ledger.OPS`)
    nbytes: int                 #: payload ``V``
    dtype: str                  #: element type(s), e.g. ``float32`` (several joined by ``,``)
    group_size: int
    groups: tuple[tuple[int, ...], ...]  #: logical device ids; for collective-permute, the pairs
    channel_id: int | None
    use_global_device_ids: bool
    op_name: str | None         #: ``metadata={op_name=...}``: where in the JAX program it came from
    computation: str            #: the HLO computation that holds it
    trip_count: int = 1         #: executions per program run (``while`` bodies with a known trip count)


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[^\s=]+)\s*=\s*")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[^\s(]+)\s*\(.*\{\s*$")


def parse_collectives(text: str, num_devices: int | None = None) -> list[HloCollective]:
    """Every collective instruction in an HLO module's text, in textual order."""
    if num_devices is None:  # `{}` groups span replicas x partitions (SPMD: 1 x N; pmap: N x 1)
        counts = [re.search(rf"{key}=(\d+)", text) for key in ("num_partitions", "replica_count")]
        num_devices = math.prod(int(c.group(1)) for c in counts if c) if any(counts) else None
    found, loops, comp = [], [], "?"
    for line in text.splitlines():
        if (c := _COMP.match(line)) and not line.startswith(" "):
            comp = c.group("name")
            continue
        if not (m := _INSTR.match(line)):
            continue
        rest = re.sub(r"/\*.*?\*/", "", line[m.end():])
        try:
            shape, end = _parse_shape(rest)
        except (ValueError, IndexError):
            continue
        opcode = o.group(1) if (o := re.match(r"\s*([\w-]+)\(", rest[end:])) else ""
        if opcode == "while" and (body := re.search(r"body=%?([^\s,]+)", rest)):
            trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)  # unknown: counted once
            loops.append((comp, body.group(1), int(trips.group(1)) if trips else 1))
        if opcode not in HLO_OPS:
            continue
        op, parts = HLO_OPS[opcode], shape if isinstance(shape, list) else [shape]
        if opcode == "collective-permute-start":
            parts = parts[:1]                     # (input, output, u32[] contexts): V is the buffer
        elif opcode.endswith("-start"):           # (inputs..., outputs...), or XLA:GPU's ((operands...), outputs)
            parts = parts[1:] if isinstance(parts[0], list) else parts[len(parts) // 2:]
        leaves = [leaf for p in parts for leaf in _leaves(p)]
        if pairs := re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?\s*)*\})", rest):
            groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,\s]*)\}", pairs.group(1)[1:-1]))
            size = len({d for g in groups for d in g})
        else:
            rg = rest.find("replica_groups=")  # absent means {}: all devices
            groups = parse_replica_groups(rest[rg + len("replica_groups="):] if rg >= 0 else "{}", num_devices)
            size = len(groups[0])
        nbytes = _nbytes(leaves) * (size if op == "reduce_scatter" else 1)
        dtypes = ",".join(dict.fromkeys(_element(dt)[1] for dt, _ in leaves))
        found.append(HloCollective(
            name=m.group("name"), opcode=opcode, op=op, nbytes=nbytes, dtype=dtypes, group_size=size,
            groups=groups, channel_id=int(ch.group(1)) if (ch := re.search(r"channel_id=(\d+)", rest)) else None,
            use_global_device_ids="use_global_device_ids=true" in rest,
            op_name=on.group(1) if (on := re.search(r'op_name="([^"]*)"', rest)) else None, computation=comp))
    # a while body runs trip_count times per run of the computation holding the while (nesting multiplies)
    mult: dict[str, int] = {}
    for _ in range(len(loops)):
        for parent, body, n in loops:
            mult[body] = n * mult.get(parent, 1)
    return [dataclasses.replace(c, trip_count=mult.get(c.computation, 1)) for c in found]


def _phase(op_name: str | None) -> str | None:
    op_name = op_name or ""
    return "backward" if "transpose(" in op_name else ("forward" if "jvp(" in op_name else None)


def _axis_namer(mesh, ids):
    """A function from groups of logical ids to the mesh axes that vary within them."""
    devices = np.asarray(mesh.devices)
    coords = {d.id: idx for idx, d in np.ndenumerate(devices)}

    def name(groups) -> str | None:
        varying = set()
        for g in groups:
            try:
                cs = [coords[ids[i]] for i in g]
            except (IndexError, KeyError):
                raise ValueError(f"replica group {g} names devices outside the mesh of {devices.size} "
                                 f"devices; pass the mesh the program was compiled for") from None
            varying |= {k for k in range(devices.ndim) if len({c[k] for c in cs}) > 1}
        return ",".join(mesh.axis_names[k] for k in sorted(varying)) or None
    return name


def from_hlo_text(text: str, mesh=None, *, num_devices: int | None = None, device_ids=None) -> Ledger:
    """A ledger of the collectives in HLO ``text`` (``compiled.as_text()``), one record per execution.

    ``mesh`` (a ``jax.sharding.Mesh``, or anything with ``.devices`` and ``.axis_names``) names the axes
    each group spans, e.g. ``"fsdp"`` or ``"replicate,shard"``. ``device_ids[i]`` is the JAX device id of
    logical device ``i``; by default logical ``i`` is ``mesh.devices.flat[i]``. ``group_ranks`` is the
    first group (for collective-permute, every device in a pair), as device ids when ``mesh`` or
    ``device_ids`` says which, else as logical ids.
    """
    if device_ids is None and mesh is not None:
        device_ids = [d.id for d in np.asarray(mesh.devices).flat]
    ids = list(device_ids) if device_ids is not None else None
    namer = _axis_namer(mesh, ids) if mesh is not None else None
    records = []
    for c in parse_collectives(text, num_devices):
        first = c.groups[0] if c.op != "collective_permute" else sorted({d for g in c.groups for d in g})
        rec = CollectiveRecord(
            op=c.op, nbytes=c.nbytes, dtype=c.dtype, group_size=c.group_size, rank=-1,
            group_ranks=tuple(ids[i] if ids and i < len(ids) else i for i in first),
            axis=namer(c.groups) if namer else None, phase=_phase(c.op_name), source="jax-hlo", name=c.name)
        records.extend([rec] * c.trip_count)
    return Ledger(records)


def from_compiled(compiled, mesh=None) -> Ledger:
    """A ledger of ``jax.jit(f).lower(...).compile()``'s collectives (see :func:`from_hlo_text`)."""
    text = compiled.as_text()
    try:  # the program's device assignment, so a mesh built in any device order is named right
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
    except Exception:  # another API: fall back to mesh order
        device_ids = None
    header = re.search(r"num_partitions=(\d+)", text)
    if device_ids and header and len(device_ids) != int(header.group(1)):
        device_ids = None  # multi-process: only this process's devices, not the whole assignment
    return from_hlo_text(text, mesh, device_ids=device_ids)
