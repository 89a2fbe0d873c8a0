"""Run cells in a real ipykernel through nbclient, as a notebook front end would."""

from __future__ import annotations

import os
import sys
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


@pytest.fixture(autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Each test's kernel gets its own temp folder (the kernel inherits TMPDIR), so what a launch leaves
    behind is told apart from other programs' files."""
    path = tmp_path_factory.mktemp("kernel_tmp")
    monkeypatch.setenv("TMPDIR", str(path))
    return path


@pytest.fixture(autouse=True)
def environment_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel finds this environment's commands (`!accelerate launch`) as in an activated environment, also
    when the tests run with its python without activating it."""
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.fixture
def kernel_run():
    return run_cells


class LiveKernel:
    """A real ipykernel driven message by message (for interrupts and timing), as a front end does."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3")

    def execute(self, code: str, timeout: float = 120) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        msg_id = self.kc.execute(code, stop_on_error=False)  # ipykernel would refuse a cell sent just after an error
        return self.collect(msg_id, timeout)

    def start(self, code: str, timeout: float = 60) -> str:
        """Send a cell and return once the kernel runs it (an idle kernel ignores an interrupt); its id."""
        msg_id = self.kc.execute(code, stop_on_error=False)
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                return msg_id

    def collect(self, msg_id: str, timeout: float = 120) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        outputs = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind in ("stream", "error", "display_data", "execute_result"):
                outputs.append({"output_type": kind, **content})
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:  # a kernel_info reply left from a slow start
            reply = self.kc.get_shell_msg(timeout=timeout)
        return reply["content"], outputs

    def text(self, code: str, timeout: float = 120) -> str:
        _, outputs = self.execute(code, timeout)
        return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def live_kernel():
    kernel = LiveKernel()
    yield kernel
    kernel.close()


@pytest.fixture
def live_kernels():
    """Start as many live kernels as the test asks for; all are shut down after it."""
    made: list[LiveKernel] = []

    def start() -> LiveKernel:
        made.append(LiveKernel())
        return made[-1]

    yield start
    for kernel in made:
        kernel.close()
