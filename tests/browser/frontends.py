"""Real Jupyter front ends driven in headless Chromium: a server started on 127.0.0.1 with a token, a notebook
opened, run, interrupted, saved and reopened through the page, as a user would.

- JupyterLab 4 and Notebook 7 run from this environment (today's stack);
- classic Notebook 6.5.7 runs from the Colab environment (.venv-colab: ipywidgets 7.7.1, IPython 7.34), so the
  widget stack is Colab's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
from ports import free_port

ROOT = Path(__file__).parents[2]
COLAB_PYTHON = ROOT / ".venv-colab" / "bin" / "python"
OUTPUTS = ".jp-OutputArea-output, .output_subarea"  # one rendered output (Lab and Notebook 7; classic)
PROGRESS_BARS = """cell => [...cell.querySelectorAll('.widget-hprogress')].map(widget => {
    const bar = widget.querySelector('.progress-bar'), track = bar && bar.parentElement;
    const box = widget.closest('.widget-hbox') || widget;
    return {drawn: bar ? bar.getBoundingClientRect().width / track.getBoundingClientRect().width : 0,
            width: bar ? bar.style.width : null, text: box.innerText};
})"""


def chromium_path() -> str | None:
    """Debian's chromium (installed by `make test` when missing); never a browser downloaded by a test tool."""
    return os.environ.get("ACCEL_MAGIC_CHROMIUM") or shutil.which("chromium")


def write_notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(nb, path)


@dataclass(frozen=True)
class FrontEnd:
    name: str  # "lab", "notebook7" or "classic"
    python: str  # the environment the server (and so the kernel) runs in

    @property
    def classic(self) -> bool:
        return self.name == "classic"

    def command(self, port: int, token: str, root: Path) -> list[str]:
        module = "jupyterlab" if self.name == "lab" else "notebook"
        if self.classic:
            options = [f"--NotebookApp.token={token}", f"--notebook-dir={root}"]
        else:
            options = [f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
        root_user = ["--allow-root"] if os.geteuid() == 0 else []
        return [self.python, "-m", module, "--no-browser", "--ip=127.0.0.1", f"--port={port}", *root_user, *options]

    def path(self, notebook: str) -> str:
        return f"/lab/tree/{notebook}" if self.name == "lab" else f"/notebooks/{notebook}"


class Server:
    """A Jupyter server on 127.0.0.1 with a token, its files in `root`, its settings and runtime files in a
    folder of its own (no news prompt, nothing written to the user's Jupyter folders).

    With `kernels=False` it offers no kernel (KernelSpecManager.allowed_kernelspecs names none, and JupyterLab
    does not start its default one), as where a notebook is opened without the environment it ran in: the page
    asks for a kernel and `NotebookPage` answers "No Kernel"."""

    def __init__(self, front: FrontEnd, root: Path, theme: str = "JupyterLab Light", kernels: bool = True) -> None:
        self.front, self.root, self.theme = front, root, theme
        self.home = root.parent / f"{root.name}-jupyter"
        self.log = self.home / "server.log"
        self._start(kernels)

    def _start(self, kernels: bool) -> None:
        self.kernels = kernels
        self.port, self.token = free_port(), secrets.token_hex(16)
        home = self.home
        (home / "config").mkdir(parents=True, exist_ok=True)
        for plugin, values in (("apputils-extension/notification", {"fetchNews": "false"}),
                               ("notebook-extension/tracker", {"autoStartDefaultKernel": kernels}),
                               ("apputils-extension/themes", {"theme": self.theme})):  # fmt: skip
            settings = home / "lab-settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
            settings.parent.mkdir(parents=True, exist_ok=True)
            settings.write_text(json.dumps(values))
        offered = {} if kernels else {"KernelSpecManager": {"allowed_kernelspecs": ["no-kernel-here"]}}
        for config in ("jupyter_server_config.json", "jupyter_notebook_config.json"):  # Lab and Notebook 7; classic
            (home / "config" / config).write_text(json.dumps(offered))
        # The kernels import accel_magic from this checkout, ahead of any installed copy (an editable install
        # of another checkout included).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(home / "lab-settings"), PYTHONPATH=path,
                   JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTER_CONFIG_DIR=str(home / "config"))  # fmt: skip
        self.process = subprocess.Popen(
            self.front.command(self.port, self.token, self.root),
            cwd=self.root,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api("GET", "/api/status")
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the {self.front.name} server did not start:\n{self.log.read_text()[-3000:]}"
                    ) from None
                time.sleep(0.3)

    def restart(self, kernels: bool) -> None:
        """Stop the server (its kernels end with it) and start it again on the same folder and settings, offering
        kernels or not."""
        self.close()
        self._start(kernels)

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}{self.front.path(notebook)}?token={self.token}"

    def api(self, method: str, path: str) -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self) -> None:
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


