"""A cell's source as code: compiled with its own line numbers, with the names it binds and the magics it
calls."""

from __future__ import annotations

import ast
import itertools
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType
from typing import Any

from .errors import CellError

__all__ = [
    "CellError",
    "CellCode",
    "compile_cell",
    "transform_lines_kept",
    "top_level_names",
    "magics_called",
    "ipython_call",
]

_counter = itertools.count(1)


@dataclass(frozen=True)
class CellCode:
    source: str
    filename: str
    code: CodeType
    bound: tuple[str, ...]
    magics: tuple[tuple[str, str], ...] = ()  # ("line" or "cell", name) of the magics the cell calls


def ipython_call(node: ast.AST) -> tuple[str, list[str]] | None:
    """(method, arguments) of what IPython's transform makes of a magic or ! line, get_ipython().<method>('...', ...)
    with string constants only; None for anything else."""
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "get_ipython"
        and not node.keywords
    ):
        return None
    values = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return (node.func.attr, values) if len(values) == len(node.args) else None


def magics_called(tree: ast.Module) -> tuple[tuple[str, str], ...]:
    """The magics that IPython's transformed source calls (get_ipython().run_line_magic('name', ...))."""
    found: dict[tuple[str, str], None] = {}
    for node in ast.walk(tree):
        method, args = ipython_call(node) or ("", [])
        if method in ("run_line_magic", "run_cell_magic") and args:
            found.setdefault(("line" if method == "run_line_magic" else "cell", args[0]), None)
    return tuple(found)


class _Bindings(ast.NodeVisitor):
    """Names bound at the cell's top level (not inside functions, classes, lambdas or comprehensions)."""

    def __init__(self) -> None:
        self.names: dict[str, None] = {}

    def add(self, name: str) -> None:
        if not (name == "_" or (name.startswith("__") and name.endswith("__"))):
            self.names.setdefault(name, None)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.add(node.id)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.add(node.name)
        for deco in node.decorator_list:
            self.visit(deco)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.add(node.name)
        for deco in node.decorator_list:
            self.visit(deco)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass

    def _comprehension(self, node: ast.AST) -> None:
        for gen in getattr(node, "generators", []):
            self.visit(gen.iter)  # only the walrus in the outermost iterable can bind at top level

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":
                self.add(alias.asname or alias.name)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.add(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node: Any) -> None:
        if node.name:
            self.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: Any) -> None:
        if node.name:
            self.add(node.name)


def top_level_names(tree: ast.Module) -> tuple[str, ...]:
    """Names the cell binds at top level, in order of first binding. Dynamic bindings (exec, globals()[...])
    are not seen."""
    visitor = _Bindings()
    for stmt in tree.body:
        visitor.visit(stmt)
    return tuple(visitor.names)


def _is_blank(source: str) -> bool:
    return all(not line.strip() or line.lstrip().startswith("#") for line in source.splitlines())


def _leading_blank_lines(text: str) -> int:
    lines = text.splitlines()
    return next((i for i, line in enumerate(lines) if line.strip()), len(lines))


def transform_lines_kept(raw: str, transform: Callable[[str], str]) -> str:
    """IPython's transform of the cell, with the blank lines it drops at the top put back, so that line N of the
    result is line N of the cell."""
    source = transform(raw)
    missing = _leading_blank_lines(raw) - _leading_blank_lines(source)
    return "\n" * missing + source if missing > 0 else source


def compile_cell(raw: str, transform: Callable[[str], str] = lambda s: s) -> CellCode:
    """Transform (magics, ! lines) and compile the cell body, with its source in linecache so tracebacks
    show the cell's lines. Raises CellError before anything runs."""
    if "\x00" in raw:
        raise CellError("The cell contains a NUL character: remove it and run the cell again.")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise CellError("The cell contains text that is not valid Unicode (a lone surrogate): retype it.") from None
    if _is_blank(raw):
        raise CellError("The cell is empty: put the training code below the %%accel_train line.")
    source = transform_lines_kept(raw, transform)
    filename = f"<accel_train cell {next(_counter)}>"
    try:
        tree = ast.parse(source, filename)
        code = compile(tree, filename, "exec")
    except SyntaxError as err:
        if "await" in (err.msg or ""):
            raise CellError(
                "Top-level await is not supported in %%accel_train: put the code in a function and call it."
            ) from None
        where = f"cell line {err.lineno}" if err.lineno else "the cell"
        text = f" ({err.text.strip()})" if err.text and err.text.strip() else ""
        raise CellError(f"Syntax error at {where}{text}: {err.msg}; nothing was launched.") from None
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return CellCode(source, filename, code, top_level_names(tree), magics_called(tree))
