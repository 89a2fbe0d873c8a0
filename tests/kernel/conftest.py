"""Run cells in a real ipykernel through nbclient, as a notebook front end would."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError
from traitlets import CaselessStrEnum, Type, default


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


def _environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a kernel is started in, but for pytest's name of the test that runs now."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


# The kernel a notebook has once it imported torch, as most do in their first cell: torch is imported before
# ipykernel starts (nothing in the user's namespace, no cell run), which spares each test about 1.6 s here. A
# test about the kernel before torch is imported is marked `fresh_kernel` and gets ipykernel's own start.
WARM = """import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]  # as ipykernel_launcher does
import torch
from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""


SLICE = 0.1  # seconds: the longest a message that arrived can wait unread (PatientChannel)
_CHANNEL = AsyncKernelClient.class_traits()["shell_channel_class"].default_value  # jupyter_client 7's or 8's


class PatientChannel(_CHANNEL):  # type: ignore[misc, valid-type]
    """jupyter_client's asyncio channel, its waits cut in slices of SLICE s. The event loop learns of a message
    through the zmq socket's edge-triggered notification, which pyzmq's asyncio sockets sometimes miss
    (zeromq/pyzmq#1558, #2173): the message then waited unread until the wait's timeout (120 s in a live kernel's
    cell, for ever in nbclient's wait for output). At the end of each slice pyzmq polls the socket itself, so a
    missed notification costs at most SLICE."""

    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE if deadline is None else min(SLICE, max(deadline - time.monotonic(), 0.0))
            try:
                return await super().get_msg(timeout=left)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise


class PatientClient(AsyncKernelClient):
    shell_channel_class = Type(PatientChannel)
    iopub_channel_class = Type(PatientChannel)
    stdin_channel_class = Type(PatientChannel)
    control_channel_class = Type(PatientChannel)


# Where the kernels' sockets are: files, not TCP ports. A port that jupyter_client finds free stays unclaimed
# until the kernel binds it, seconds later (the warm kernel imports torch first); meanwhile the ranks of the test
# that runs open sockets on ports of the same range. Twice in a few thousand starts, a kernel started beside a
# launch died or never answered, most likely because a port it was given had been taken (what it printed did not
# say). Unix sockets under a folder of the suite's own cannot collide.
SOCKETS = tempfile.mkdtemp(prefix="kernels-")
atexit.register(shutil.rmtree, SOCKETS, ignore_errors=True)


class PatientKernelManager(AsyncKernelManager):
    """A kernel started by ipykernel's own start, on Unix sockets of its own (SOCKETS), its clients patient."""

    transport = CaselessStrEnum(["tcp", "ipc"], default_value="ipc", config=True)

    @default("ip")
    def _own_sockets(self) -> str:
        return os.path.join(SOCKETS, uuid.uuid4().hex[:12])

    @default("client_factory")
    def _patient_client(self) -> type[PatientClient]:
        return PatientClient


class WarmKernelManager(PatientKernelManager):
    """A kernel whose process imported torch before ipykernel started (python -c WARM instead of
    python -m ipykernel_launcher)."""

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        cmd = super().format_kernel_cmd(extra_arguments)
        assert cmd[1:3] == ["-m", "ipykernel_launcher"], cmd
        return [cmd[0], "-c", WARM, *cmd[3:]]


def start_kernel(env: Mapping[str, str] | None = None, warm: bool = True) -> AsyncKernelManager:
    """A kernel started as a front end starts one: warm (torch imported first), or by ipykernel's own start."""
    km = (WarmKernelManager if warm else PatientKernelManager)(kernel_name="python3")
    run_sync(km.start_kernel)(env=dict(env or os.environ))
    return km


@dataclass
class Spare:
    """A kernel started ahead for one test, in the environment, folder and kind that test was expected to ask."""

    km: AsyncKernelManager
    env: dict[str, str]
    cwd: str


