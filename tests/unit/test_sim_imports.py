"""The simulator's modules import one another in one direction: no module of hybridserve/sim
imports another that imports it back (directly or round a longer circle), counting the imports
made for type checking and inside functions, and none imports another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridserve.sim

SIM = Path(hybridserve.sim.__file__).parent
PACKAGE = "hybridserve.sim"


def _imports(source: str) -> list[tuple[str, list[str]]]:
    """Every import in a module's source, wherever it is: (module imported, names taken)."""
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the simulator's own package
                base = PACKAGE if node.level == 1 else PACKAGE.rsplit(".", node.level - 1)[0]
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names = [alias.name for alias in node.names]
            if module == PACKAGE:  # from hybridserve.sim import run
                found.extend((f"{PACKAGE}.{name}", []) for name in names)
            else:
                found.append((module, names))
    return found


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(SIM.glob("*.py")) if p.stem != "__init__"}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {m.removeprefix(f"{PACKAGE}.") for m, _ in _imports(path.read_text())}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among the modules, as the path round it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_simulator_modules_import_without_a_circle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_the_circle_finder_sees_imports_inside_functions_and_for_type_checking() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from hybridserve.sim.fleet import FleetConfig\n"
        "def f():\n    from hybridserve.sim import loop\n    from .pd import parse_pd\n"
    )
    found = [module for module, _ in _imports(source)]
    assert found[1:] == ["hybridserve.sim.fleet", "hybridserve.sim.loop", "hybridserve.sim.pd"]


def test_no_simulator_module_imports_another_modules_private_names() -> None:
    private = [
        f"{name}.py: {module}.{imported}"
        for name, path in _modules().items()
        for module, names in _imports(path.read_text())
        if module.startswith("hybridserve.")
        for imported in names
        if imported.startswith("_")
    ]
    assert not private, private