class NotebookPage:
    """One notebook open in the browser, driven through the front end's own UI."""

    def __init__(self, page: Any, server: Server, notebook: str) -> None:
        self.page, self.server, self.front = page, server, server.front
        self.console: list[str] = []  # the page's console errors and warnings, shown when a check fails
        page.on(
            "console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None
        )
        self.received: list[str] = []  # the kernel messages' types that reached the page, in order
        page.on("websocket", lambda ws: ws.on("framereceived", self._received))
        self.file = server.root / notebook
        page.goto(server.url(notebook))
        if not server.kernels:
            self._no_kernel()
        elif self.front.classic:
            page.wait_for_function(
                "window.Jupyter && Jupyter.notebook && Jupyter.notebook.kernel && Jupyter.notebook.kernel.is_connected()",
                timeout=60_000,
            )
            # ipywidgets 7 asks the kernel which widgets it has once the page is loaded, and drops the models the
            # kernel does not know of when the answer comes: a rank's widgets made before the answer would go.
            self.wait(lambda: "comm_info_reply" in self.received, "the widget manager's comm_info_reply")
        else:
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            self._kernel_ready()

    def _received(self, payload: str | bytes) -> None:
        text = payload if isinstance(payload, str) else payload.decode("utf-8", "replace")
        found = re.search(r'"msg_type": ?"(\w+)"', text)
        if found:
            self.received.append(found.group(1))

    def wait(self, ready: Any, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} did not come within {timeout:g} s")
            self.page.wait_for_timeout(100)  # lets the page's events (websocket frames) be delivered

    def _kernel_ready(self, timeout: float = 60) -> None:
        """Lab and Notebook 7: the kernel is idle; a "Select Kernel" dialog, where one shows, is accepted."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dialog = self.page.locator(".jp-Dialog .jp-mod-accept")
            if dialog.count():
                dialog.first.click()
            elif self.page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() and any(
                s["kernel"]["execution_state"] == "idle" for s in self.server.api("GET", "/api/sessions")
            ):
                time.sleep(0.5)  # a dialog that shows late
                if not self.page.locator(".jp-Dialog").count():
                    return
            time.sleep(0.2)
        raise AssertionError("the notebook's kernel did not become idle")

    def _no_kernel(self, timeout: float = 60) -> None:
        """The server offers no kernel: the page asks for one, and the answer is "No Kernel" (classic Notebook:
        "Continue Without Kernel")."""
        if self.front.classic:
            button = self.page.locator(".modal-dialog button:text-is('Continue Without Kernel')")
        else:
            button = self.page.locator(".jp-Dialog .jp-mod-reject:has-text('No Kernel')")
        button.click(timeout=timeout * 1000)
        button.wait_for(state="detached", timeout=timeout * 1000)
        self.page.wait_for_selector(".cell" if self.front.classic else ".jp-Notebook .jp-Cell", timeout=timeout * 1000)

    def fold_left_area(self) -> None:
        """JupyterLab: the left area (the file browser) folded away, so the notebook is as wide as the window."""
        if self.front.name == "lab" and self.page.locator("#jp-left-stack").is_visible():
            self.page.keyboard.press("Control+b")
            self.page.locator("#jp-left-stack").wait_for(state="hidden")

    def run_all(self) -> None:
        if self.front.classic:
            self.page.evaluate("Jupyter.notebook.execute_all_cells()")
        else:
            self.page.click(".lm-MenuBar-itemLabel:text-is('Run')")
            self.page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")

    def run_cell(self, index: int) -> None:
        if self.front.classic:
            self.page.evaluate(f"Jupyter.notebook.execute_cells([{index}])")
        else:
            self.cells().nth(index).locator(".jp-InputArea-editor").click()
            self.page.keyboard.press("Shift+Enter")

    def stop(self) -> None:
        """The toolbar's stop (interrupt the kernel) button."""
        if self.front.classic:
            self.page.click("button[data-jupyter-action='jupyter-notebook:interrupt-kernel']")
        else:
            self.page.click(
                "jp-button[data-command='notebook:interrupt-kernel'], [data-command='notebook:interrupt-kernel']"
            )

    def save(self, timeout: float = 30) -> None:
        """Save through the page and wait until the file on disk holds the outputs the page shows: each cell
        with outputs in the page has outputs, and its execution count, in the file."""
        shown = [bool(self.output_text(i).strip()) for i in range(self.cells().count())]
        assert any(shown), "the page shows no outputs to save"
        if self.front.classic:
            self.page.evaluate("Jupyter.notebook.save_notebook()")
        else:
            self.page.keyboard.press("Control+s")
        deadline = time.monotonic() + timeout
        while True:
            saved = _saved_outputs(self.file)
            if saved == shown:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the save did not land within {timeout:g} s: {self.file.name} on disk has outputs in cells "
                    f"{[i for i, s in enumerate(saved) if s]}, the page shows them in cells "
                    f"{[i for i, s in enumerate(shown) if s]}"
                )
            time.sleep(0.2)

    def cells(self) -> Any:
        return self.page.locator(".cell" if self.front.classic else ".jp-Notebook .jp-Cell")

    def output_text(self, index: int) -> str:
        """What the cell's outputs show, as text."""
        cell = self.cells().nth(index)
        return "\n".join(cell.locator(OUTPUTS).all_inner_texts())

    def progress_bars(self, index: int) -> list[dict[str, Any]]:
        """The horizontal progress widgets drawn in the cell's outputs (ipywidgets 7 and 8 draw the same
        elements): how full each bar is drawn (its width in its track), its style width, and the text of the box it
        is in (tqdm puts its counts there)."""
        return self.cells().nth(index).evaluate(PROGRESS_BARS)

    def wait_for_output(self, index: int, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            shown = self.output_text(index)
            if text in shown:
                return shown
            if time.monotonic() > deadline:
                shot = self.server.root.parent / f"{self.front.name}-failed.png"
                self.page.screenshot(path=str(shot), full_page=True)
                console = "\n".join(self.console[-20:])
                raise AssertionError(
                    f"{text!r} did not appear in cell {index}'s output ({shot}); it shows:\n{shown}\nconsole:\n{console}"
                )
            time.sleep(0.2)

    def wait_until_idle(self, timeout: float = 60) -> None:
        if self.front.classic:
            self.page.wait_for_function(
                "Jupyter.notebook.kernel && Jupyter.notebook.kernel._msg_queue !== undefined"
                " && !document.querySelector('#kernel_indicator_icon.kernel_busy_icon')",
                timeout=timeout * 1000,
            )
        else:
            self.page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout * 1000)


def _saved_outputs(path: Path) -> list[bool]:
    """For each cell of the notebook file: whether it holds outputs from a run (outputs and an execution count)."""
    try:
        nb = json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or being written
        return []
    return [bool(cell.get("outputs")) and cell.get("execution_count") is not None for cell in nb["cells"]]


def front_ends() -> list[FrontEnd]:
    return [
        FrontEnd("lab", sys.executable),
        FrontEnd("notebook7", sys.executable),
        FrontEnd("classic", str(COLAB_PYTHON)),
    ]
