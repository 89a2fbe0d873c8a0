"""A cell's source as code: compiled with its own line numbers, with the names it binds and the magics it
calls."""

from __future__ import annotations

import ast
import itertools
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType

from .errors import CellError
from .scope import bindings

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


def top_level_names(tree: ast.Module) -> tuple[str, ...]:
    """Names the cell binds at top level, in order of first binding, but `_` and dunders (not results). Dynamic
    bindings (exec, globals()[...]) are not seen."""
    return tuple(
        name for name in bindings(tree) if not (name == "_" or (name.startswith("__") and name.endswith("__")))
    )


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
