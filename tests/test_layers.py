"""aiak's imports run one way: ``cli -> api -> tune -> apply -> strategy -> {step, amp, optim, comm, loaders, ops,
runtime, measure} -> util`` (ARCHITECTURE.md). Read from the source, imports inside functions included, so a
circle cannot hide behind a deferred import.

An import inside a function is allowed for an optional dependency (not checked here: those are not ``aiak``),
in the command line (its start-up time: each subcommand loads what it runs) and in the lazy ``aiak/__init__.py``.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1] / "aiak"

# Higher imports lower. Packages of one layer may import each other as long as no circle forms.
LAYERS: Dict[str, int] = {
    "cli": 9, "integrations": 9,
    "api": 8,
    "tune": 7,
    "apply": 6,
    "strategy": 5,
    "step": 4, "amp": 4, "optim": 4, "comm": 4, "loaders": 4, "ops": 4, "runtime": 4, "measure": 4,
    "util": 1,
}
FUNCTION_IMPORTS_ALLOWED = {"cli", "aiak"}   # CLI start-up; the package's lazy attributes
# Modules that import an optional dependency at their top: imported where that dependency is needed.
OPTIONAL = {"aiak.ops._triton.window_attention": "triton", "aiak.optim._triton.layerwise": "triton"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports() -> List[Tuple[str, str, bool, int]]:
    """(importer, imported, inside a function?, line) for every import of an ``aiak`` module."""
    modules = _modules()
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[: len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([child.module] if child.module else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
                for target in targets:
                    if target == "aiak" or target.startswith("aiak."):
                        found.append((name, target, inside, child.lineno))
                visit(child, inside)

        visit(ast.parse(path.read_text()), False)
    return found


def _unit(module: str) -> str:
    """The layer's member a module belongs to: ``aiak.step.controller`` -> ``step``, ``aiak.api`` -> ``api``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "aiak"


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {"aiak"}
    assert units <= set(LAYERS), f"modules outside every layer: {sorted(units - set(LAYERS))} (add them to LAYERS " \
                                 f"and ARCHITECTURE.md)"


def test_no_import_runs_up_a_layer():
    upward = [f"{a} -> {b} (line {line})" for a, b, _, line in _imports()
              if _unit(a) != "aiak" and _unit(b) != "aiak" and LAYERS[_unit(a)] < LAYERS[_unit(b)]]
    assert not upward, "imports running back up a layer:\n" + "\n".join(upward)


def test_no_package_of_one_layer_imports_another_in_a_circle():
    graph: Dict[str, Set[str]] = {}
    for a, b, _, _ in _imports():
        ua, ub = _unit(a), _unit(b)
        if ua != ub and "aiak" not in (ua, ub):
            graph.setdefault(ua, set()).add(ub)
    assert not _circles(graph), f"package circles: {_circles(graph)}"


def test_no_module_circle():
    graph: Dict[str, Set[str]] = {}
    for a, b, _, _ in _imports():
        if a != b and b != "aiak" and not (a.startswith(b + ".")):   # a package's own modules may import its face
            graph.setdefault(a, set()).add(b)
    assert not _circles(graph), f"module circles: {_circles(graph)}"


def test_imports_inside_functions_only_where_start_up_time_asks_for_them():
    deferred = [f"{a} -> {b} (line {line})" for a, b, inside, line in _imports()
                if inside and _unit(a) not in FUNCTION_IMPORTS_ALLOWED and b not in OPTIONAL]
    assert not deferred, "aiak imports inside functions (move them to the top of the module):\n" + "\n".join(deferred)


def _circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            connect(node)
    return found
