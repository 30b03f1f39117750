"""course_lib's architecture, enforced: a declared graph of layers, no import against it (a plain import,
a lazy one inside a function, or a string handed to ``importlib.import_module`` / ``__import__``), no cycles,
no private names borrowed across modules, modules of a readable length.

``LAYERS`` and ``MAY_IMPORT`` are the one statement of the layers (the package docstring and the layers'
``__init__`` docstrings refer here): a module of layer X may import its own layer and the layers listed for X,
nothing else. Two more kinds of module sit outside the layers: the package itself (``course_lib/__init__.py``, the
public API notebooks import) and the entry aliases at the package root (``__main__``, ``train``,
``train_jax``, ``torchrun_demo``), which hand over to ``apps``.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "course_lib"
#: The layers, lowest first (the order the package docstring draws them in).
LAYERS = ("runtime", "comm", "maths", "launch", "models", "measure", "strategies", "checkpoint", "checks", "widgets",
          "authoring", "bench", "apps")
_BASE = {"runtime", "comm", "maths"}
#: Which layers a layer may import (besides itself). A layer may only name layers before it in LAYERS.
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": set(),
    "comm": {"runtime"},
    "maths": {"runtime", "comm"},
    "launch": _BASE,
    "models": _BASE,
    "measure": _BASE,
    "strategies": _BASE | {"launch", "models", "measure"},
    "checkpoint": _BASE | {"launch", "models", "strategies"},   # saves what the strategies shard; not a parallelism
    "checks": _BASE | {"launch", "models", "measure", "strategies", "checkpoint"},
    "widgets": _BASE | {"measure"},
    "authoring": {"runtime"},                                  # reads and writes notebooks: no torch, no JAX
    "bench": _BASE | {"launch", "models", "measure", "strategies", "widgets", "authoring"},   # bench labs: runs labs
    "apps": set(LAYERS[:-1]) | {"api"},
    "api": {"runtime", "comm", "launch"},                      # course_lib/__init__.py
    "entry": {"apps"},                                         # course_lib/__main__.py and the aliases
}
MAX_LINES = 300
LONG_REASON = "Longer than ~300 lines"   # what a module's docstring must say to exceed MAX_LINES


def module_sources(pkg: Path = PKG) -> dict[str, str]:
    """``{"course_lib.maths.costs": source, ...}`` for every module of the package."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(pkg.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path.read_text()
    return out


def layer_of(module: str) -> str:
    """The layer a module belongs to: a subpackage's name, ``api`` for the package, ``entry`` for the rest."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    return parts[1] if parts[1] in LAYERS else "entry"


def allowed(importer: str, imported: str) -> bool:
    a, b = layer_of(importer), layer_of(imported)
    return a == b or b in MAY_IMPORT[a]


def _is_package(module: str, modules: dict[str, str]) -> bool:
    return any(m.startswith(module + ".") for m in modules)


_STRING_IMPORTERS = {"import_module", "__import__", "run_module"}


def _string_target(node: ast.AST) -> str | None:
    """The module a string import names: the whole constant, or for an f-string the package its constant
    prefix names (``f"course_lib.bench.{what}"`` -> ``course_lib.bench``, any module of it)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        prefix = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                break
            prefix += part.value
        return prefix.rstrip(".").rpartition(".")[0] if not prefix.endswith(".") else prefix.rstrip(".")
    return None


def _is_dynamic(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr)


def imports_of(module: str, source: str, modules: dict[str, str]):
    """``(imported module, imported names)`` for every course_lib import in ``source``, at any depth,
    names None for a module a string computes at run time; string imports (``importlib.import_module("course_lib....")``, ``__import__``, ``runpy.run_module``) included."""
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "course_lib":
                    yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "course_lib":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub, []) if sub in modules else (base, [alias.name])
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            target = _string_target(node.args[0]) if name in _STRING_IMPORTERS else None
            if target and target.split(".")[0] == "course_lib":
                # an f-string names *some* module of a package: held to the layer rule, not a cycle edge
                yield target, (None if _is_dynamic(node.args[0]) else [])


def violations(modules: dict[str, str]) -> list[str]:
    """Every broken rule, one line each ([] when the architecture holds)."""
    problems, edges = [], {m: set() for m in modules}
    for module, source in modules.items():
        for target, names in imports_of(module, source, modules):
            if target not in modules:
                problems.append(f"{module} imports {target}, which does not exist")
                continue
            if target != module and names is not None:
                edges[module].add(target)
            if not allowed(module, target):
                a, b = layer_of(module), layer_of(target)
                problems.append(f"{module} (layer {a}) imports {target} (layer {b}): {a} may import only "
                                f"{', '.join(sorted(MAY_IMPORT[a])) or 'nothing'} (MAY_IMPORT in tests/test_layers.py)")
            private = [n for n in names or [] if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{module} imports private name(s) {', '.join(private)} from {target}: "
                                "make them public there, or keep the code in one module")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(edges)]
    return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


