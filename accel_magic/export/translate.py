"""A cell's magics and ! lines as plain Python, or the reason one has no plain-Python equivalent."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from ..cell import ipython_call
from ..errors import ExportError

__all__ = ["Translator"]

# Line magics that change nothing a script needs (display, extensions, timing loops, this package's own).
_DROPPED = {
    "load_ext",
    "reload_ext",
    "unload_ext",
    "matplotlib",
    "config",
    "autoreload",
    "aimport",
    "accel_setup",
    "accel_export",
    "timeit",
    "pinfo",
    "pinfo2",
    "who",
    "whos",
}
# Cell magics whose body runs as the cell would, apart from output.
_BODY_ONLY = {"time", "capture"}


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(True):
        total += len(line)
        starts.append(total)
    return starts


def _char_col(source_lines: list[str], lineno: int, byte_col: int) -> int:
    return len(source_lines[lineno - 1].encode("utf-8")[:byte_col].decode("utf-8", "replace"))


_EXPANSION = re.compile(r"\{[^{}]*\}")


@dataclass
class Translator:
    count: int
    transform: Callable[[str], str]
    python_names: frozenset[str]  # names the kernel's cells bind: `$name` in a command would expand them
    needs: set[str] = field(default_factory=set)  # modules the translations use: os, subprocess, sys
    refused: list[tuple[int, ExportError]] = field(default_factory=list)  # (line, why) of what has no translation

    def refuse(self, line: int, what: str, fix: str) -> ExportError:
        return ExportError(f"Cell [{self.count}] line {line} uses {what}, which has no plain-Python equivalent: {fix}.")

    def check_expansion(self, text: str, line: int, what: str) -> None:
        dollars = {m.group(1) for m in re.finditer(r"(?<!\$)\$([A-Za-z_]\w*)", text)}
        if _EXPANSION.search(text) or dollars & self.python_names:
            raise self.refuse(
                line,
                f"{what} with a Python expansion ({{...}} or $name)",
                "write the command with the value spelled out, or run it with subprocess.run in the cell, "
                "then export again",
            )

    def source(self, source: str, first_line: int, tree: ast.Module | None = None) -> str:
        """The transformed cell (its first line numbered `first_line`, `tree` its parse if already made) with every
        magic and ! line as Python."""
        tree = tree if tree is not None else ast.parse(source)
        lines = source.splitlines(True)
        starts = _offsets(source)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        edits: list[tuple[int, int, str]] = []
        for node in ast.walk(tree):
            call = ipython_call(node)
            if call is None or call[0] not in ("run_line_magic", "run_cell_magic", "system", "getoutput"):
                continue
            assert isinstance(node, ast.Call) and node.end_lineno is not None and node.end_col_offset is not None
            statement = isinstance(parents.get(node), ast.Expr)
            line = first_line + node.lineno - 1
            try:
                text = self.translate(*call, statement=statement, line=line, indent=node.col_offset)
            except ExportError as err:  # kept for when the cell is needed; its other lines still bind names
                self.refused.append((line, err))
                text = "pass" if statement else "None"
            start = starts[node.lineno - 1] + _char_col(lines, node.lineno, node.col_offset)
            end = starts[node.end_lineno - 1] + _char_col(lines, node.end_lineno, node.end_col_offset)
            edits.append((start, end, text))
        for start, end, text in sorted(edits, reverse=True):
            source = source[:start] + text + source[end:]
        return source

    def translate(self, method: str, args: list[str], *, statement: bool, line: int, indent: int) -> str:
        if method in ("system", "getoutput"):
            command = args[0]
            self.check_expansion(command, line, f"`!{command}`")
            self.needs.add("subprocess")
            # As in IPython: a failing command does not stop the cell, and `x = !cmd` holds stdout and stderr.
            if method == "system":
                return f"subprocess.run({command!r}, shell=True)"
            captured = "stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True"
            return f"subprocess.run({command!r}, shell=True, {captured}).stdout.splitlines()"
        if method == "run_cell_magic":
            name, options, body = (args + ["", "", ""])[:3]
            if name not in _BODY_ONLY:
                raise self.refuse(
                    line, f"%%{name}", "rewrite the cell in Python, or leave it out of what the training cell uses"
                )
            inner = self.source(self.transform(body), line + 1)
            return _indent(inner.rstrip("\n"), indent) if inner.strip() else "pass"
        name, text = (args + ["", ""])[:2]
        return self.line_magic(name, text.strip(), statement=statement, line=line)

    def line_magic(self, name: str, text: str, *, statement: bool, line: int) -> str:
        shown = f"%{name} {text}".strip().replace("\n", " ")
        if name in _DROPPED:
            return f"pass  # {shown} (not needed in a script)" if statement else "None"
        if name == "time" and text:
            return text if statement else f"({text})"
        if name in ("cd", "env", "pip"):
            self.check_expansion(text, line, f"`{shown}`")
            try:
                words = shlex.split(text)
            except ValueError:
                words = []
            if name == "cd" and len(words) == 1 and not words[0].startswith("-"):
                self.needs.add("os")
                return f"os.chdir(os.path.expanduser({words[0]!r}))"
            if name == "env":
                # IPython's own split: at the first "=" if there is one, else at the first space; the value as is.
                key, *value = [part.strip() for part in text.split("=" if "=" in text else " ", 1)]
                if key and not any(c.isspace() for c in key):
                    self.needs.add("os")
                    if not value:  # a read
                        return f"os.environ[{key!r}]"
                    set_key = f"os.environ[{key!r}] = {value[0]!r}"
                    return set_key if statement else f"os.environ.__setitem__({key!r}, {value[0]!r})"
            if name == "pip" and words:
                self.needs.update(("subprocess", "sys"))
                return f'subprocess.run([sys.executable, "-m", "pip", *{words!r}], check=True)'
        raise self.refuse(
            line, f"%{name}", "rewrite that line in Python, or move it to a cell the training cell does not use"
        )


def _indent(text: str, columns: int) -> str:
    """Every line but the first indented by `columns` (the first takes the place of the call)."""
    first, *rest = text.split("\n")
    return "\n".join([first] + [(" " * columns + line) if line.strip() else line for line in rest])
