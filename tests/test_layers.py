"""course_lib's architecture, enforced: layers in order, no upward imports, no cycles, no private names
borrowed across modules, modules of a readable length.

The layers, lowest first (a module may import its own layer and any lower one):

    runtime -> comm -> maths -> launch -> models -> strategies -> checks -> widgets -> bench -> authoring

Top-level modules (``course_lib/__init__.py``, ``__main__.py`` and the scripts run with ``python -m``)
are entry points and may import any layer. Function-level (lazy) imports count like any other.
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
LAYERS = ("runtime", "comm", "maths", "launch", "models", "strategies", "checks", "widgets", "bench", "authoring")
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


def layer_name(module: str) -> str:
    i = layer_of(module)
    return LAYERS[i] if i < len(LAYERS) else "entry point"


def layer_of(module: str) -> int:
    """Index in LAYERS; entry points (top-level modules) rank above every layer."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return len(LAYERS)


def _is_package(module: str, modules: dict[str, str]) -> bool:
    return any(m.startswith(module + ".") for m in modules)


def imports_of(module: str, source: str, modules: dict[str, str]):
    """``(imported module, imported names)`` for every course_lib import in ``source``, at any depth."""
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


def violations(modules: dict[str, str]) -> list[str]:
    """Every broken rule, one line each ([] when the architecture holds)."""
    problems, edges = [], {m: set() for m in modules}
    for module, source in modules.items():
        for target, names in imports_of(module, source, modules):
            if target not in modules:
                problems.append(f"{module} imports {target}, which does not exist")
                continue
            if target != module:
                edges[module].add(target)
            if layer_of(target) > layer_of(module):
                problems.append(f"{module} (layer {layer_name(module)}) imports {target} "
                                f"(layer {layer_name(target)}): a lower layer must not import a higher one")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
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


def test_the_package_follows_its_layers():
    assert violations(module_sources()) == []


def test_the_checker_catches_an_upward_import_a_private_name_and_a_cycle():
    """The rule above would fail on a violation: shown here on a copy of the package with three faults."""
    modules = module_sources()
    modules["course_lib.maths.costs"] += "\n\ndef _f():\n    from course_lib.strategies import fsdp\n"
    modules["course_lib.maths.memory"] += "\nfrom course_lib.maths.sharding import _private_helper\n"
    modules["course_lib.maths.sharding"] += "\nfrom course_lib.maths import memory\n"
    found = violations(modules)
    assert any("course_lib.maths.costs (layer maths) imports course_lib.strategies.fsdp (layer strategies)" in p
               for p in found), found
    assert any("private name(s) _private_helper" in p for p in found), found
    assert any(p.startswith("import cycle:") and "course_lib.maths.memory" in p for p in found), found


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
    missing = [name for name in module_sources()
               if name.count(".") == 2 and leaf(name.rsplit(".", 1)[1]) not in doc]
    assert missing == [], f"not placed in course_lib/__init__.py's docstring: {missing}"


@pytest.mark.parametrize("forbidden", ["torch.distributed", "jax"])
def test_import_course_lib_stays_light(forbidden):
    code = f"import sys, course_lib; print('{forbidden}' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", f"import course_lib imported {forbidden}"
