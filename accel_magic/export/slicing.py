"""Which earlier cells a training cell depends on: the latest cell before each use that binds a name it needs, the
cells that change that name's object, and those cells' own needs in turn."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..cell import top_level_names, transform_lines_kept
from ..errors import ExportError
from .history import cell_body
from .names import Names, needed_names
from .translate import Translator

__all__ = ["BUILTINS", "Cell", "read_cells", "resolve", "why"]

# What IPython's shell adds to builtins, which a script does not have (exit and quit come from `site`).
_IPYTHON_BUILTINS = {"get_ipython", "display", "__IPYTHON__", "dreload"}
BUILTINS = frozenset(set(dir(builtins)) - _IPYTHON_BUILTINS) | {"exit", "quit", "__builtins__"}
# IPython's input and output history, which only a kernel has.
_HISTORY_NAMES = re.compile(r"^(In|Out|_|__|___|_i|_ii|_iii|_ih|_oh|_dh|_\d+|_i\d+)$")


@dataclass
class Cell:
    """A cell of the history as the export reads it."""

    count: int
    source: str  # as Python, the magics translated (or only transformed where that failed)
    first_line: int  # the cell line of the source's line 1
    training: bool
    names: Names
    error: ExportError | None  # why the cell cannot go into a script, should it be needed
    needs: frozenset[str] = frozenset()  # modules its translated magics use: os, subprocess, sys


def read_cells(history: Sequence[tuple[int, str]], transform: Callable[[str], str]) -> list[Cell]:
    """The cells as Python, what each binds and needs, each transformed and parsed once; a magic without a
    translation becomes `pass` (so the rest of the cell still counts) and the cell's error, raised only if the
    training cell depends on it."""
    read = []
    for count, raw in history:
        body, first_line, training = cell_body(raw)
        source = transform_lines_kept(body, transform)
        try:
            tree: ast.Module | None = ast.parse(source)
        except SyntaxError:
            tree = None
        read.append((count, source, tree, first_line, training))
    # `$name` in a command expands a Python name that any cell binds
    python_names = frozenset(name for _, _, tree, _, _ in read if tree is not None for name in top_level_names(tree))
    cells = []
    for count, source, tree, first_line, training in read:
        translator, error = Translator(count, transform, python_names), None
        try:
            if tree is None:
                raise SyntaxError
            source = translator.source(source, first_line, tree)
            names = needed_names(ast.parse(source))  # SyntaxError too for code that parses but does not compile
        except SyntaxError:
            error = ExportError(f"Cell [{count}] is not valid Python: fix it, run it again, and export again.")
            names = needed_names(ast.Module(body=[], type_ignores=[]))
        if translator.refused:
            error = min(translator.refused, key=lambda refused: refused[0])[1]
        cells.append(Cell(count, source, first_line, training, names, error, frozenset(translator.needs)))
    return cells


_Users = dict[str, set[int]]  # name -> the cells that use it


def _plural(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def resolve(cells: list[Cell], training: Cell, accelerator_name: str) -> tuple[dict[int, dict[str, _Users]], bool]:
    """Which cells before the training cell it depends on, followed transitively: for each name a cell needs at
    top level, the latest cell before it that binds it; for each name its functions use, the latest cell before the
    training cell that binds it (a function looks its names up when called); and every cell between that one and the
    use (the cell, or for a function's name the training cell) that changes the object the name holds (a seed,
    loaded weights): a change matters only to what runs after it. Returns {cell: {"defines" or "changes": {name:
    the cells that use it}}} and whether `display` is used without a cell that defines it."""
    used: dict[int, dict[str, _Users]] = {training.count: {}}
    queue, display, seen = [training], False, {training.count}

    def take(taken: Cell, verb: str, name: str, user: Cell) -> None:
        used.setdefault(taken.count, {}).setdefault(verb, {}).setdefault(name, set()).add(user.count)
        if taken.count not in seen:
            seen.add(taken.count)
            queue.append(taken)

    while queue:
        cell = queue.pop(0)
        if cell.error is not None:
            raise cell.error
        missing, history = [], []
        earlier = [c for c in cells if c.count < cell.count]
        wanted = [(name, line, earlier) for name, line in cell.names.needed.items()]
        # a function's names: the training cell's own if it binds them, else as the training cell starts
        own = cell.names.bound if cell is training else frozenset()
        wanted += [(name, line, cells) for name, line in cell.names.deferred.items() if name not in own]
        for name, line, before in wanted:
            if name in BUILTINS or name == accelerator_name or name in cell.needs:
                continue
            definer = next((c for c in reversed(before) if name in c.names.bound), None)
            if definer is None and name in cell.names.bound:
                continue  # bound later in the cell itself (a loop, a branch): its own
            if definer is None:
                definer = next((c for c in reversed(before) if c.names.star), None)
            if definer is None:
                if name == "display":
                    display = True
                elif name == "get_ipython":
                    raise ExportError(
                        f"Cell [{cell.count}] line {cell.first_line + line - 1} calls get_ipython(), which a script "
                        "does not have: do that in a cell the training cell does not use, and export again."
                    )
                elif _HISTORY_NAMES.match(name):
                    history.append(name)
                else:
                    missing.append(name)
                continue
            if definer is not cell:  # else a function of the cell uses what the cell itself binds
                take(definer, "defines", name, cell)
            for changer in before:  # a change matters to the cells that run after it
                if definer.count < changer.count and changer is not cell and name in changer.names.mutated:
                    take(changer, "changes", name, cell)
        if history:
            raise ExportError(
                f"Cell [{cell.count}] uses {_plural(history)}, IPython's input and output history, which a script "
                "does not have: assign the value to a name in the cell that makes it, run that cell, and export again."
            )
        if missing:
            them = "it" if len(missing) == 1 else "them"
            raise ExportError(
                f"Cell [{cell.count}] uses {_plural(missing)}, which no earlier cell of this kernel defines: define "
                f"{them} in a cell above it, run both cells again, and export again."
            )
    return used, display


def why(cell: Cell, uses: dict[str, _Users], training: int) -> str:
    """ "defines model, opt (used by [7]); X (used by [5], [7]); changes torch (used by [7])": names grouped by
    the cells that use them."""
    if cell.count == training:
        return "the %%accel_train cell"
    parts = ["an earlier %%accel_train cell"] if cell.training else []
    for verb in ("defines", "changes"):
        groups: dict[tuple[int, ...], list[str]] = {}
        for name, users in sorted(uses.get(verb, {}).items()):
            groups.setdefault(tuple(sorted(users)), []).append(name)
        named = [f"{', '.join(names)} (used by {', '.join(f'[{c}]' for c in by)})" for by, names in groups.items()]
        if named:
            parts.append(f"{verb} {'; '.join(named)}")
    return "; ".join(parts)