class SpareKernels:
    """While a test runs, the warm kernel of the test after it starts (about 2.3 s here), so its start-up
    overlaps the cells of this one instead of adding to the next. A test takes its spare only when it asks for
    a kernel in exactly the environment and folder the spare was started in (its own TMPDIR included);
    otherwise the spare is shut down and a warm kernel is started then. A `fresh_kernel` test gets no spare:
    its kernels start as before, by nbclient's or jupyter_client's own start. Either way every test gets
    kernels of its own, and no kernel ever ran another test's cell."""

    def __init__(self) -> None:
        self.spares: dict[str, Spare] = {}  # nodeid -> the spare started for that test
        self.tmpdirs: dict[str, Path] = {}  # nodeid -> the folder its spare was started in
        self.current = ""
        self.warm = True

    def begin(self, item: pytest.Item, following: pytest.Item | None, tmpdir: Path) -> None:
        """`item` runs now; start the kernel of `following` in `tmpdir`, its folder to be."""
        self.current, self.warm = item.nodeid, _warm(item)
        self.discard(keep=item.nodeid)
        shared = shares(following) and (SHARED.serves(following) or shares(item) and same_module(item, following))
        if following is not None and _warm(following) and not shared:
            env = {**os.environ, "TMPDIR": str(tmpdir)}
            self.spares[following.nodeid] = Spare(start_kernel(env), env, os.getcwd())
            self.tmpdirs[following.nodeid] = tmpdir

    def take(self) -> AsyncKernelManager | None:
        """The running test's spare, when it was started as the test would start a kernel now, else a warm
        kernel started now; None for a `fresh_kernel` test, whose kernels start as ipykernel's own do."""
        spare = self.spares.pop(self.current, None)
        if spare is not None:
            same = _environment(spare.env) == _environment(os.environ) and spare.cwd == os.getcwd()
            if same and answers(spare.km):
                return spare.km
            run_sync(spare.km.shutdown_kernel)(now=True)
        if not self.warm:
            return None
        km = start_kernel()
        if not answers(km):
            run_sync(km.shutdown_kernel)(now=True)
            km = start_kernel()
        return km

    def discard(self, keep: str = "") -> None:
        for nodeid in [n for n in self.spares if n != keep]:
            run_sync(self.spares.pop(nodeid).km.shutdown_kernel)(now=True)


ANSWER = 30  # seconds a warm kernel may take to answer its first request (about 2.3 s here; more when busy)


def answers(km: AsyncKernelManager) -> bool:
    """Whether the kernel answers a kernel_info request within ANSWER s. A kernel that answers none never ran any
    code of this project (seen twice on TCP ports, before SOCKETS): the test then gets another kernel rather
    than failing after nbclient's 60 s, and pytest's warnings say so."""
    kc = km.client()
    kc.start_channels()
    try:
        run_sync(kc.wait_for_ready)(timeout=ANSWER)
        return True
    except RuntimeError as err:  # "Kernel didn't respond in N seconds", "Kernel died before replying"
        warnings.warn(f"a kernel started for this test did not answer ({err}); another was started", stacklevel=2)
        return False
    finally:
        kc.stop_channels()


def _warm(item: pytest.Item) -> bool:
    return item.get_closest_marker("fresh_kernel") is None


SPARES = SpareKernels()
atexit.register(SPARES.discard)


def _execute(km: AsyncKernelManager | None, sources: tuple[str, ...], timeout: int, allow_errors: bool) -> Cells:
    """Run the cells as a notebook of their own in `km` (None: in a kernel nbclient starts and shuts down)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    options = {"timeout": timeout, "allow_errors": allow_errors, "kernel_manager_class": PatientKernelManager}
    client = NotebookClient(nb, km=km, kernel_name="python3", **options)
    # a cell's last outputs may trail its reply on a busy machine: wait for them, and fail rather than lose them
    client.iopub_timeout, client.raise_on_iopub_timeout = 30, True
    try:
        client.execute()
    except CellTimeoutError as err:
        if km is None:  # nbclient's own kernel, shut down already
            raise
        printed = "".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))[-4000:]
        doing = stacks(km)
        raise AssertionError(
            f"{err}\nWhat the cells printed:\n{printed}\nWhat the kernel and its processes were doing:\n{doing}"
        ) from None
    finally:
        if km is not None and client.kc is not None:  # the client shuts down only the kernels it started
            client.kc.stop_channels()
    return Cells(nb)


def stacks(km: AsyncKernelManager) -> str:
    """For a cell that never ended: each thread's stack in the kernel and every process under it (py-spy, Python
    and native frames), and each one's open files."""
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
    try:
        kernel = psutil.Process(km.provisioner.process.pid)
        processes = [kernel, *kernel.children(recursive=True)]
    except (AttributeError, psutil.Error) as err:
        return f"(not found: {err!r})"
    told = []
    for process in processes:
        try:
            command = [spy, "dump", "--native", "--pid", str(process.pid)]  # C++ frames too: where torch waits
            dump = subprocess.run(command, capture_output=True, text=True, timeout=60)
            said = dump.stdout or dump.stderr
        except (TypeError, OSError, subprocess.SubprocessError) as err:  # no py-spy in this environment
            said = f"(no stack: {err!r})"
        folder = f"/proc/{process.pid}/fd"
        with contextlib.suppress(OSError):
            files = {int(fd): os.readlink(os.path.join(folder, fd)) for fd in os.listdir(folder)}
            said += f"open files: {dict(sorted(files.items()))}\n"
        told.append(said)
    return "\n".join(told)