# ------------------------------------------------------------------------------------------- tests
def test_every_subpackage_is_a_known_layer():
    subpackages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(LAYERS), f"unknown or missing layers: {subpackages ^ set(LAYERS)}"


def test_the_declared_graph_points_down_only():
    """A layer names only layers before it in LAYERS: the graph has no cycle, and LAYERS is its order."""
    for layer, may in MAY_IMPORT.items():
        if layer in LAYERS:
            later = [m for m in may if m in LAYERS and LAYERS.index(m) >= LAYERS.index(layer)]
            assert not later, f"{layer} may import {later}, which are not below it in LAYERS"


def test_the_package_follows_its_layers():
    assert violations(module_sources()) == []


def test_the_checker_catches_an_upward_import_a_string_import_a_private_name_and_a_cycle():
    """The rule above would fail on a violation: shown here on a copy of the package with five faults."""
    modules = module_sources()
    modules["course_lib.maths.costs"] += "\n\ndef _f():\n    from course_lib.strategies.fsdp import scratch\n"
    modules["course_lib.maths.step_model"] += ("\n\ndef _g(what):\n    import importlib\n"
                                               "    return importlib.import_module(f'course_lib.bench.{what}')\n")
    modules["course_lib.widgets.base"] += "\n\ndef _h():\n    return __import__('course_lib.launch.pool')\n"
    modules["course_lib.maths.memory"] += "\nfrom course_lib.maths.sharding import _private_helper\n"
    modules["course_lib.maths.sharding"] += "\nfrom course_lib.maths import memory\n"
    found = violations(modules)
    assert any("course_lib.maths.costs (layer maths) imports course_lib.strategies.fsdp.scratch (layer strategies)"
               in p for p in found), found
    assert any("course_lib.maths.step_model (layer maths) imports course_lib.bench (layer bench)" in p
               for p in found), found
    assert any("course_lib.widgets.base (layer widgets) imports course_lib.launch.pool (layer launch)" in p
               for p in found), found
    assert any("private name(s) _private_helper" in p for p in found), found
    assert any(p.startswith("import cycle:") and "course_lib.maths.memory" in p for p in found), found


def test_the_cli_string_import_is_seen():
    """``apps.cli`` loads a benchmark by a string: the checker sees it as an import of ``course_lib.bench``."""
    src = module_sources()
    assert ("course_lib.bench", None) in list(imports_of("course_lib.apps.cli", src["course_lib.apps.cli"], src))


def test_layer_docstrings_name_the_layer_not_a_number():
    """Each layer's ``__init__`` says which layer it is by name; a number ("Layer 6") drifts when layers move."""
    import course_lib
    bad = []
    for layer in LAYERS:
        doc = ast.get_docstring(ast.parse((PKG / layer / "__init__.py").read_text())) or ""
        if not doc.startswith(f"The {layer} layer") or re.search(r"\blayer \d", doc, re.I):
            bad.append(f"{layer}/__init__.py: {doc.splitlines()[0] if doc else '(no docstring)'}")
    assert bad == [], "start each layer's docstring with 'The <name> layer', and give no number:\n" + "\n".join(bad)
    assert not re.search(r"^\s*\d+ \w+/", course_lib.__doc__, re.M), "course_lib's docstring numbers its layers"


def test_modules_stay_readable():
    """~300 lines is the norm; a longer module says why in its docstring."""
    long = []
    for name, source in module_sources().items():
        lines = source.count("\n")
        doc = ast.get_docstring(ast.parse(source)) or ""
        if lines > MAX_LINES and LONG_REASON not in doc:
            long.append(f"{name}: {lines} lines, and its docstring does not say '{LONG_REASON}: <why>'")
    assert long == []


def test_every_module_is_placed_in_the_package_docstring():
    """The package docstring draws the layers and names every module, so a newcomer can find one."""
    import course_lib
    doc = course_lib.__doc__
    leaf = lambda name: "labNN" if re.fullmatch(r"lab\d\d", name) else name   # noqa: E731 (checks.labNN)
    missing = []
    for name in module_sources():
        parts = name.split(".")
        if len(parts) == 3 and leaf(parts[2]) not in doc:
            missing.append(name)
        if len(parts) == 4 and not re.search(rf"{parts[2]}/[^\n]*\b{parts[3]}\b", doc):
            missing.append(name)
        if len(parts) == 3 and _is_package(name, module_sources()) and f"{parts[2]}/" not in doc:
            missing.append(name)
    assert missing == [], f"not placed in course_lib/__init__.py's docstring: {missing}"


@pytest.mark.parametrize("forbidden", ["torch.distributed", "jax"])
def test_import_course_lib_stays_light(forbidden):
    code = f"import sys, course_lib; print('{forbidden}' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"import course_lib imported {forbidden}"
