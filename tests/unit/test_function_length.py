"""No function in the engine's core packages runs over 60 lines: a longer one is split into
named helpers. Length is end_lineno - lineno + 1 of the def (decorators excluded)."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridserve

MAX_LINES = 60
PACKAGES = ("core", "kvcache", "scheduler", "cli", "engine", "sim")
ROOT = Path(hybridserve.__file__).parent


def long_functions(source: str, *, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of each function in `source` longer than `limit`."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                length = child.end_lineno - child.lineno + 1
                if length > limit:
                    found.append((name, child.lineno, length))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_no_function_over_sixty_lines() -> None:
    over = [
        f"{path.relative_to(ROOT.parent)}:{line} {name} ({length} lines)"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for name, line, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not over, f"functions over {MAX_LINES} lines (split them into helpers):\n" + "\n".join(
        over
    )


def test_the_walk_counts_the_def_not_its_decorators() -> None:
    body = "".join(f"        x{i} = {i}\n" for i in range(58))
    head = "class A:\n    @staticmethod\n    @property\n    def f():\n"
    source = head + body + "        return 1\n"
    # f spans its def line, 58 assignments and the return: 60 lines, at the limit.
    assert long_functions(source) == []
    assert long_functions(source, limit=59) == [("A.f", 4, 60)]
    inner = "".join(f"        y{i} = {i}\n" for i in range(61))
    names = [name for name, _, _ in long_functions("def outer():\n    def inner():\n" + inner)]
    assert names == ["outer", "outer.inner"]