def run_cells(*sources: str, timeout: int = 300, allow_errors: bool = False) -> Cells:
    """The cells run in a kernel of this test's own, shut down after them."""
    km = SPARES.take()
    try:
        return _execute(km, sources, timeout, allow_errors)
    finally:
        if km is not None:
            run_sync(km.shutdown_kernel)(now=True)


# What a kernel shared by a module's tests keeps of itself between them: the environment and folder it started
# with, written at its first use to a file of the suite's own.
SNAPSHOT = """import json, os
with open({path!r}, "w") as f:
    json.dump({{"env": dict(os.environ), "cwd": os.getcwd()}}, f)
del json, os, f
"""

# Between two tests, the shared kernel is put back as the next test expects a notebook it opens: the extension
# unloaded (which ends a job left running), accelerate's shared state cleared, the environment and folder as
# they were at its first use, and the namespace emptied. What a launch imported stays, as in a notebook.
RESET = """%unload_ext accel_magic
import json, os, sys
if "accelerate.state" in sys.modules:
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
with open({path!r}) as f:
    kept = json.load(f)
os.environ.clear()
os.environ.update(kept["env"])
os.chdir(kept["cwd"])
%reset -f
"""


class SharedKernel:
    """The one kernel the tests of a module run their cells in, one after the other, as the cells of one notebook
    run: a test gets a kernel of its own only when it is about a kernel's start or isolation (marked `own_kernel`
    or `fresh_kernel`) or drives its kernel itself (`live_kernel`). A test that fails takes the kernel with it:
    the next test starts another."""

    def __init__(self) -> None:
        self.module = ""
        self.km: AsyncKernelManager | None = None
        self.snapshot = os.path.join(SOCKETS, "shared-kernel.json")

    def serves(self, item: pytest.Item) -> bool:
        """Whether `item` will run its cells in the kernel running now."""
        return self.km is not None and shares(item) and item.module.__name__ == self.module

    def run(self, module: str, *sources: str, timeout: int = 300, allow_errors: bool = False) -> Cells:
        if module != self.module:
            self.close()
        if self.km is None:
            self.km, self.module = SPARES.take(), module
            assert self.km is not None, "a shared kernel is a warm one"
            _execute(self.km, (SNAPSHOT.format(path=self.snapshot),), timeout, False)
        else:
            _execute(self.km, (RESET.format(path=self.snapshot),), timeout, False)
        return _execute(self.km, sources, timeout, allow_errors)

    def close(self) -> None:
        if self.km is not None:
            run_sync(self.km.shutdown_kernel)(now=True)
        self.km, self.module = None, ""


def same_module(item: pytest.Item, other: pytest.Item | None) -> bool:
    return other is not None and item.module.__name__ == other.module.__name__


def shares(item: pytest.Item | None) -> bool:
    """Whether a test's cells run in its module's shared kernel."""
    if item is None:
        return False
    own = item.get_closest_marker("own_kernel") or item.get_closest_marker("fresh_kernel")
    return "kernel_run" in getattr(item, "fixturenames", ()) and own is None


SHARED = SharedKernel()
atexit.register(SHARED.close)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    if outcome.get_result().failed and SHARED.serves(item):
        SHARED.close()  # whatever the failure left in the kernel is not the next test's


@pytest.fixture(scope="module", autouse=True)
def shared_kernel_ends() -> Any:
    yield
    SHARED.close()


