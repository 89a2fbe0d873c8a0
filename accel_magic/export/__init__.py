"""A training cell and the earlier cells it depends on, as a script for `accelerate launch`, `torchrun` and SLURM.

Pure but for `export_from_history`, which reads the shell's input history: the rest takes it as (execution
count, raw source) pairs and turns magics into Python through the `transform` it is given (the shell's
`transform_cell`); it imports nothing of IPython, torch or accelerate, and the script it writes needs only torch
and accelerate. One step a module: history (the training cell), translate (magics as Python), names and slicing
(the cells it depends on), render (the files and commands); `export_training_cell` ties them together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ExportError
from .history import input_history, last_training_cell, notebook_name
from .names import Names, needed_names
from .render import DEFAULT_OUTPUT, Export, Settings, commands, script_paths, script_text, slurm_script
from .slicing import read_cells, resolve, why

__all__ = [
    "DEFAULT_OUTPUT",
    "DEFAULT_PORT",
    "ExportError",
    "Settings",
    "Export",
    "Names",
    "last_training_cell",
    "export_from_history",
    "export_training_cell",
    "needed_names",
    "commands",
    "slurm_script",
    "script_paths",
]

DEFAULT_PORT = 29500


def export_from_history(shell: Any, path: str, port: int, plan: Any, accelerator_name: str) -> Export:
    """The export of the last %%accel_train cell in `shell`'s input history (ExportError when there is none),
    under the plan its options make (`plan(options)`), written to `path`."""
    history = input_history(shell)
    found = last_training_cell(history)
    if found is None:
        raise ExportError(
            "No %%accel_train cell has run in this kernel: run the training cell first, then %accel_export."
        )
    count, options = found
    made = plan(options)
    settings = Settings(
        num_processes=made.num_processes,
        cpu=made.device == "cpu" or made.cpu,
        mixed_precision=made.mixed_precision,
        timeout=made.timeout,
        gpus=made.device == "cuda",
        threads_per_process=made.threads_per_process,
        accelerator_name=accelerator_name,
    )
    return export_training_cell(
        history, shell.transform_cell, count, settings, script=path, port=port, source=notebook_name(shell)
    )


def export_training_cell(
    history: Sequence[tuple[int, str]],
    transform: Callable[[str], str],
    training: int,
    settings: Settings,
    *,
    script: str,
    port: int = DEFAULT_PORT,
    source: str = "an IPython kernel",
) -> Export:
    """The training cell `training` (an execution count in `history`) and the earlier cells it depends on, as a
    script at `script` and a SLURM batch file next to it. Raises ExportError, one sentence saying what to do."""
    script, slurm = script_paths(script)
    cells = read_cells([(count, raw) for count, raw in history if count <= training], transform)
    last = next(c for c in cells if c.count == training)
    used, display = resolve([c for c in cells if c.count < training], last, settings.accelerator_name)
    taken = [c for c in cells if c.count in used]
    reasons = {c.count: why(c, used[c.count], training) for c in taken}
    runs = commands(script, slurm, settings)
    needs = set().union(*(c.needs for c in taken))
    text = script_text(taken, reasons, settings, runs, source, display, training, needs)
    try:
        compile(text, script, "exec")
    except SyntaxError as err:  # a translation that IPython's transform made unusual: say where, do not write
        raise ExportError(
            f"The exported script does not compile at its line {err.lineno} ({err.msg}): rewrite the magics of the "
            "cells it takes in Python, and export again."
        ) from None
    job = Path(script).stem or "train"
    return Export(
        script=text,
        slurm=slurm_script(script, settings, port, job),
        commands=runs,
        cells=tuple((c.count, reasons[c.count]) for c in taken),
        script_path=script,
        slurm_path=slurm,
    )
