"""Code size limits (issue 11): every function or method in `hpctoolkit/` is at most
`MAX_FUNCTION_LINES` lines (decorators and docstring included), every module at most
`MAX_MODULE_LINES`. Read from the source with `ast`; milliseconds.

Split a function that grows past the limit into well-named steps, a module along its plan /
assemble / run boundaries. `ALLOWED` names what could not be split yet, each with the reason and
its current size; keep it short.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hpctoolkit"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500

# "path relative to hpctoolkit/" or "path::qualified.name" -> why it may exceed the limit.
ALLOWED: dict[str, str] = {}


def _functions(tree: ast.Module) -> list[tuple[str, int]]:
    """(qualified name, line count) of every function and method, nested ones too."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    out.append((name, (child.end_lineno or child.lineno) - first + 1))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    modules, functions = {}, {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        text = path.read_text()
        modules[rel] = len(text.splitlines())
        for name, lines in _functions(ast.parse(text)):
            functions[f"{rel}::{name}"] = lines
    return modules, functions


MODULES, FUNCTIONS = _sizes()


def test_functions_stay_short():
    long = {k: n for k, n in FUNCTIONS.items() if n > MAX_FUNCTION_LINES and k not in ALLOWED}
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_modules_stay_short():
    long = {k: n for k, n in MODULES.items() if n > MAX_MODULE_LINES and k not in ALLOWED}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_allow_list_is_current():
    """An entry goes once its function or module is back under the limit (or gone)."""
    stale = []
    for entry in sorted(ALLOWED):
        size = FUNCTIONS.get(entry) if "::" in entry else MODULES.get(entry)
        limit = MAX_FUNCTION_LINES if "::" in entry else MAX_MODULE_LINES
        if size is None or size <= limit:
            stale.append(f"{entry} ({size} lines)")
    assert stale == [], f"drop from ALLOWED: {stale}"


def test_the_counter_counts_decorators_docstrings_and_methods():
    src = 'class A:\n    @staticmethod\n    def f():\n        """doc"""\n        return 1\n'
    assert _functions(ast.parse(src)) == [("A.f", 4)]