@pytest.fixture(autouse=True)
def private_tmpdir(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    environment_on_path: None,
) -> Any:
    """Each test's kernel gets its own temp folder (the kernel inherits TMPDIR), so what a launch leaves
    behind is told apart from other programs' files; the next test's folder is made now, and its kernel started
    in it (SpareKernels)."""
    path = SPARES.tmpdirs.pop(request.node.nodeid, None) or tmp_path_factory.mktemp("kernel_tmp")
    monkeypatch.setenv("TMPDIR", str(path))
    SPARES.begin(request.node, NEXT.pop(request.node.nodeid, None), tmp_path_factory.mktemp("kernel_tmp"))
    return path


NEXT: dict[str, pytest.Item | None] = {}  # each test's nodeid -> the kernel test that runs after it


def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    NEXT[item.nodeid] = nextitem if nextitem is not None and "private_tmpdir" in nextitem.fixturenames else None


@pytest.fixture(autouse=True)
def environment_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel finds this environment's commands (`!accelerate launch`) as in an activated environment, also
    when the tests run with its python without activating it."""
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.fixture
def kernel_run(request: pytest.FixtureRequest) -> Any:
    """Runs cells as a notebook does: in the module's shared kernel, or in a kernel of the test's own."""
    if shares(request.node):
        return functools.partial(SHARED.run, request.node.module.__name__)
    return run_cells


class Blocking:
    """An AsyncKernelManager or its AsyncKernelClient, its coroutine methods called as blocking ones, on the one
    event loop jupyter_core's run_sync keeps for this thread (as nbclient's are). jupyter_client 7's own blocking
    classes (the pinned stacks') run theirs under nest_asyncio, which patches that loop for the rest of the
    session and once left an nbclient reply waiting for ever."""

    def __init__(self, wrapped: Any) -> None:
        self._wrapped = wrapped

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._wrapped, name)
        return run_sync(attr) if inspect.iscoroutinefunction(attr) else attr


class LiveKernel:
    """A real ipykernel driven message by message (for interrupts and timing), as a front end does."""

    def __init__(self) -> None:
        self.closed = False
        km = SPARES.take() or start_kernel(warm=False)
        self.km, self.kc = Blocking(km), Blocking(km.client())
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def send(self, code: str) -> str:
        """Send a cell; its id. A cell that fails leaves the next one alone: after a cell sent with stop_on_error
        fails, ipykernel aborts the requests that come within a moment of its reply."""
        return self.kc.execute(code, stop_on_error=False)

    def execute(self, code: str, timeout: float = 120) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return self.collect(self.send(code), timeout)

    def start(self, code: str, timeout: float = 60) -> str:
        """Send a cell and return once the kernel runs it (an idle kernel ignores an interrupt); its id."""
        msg_id = self.send(code)
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                return msg_id

    def collect(self, msg_id: str, timeout: float = 120) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        reply, outputs = self.collect_any(msg_id, timeout, timeout)
        assert reply is not None, f"the kernel went idle and sent no reply within {timeout} s"
        return reply, outputs

    def collect_any(
        self, msg_id: str, timeout: float = 120, reply_timeout: float = 5
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The request's reply and outputs; None for the reply when the kernel went idle and sent none within
        `reply_timeout` s: ipykernel logs "KeyboardInterrupt caught in kernel." and sends no reply when an interrupt
        comes while it handles the request outside IPython's run_cell (a few milliseconds before and after it)."""
        outputs = []
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no end of the cell within {timeout} s; doing:\n{stacks(self.km)}") from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content["execution_state"] == "idle":
                break
            if kind in ("stream", "error", "display_data", "execute_result"):
                outputs.append({"output_type": kind, **content})
        try:
            reply = self.kc.get_shell_msg(timeout=reply_timeout)
            while reply["parent_header"].get("msg_id") != msg_id:  # a kernel_info reply left from a slow start
                reply = self.kc.get_shell_msg(timeout=reply_timeout)
        except queue.Empty:
            return None, outputs
        return reply["content"], outputs

    def text(self, code: str, timeout: float = 120) -> str:
        _, outputs = self.execute(code, timeout)
        return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs)

    def value(self, expression: str, timeout: float = 120) -> str:
        """The repr of an expression's value (empty for None), from the cell's result alone: its printed lines may
        hold one that an earlier, interrupted cell's code wrote late."""
        _, outputs = self.execute(expression, timeout)
        return "".join(o["data"]["text/plain"] for o in outputs if o["output_type"] == "execute_result")

    def close(self) -> None:
        """Shut the kernel down (once: a test may end it before its fixture does)."""
        if self.closed:
            return
        self.closed = True
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
