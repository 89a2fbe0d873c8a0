"""Run cells in a real ipykernel through nbclient, as a notebook front end would."""

from __future__ import annotations

from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient


class Cells:
    """The executed notebook's cells, with helpers that read what a user would see."""

    def __init__(self, nb: nbformat.NotebookNode):
        self.nb = nb

    def outputs(self, i: int) -> list[dict[str, Any]]:
        return self.nb.cells[i].get("outputs", [])

    def text(self, i: int) -> str:
        parts = []
        for out in self.outputs(i):
            if out["output_type"] == "stream":
                parts.append(out["text"])
            elif out["output_type"] == "error":
                parts.append(f"{out['ename']}: {out['evalue']}\n")
            else:
                parts.append(out.get("data", {}).get("text/plain", "") + "\n")
        return "".join(parts)


def run_cells(*sources: str, timeout: int = 300, allow_errors: bool = False) -> Cells:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors)
    client.execute()
    return Cells(nb)


@pytest.fixture
def kernel_run():
    return run_cells
