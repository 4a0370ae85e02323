"""A scheduler knob has one default, in `SchedulerConfig`: no other function or dataclass of the
package defaults a parameter of the same name to a number of its own."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from hybridserve.core.config import SchedulerConfig

PACKAGE = Path(__file__).parents[2] / "hybridserve"
KNOBS = {f.name for f in fields(SchedulerConfig)}


def _literal_defaults(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every parameter or annotated field defaulted to a number literal."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            defaulted = positional[len(positional) - len(args.defaults) :]
            pairs = list(zip(defaulted, args.defaults, strict=True))
            kw_pairs = zip(args.kwonlyargs, args.kw_defaults, strict=True)
            pairs += [(a, d) for a, d in kw_pairs if d is not None]
            found += [(a.arg, d.lineno) for a, d in pairs if _is_number(d)]
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
            and _is_number(node.value)
        ):
            found.append((node.target.id, node.lineno))
    return found


def _is_number(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def test_no_scheduler_knob_is_defaulted_outside_the_scheduler_config() -> None:
    seconds = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "core/config.py":
            continue
        for name, line in _literal_defaults(ast.parse(path.read_text())):
            if name in KNOBS:
                seconds.append(f"{where}:{line} defaults {name}")
    assert not seconds, seconds
