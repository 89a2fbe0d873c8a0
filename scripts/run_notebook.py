"""Execute notebooks headless in a real ipykernel and print what each cell showed.

Usage: python scripts/run_notebook.py NOTEBOOK [NOTEBOOK ...]
Exits non-zero when a cell raises.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def cell_text(output: dict) -> str:
    if output["output_type"] == "stream":
        return output["text"]
    if output["output_type"] == "error":
        return f"{output['ename']}: {output['evalue']}\n"
    return output.get("data", {}).get("text/plain", "") + "\n"


def run(path: str, timeout: int = 300, folder: str | None = None) -> nbformat.NotebookNode:
    """Execute in `folder`, by default the notebook's own, as Jupyter does. The kernel finds this environment's
    commands (`!accelerate launch`) as in an activated environment."""
    commands = os.path.dirname(sys.executable)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != commands:
        os.environ["PATH"] = commands + os.pathsep + os.environ.get("PATH", "")
    nb = nbformat.read(path, as_version=4)
    folder = folder or str(Path(path).resolve().parent)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": folder}})
    # a cell's last outputs may trail its reply on a busy machine: wait for them, and fail rather than lose them
    client.iopub_timeout, client.raise_on_iopub_timeout = 30, True
    client.execute()
    return nb


def main(paths: list[str]) -> int:
    status = 0
    for path in paths:
        print(f"=== {path}")
        start = time.perf_counter()
        try:
            nb = run(path)
        except CellExecutionError as err:
            print(err)
            status = 1
            continue
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            text = "".join(cell_text(o) for o in cell.get("outputs", []))
            if text.strip():
                print(f"--- cell {i}\n{text.rstrip()}")
        print(f"=== {path}: ran in {time.perf_counter() - start:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["notebooks/01_quickstart.ipynb"]))
