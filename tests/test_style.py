"""What the code's style asks beyond ruff: no function in mkc/, runtime/ or benchmarks/ is longer than
80 lines, so a long step is split into parts whose names tell the reader what each does."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from conftest import ROOT

MAX_FUNCTION_LINES = 80  # from the def line to the last line of the body, decorators not counted
PACKAGES = ("mkc", "runtime", "benchmarks")
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _functions(node: ast.AST, prefix: str = "") -> Iterator[tuple[str, Function]]:
    """Every function and method under ``node``, nested ones too, with its dotted name (Class.method)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield name, child
            yield from _functions(child, f"{name}.")
        else:
            yield from _functions(child, prefix)


def long_functions(root: Path, packages: tuple[str, ...] = PACKAGES,
                   limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'path:line name: N lines' for each function over ``limit`` lines in the packages' .py files."""
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for name, fn in _functions(tree):
                lines = fn.end_lineno - fn.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root)}:{fn.lineno} {name}: {lines} lines")
    return out


def test_no_function_is_over_80_lines():
    long = long_functions(ROOT)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into parts whose names say "
                      "what each does):\n" + "\n".join(long))


def test_long_functions_names_the_function_and_its_length(tmp_path):
    """The check itself: a method and a nested function over the limit are named with their class or
    enclosing function, and their length; one at the limit is not."""
    line, inner_line = "    x = 1\n", "        x = 1\n"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("class A:\n    def run(self):\n" + inner_line * 80  # lines 2-82
                                           + "def short():\n" + line * 79  # 83-162
                                           + "def outer():\n    def inner():\n" + inner_line * 80 + line)
    assert long_functions(tmp_path, ("pkg",)) == [
        "pkg/m.py:2 A.run: 81 lines", "pkg/m.py:163 outer: 83 lines", "pkg/m.py:164 outer.inner: 81 lines"]
