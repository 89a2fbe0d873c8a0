"""The shell's input history: the cells that ran before this one, and the last %%accel_train cell among them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["TRAIN_MAGIC", "last_training_cell", "cell_body", "input_history", "notebook_name"]

TRAIN_MAGIC = "%%accel_train"


def _magic_line(raw: str) -> tuple[int, str] | None:
    """(index of the line, its options) when the cell's first non-blank line starts with %%accel_train."""
    for index, line in enumerate(raw.splitlines()):
        if line.strip():
            stripped = line.strip()
            if stripped == TRAIN_MAGIC or stripped.startswith(TRAIN_MAGIC + " "):
                return index, stripped[len(TRAIN_MAGIC) :].strip()
            return None
    return None


def last_training_cell(history: Sequence[tuple[int, str]]) -> tuple[int, str] | None:
    """(execution count, options) of the last %%accel_train cell in the history, or None."""
    for count, raw in reversed(history):
        found = _magic_line(raw)
        if found is not None:
            return count, found[1]
    return None


def cell_body(raw: str) -> tuple[str, int, bool]:
    """The cell's code (an %%accel_train cell's without its magic line), the cell line of its first line, and
    whether it is an %%accel_train cell. An %%accel_train cell's lines are numbered as a launch's tracebacks
    number them ("Cell line 1"): from the line below the magic."""
    found = _magic_line(raw)
    if found is None:
        return raw, 1, False
    return "\n".join(raw.splitlines()[found[0] + 1 :]), 1, True


def input_history(shell: Any) -> list[tuple[int, str]]:
    """(execution count, raw source) of each cell that ran before the one running now."""
    raw = shell.history_manager.input_hist_raw
    return [(count, raw[count]) for count in range(1, min(len(raw), shell.execution_count))]


def notebook_name(shell: Any) -> str:
    """The notebook's path as VS Code or Jupyter names it, else "a notebook"."""
    return str(shell.user_ns.get("__vsc_ipynb_file__") or os.environ.get("JPY_SESSION_NAME") or "a notebook")
