"""The program each forked rank runs: its output redirected to the kernel, the process group joined, the
user's cell run through its body, and how it ended written as a record. A failure of this machinery, before or
after the cell, is recorded as such (kind "internal"), never left to look like the cell's own exit."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Literal, Protocol

from . import memory, shm
from .adopt import adopt_init_process_group, keep_destroyed_groups, word_taken_port
from .outcome import FailureKind, RankFailure
from .places import Places, Sampler
from .processes import REAL_EXIT
from .relay import Pipes, capture_kernel_messages, frame
from .workdir import Workdir

if TYPE_CHECKING:
    from .spec import Launch

__all__ = ["RankBody", "RankProgram", "INTERNAL_EXIT"]

INTERNAL_EXIT = 70  # a rank whose own machinery failed (EX_SOFTWARE)
# What torch.distributed raises (RuntimeError and its Dist*Error subclasses) when a collective waited past the
# process group's timeout, and when another rank died first (never the root cause).
DIST_ERRORS = ("RuntimeError", "DistError", "DistBackendError", "DistStoreError", "DistNetworkError")
TIMED_OUT = ("timed out waiting", "operation timeout", "socket timeout", "wait timeout")
COLLATERAL = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")
COLLATERAL += (shm.PEER_ENDED,)  # the shared-memory all-reduce's own words for a peer that ended

Phase = Literal["before", "cell", "after"]


class RankBody(Protocol):
    """What a launch runs in each rank, in three steps the rank tells apart. `rank` is the rank's place on this
    node (LOCAL_RANK): the results of the first go back to this node's kernel."""

    def setup(self, rank: int) -> None: ...  # before the cell, in the group: e.g. a fresh accelerator
    def run(self) -> None: ...  # the user's cell
    def results(self, rank: int, folder: str) -> bytes | None: ...  # after it: what goes back to the kernel
    def uses(self) -> list[Any]: ...  # in the kernel, before the launch: the models and optimizers it trains


class NodeMismatch(RuntimeError):
    """The group numbered this node's ranks otherwise than the kernel expects: the nodes differ in -n. Worded
    for the user, as accel_magic.errors' are (the same protocol: `_render_traceback_`), and recorded so."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


def classify(err: BaseException) -> FailureKind:
    """A timeout, an error that a dead peer caused, or an exception of its own."""
    if type(err).__name__ not in DIST_ERRORS:
        return "exception"
    text = str(err).lower()
    if any(t in text for t in TIMED_OUT):
        return "timeout"
    if any(t in text for t in COLLATERAL):
        return "collateral"
    return "exception"


def first_line(err: BaseException) -> str:
    """The first line of the message, without gloo's source-file prefix and sign-off."""
    text = str(err).splitlines()[0] if str(err) else ""
    text = re.sub(r"^\[[^\]]+\.(?:cc|cpp|h):\d+\] ", "", text)
    text = re.sub(r"^Unable to cast (.+) to Tensor$", r"\1", text)  # DDP's words around a hook's future's error
    return text.split(" This is typically caused")[0]


def cell_traceback(err: BaseException, cell_filename: str) -> str:
    """The rank's traceback from the cell's first frame on (our own frames are noise to the user)."""
    frames = traceback.extract_tb(err.__traceback__)
    start = next((i for i, f in enumerate(frames) if f.filename == cell_filename), None)
    kept = frames[start:] if start is not None else frames[-1:]
    kept = [f for f in kept if f.filename != __file__] or kept  # not interrupt_once, where an interrupt is raised
    lines = ["Traceback (most recent call last):\n"]
    for f in kept:
        where = f"Cell line {f.lineno}" if f.filename == cell_filename else f'File "{f.filename}", line {f.lineno}'
        lines.append(f"  {where}, in {f.name}\n")
        if f.line:
            lines.append(f"    {f.line.strip()}\n")
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines)


def interrupt_once(signum: int, frame: Any) -> None:
    """SIGINT in a rank: a KeyboardInterrupt where the cell is, once; the front end and the kernel may both send
    one, and a second must not cut short the record of the first. Inside the hooks below, where Python would
    only print it, the interrupt comes again a moment later instead."""
    if _in_hooks(frame):
        _deliver_later()
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _interrupt_again() -> None:
    """The interrupt was raised where Python cannot raise, in a finalizer (pyzmq's `Frame.__del__` checks for
    signals, on frames the rank inherited from the kernel), and only printed: it comes again in 10 ms, where the
    rank runs. Python prints such an exception through both hooks below: the first one seen arms it again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, interrupt_once)  # first: one that comes from now on is not lost either
        _deliver_later()


def _deliver_later() -> None:
    threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()


def _excepthook(etype: type[BaseException], value: BaseException, tb: Any) -> None:
    """sys.excepthook in a rank: Python's own (the kernel's would show the rank's error as the cell's), an
    interrupt not lost."""
    if issubclass(etype, KeyboardInterrupt):
        _interrupt_again()
    else:
        sys.__excepthook__(etype, value, tb)


def _unraisablehook(unraisable: Any) -> None:
    """sys.unraisablehook in a rank: an interrupt not lost, other exceptions printed as Python prints them."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        _interrupt_again()
    else:
        sys.__unraisablehook__(unraisable)


def _in_hooks(frame: Any) -> bool:
    """Whether `frame` runs in one of the hooks above, or in what they call."""
    while frame is not None:
        if frame.f_code in _HOOKS:
            return True
        frame = frame.f_back
    return False


_HOOKS = {f.__code__ for f in (_interrupt_again, _deliver_later, _excepthook, _unraisablehook)}


def detach_from_kernel(kernel: int) -> None:
    """A background launch's rank: out of the kernel's process group, where the front end's interrupts for the
    notebook's cells go, and killed if the kernel dies before it could stop the rank (Linux)."""
    os.setpgid(0, 0)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: when the thread that forked it ends
        if os.getppid() != kernel:  # the kernel went before the call
            REAL_EXIT(1)


def listening_fds(port: int) -> list[int]:
    """This process's sockets listening on `port` (IPv4 or IPv6): in a rank, the kernel's rendezvous store,
    inherited through fork, which the rank must not keep listening."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # not a socket, or the listing's own fd
            continue
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                and sock.getsockname()[1] == port
            ):
                found.append(fd)
        except OSError:
            pass
        finally:
            sock.detach()
    return found


def _flush() -> None:
    """Flush what the rank printed before it ends (os._exit would drop it)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


class RankProgram:
    """Everything a rank needs, inherited through fork; calling it runs the rank whose RANK the agent set."""

    def __init__(
        self,
        spec: Launch,
        env: dict[str, str],
        pipes: Pipes,
        workdir: Workdir,
        port: int,
        places: Places,
        detach: bool = False,
    ):
        self.spec, self.body, self.ranks, self.env = spec, spec.body, spec.ranks, env
        self.pipes, self.workdir, self.port, self.places, self.detach = pipes, workdir, port, places, detach
        self.first_rank, self.cell_filename = spec.first_rank, spec.filename
        self.kernel = os.getpid()
        self.kernel_env = dict(os.environ)  # before torch's agent adds its own

    def __call__(self) -> None:
        rank = int(os.environ.get("RANK", "0"))  # in the whole group: records and messages use it
        local = int(os.environ.get("LOCAL_RANK", "0"))  # on this node: its pipes, and what it sends back
        start = time.time()
        phase: Phase = "before"
        try:
            if self.detach:
                detach_from_kernel(self.kernel)
            memory.first_for_the_oom_killer()
            signal.signal(signal.SIGINT, interrupt_once)
            sys.excepthook, sys.unraisablehook = _excepthook, _unraisablehook
            self.workdir.write("started", rank, os.getpid())
            self._redirect(local)
            if not self.ranks.group:  # as torch's spawn starts a process: the kernel's environment
                os.environ.clear()
                os.environ.update(self.kernel_env)
            os.environ.update(self.env)
            if rank != self.first_rank + local:
                world = os.environ.get("WORLD_SIZE", "?")
                raise NodeMismatch(
                    f"the group of {world} ranks numbered this node's rank {local} as rank {rank}: run the cell "
                    "with the same -n on every node"
                )
            self._setup(local)
            phase = "cell"
            self._run_cell(rank, local)
            phase = "after"
            payload = self.body.results(local, self.workdir.results)
            if payload is not None:
                self.workdir.write_bytes("results", rank, payload)
            imported = [name for name in self.ranks.preload if name in sys.modules]
            self.workdir.write("status", rank, {"duration": time.time() - start, "imported": imported})
            exit_code = 0
        except SystemExit as exc:
            if phase != "cell":  # not the cell's own exit: this machinery's failure
                self._record("error", rank, self._failure(rank, exc, phase))
                exit_code = INTERNAL_EXIT
            else:
                exit_code = self._cell_exit(rank, exc, start)
        except BaseException as err:  # the rank must never unwind into the kernel's code
            self._record("error", rank, self._failure(rank, err, phase))
            exit_code = 1 if phase == "cell" else INTERNAL_EXIT
        _flush()
        if exit_code:
            REAL_EXIT(exit_code)

    def _cell_exit(self, rank: int, exc: SystemExit, start: float) -> int:
        """The cell called sys.exit: code 0 ends the rank well (nothing comes back), others are its failure."""
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exit_code == 0:
            self._record("status", rank, {"duration": time.time() - start})
        else:
            summary = f"called sys.exit({exc.code!r})"
            self._record("error", rank, RankFailure(rank, exit_code, "exit", summary, "", time.time()))
        return exit_code

    def _redirect(self, local: int) -> None:
        os.dup2(self.pipes.out[local][1], 1)
        os.dup2(self.pipes.err[local][1], 2)
        msg_w = os.dup(self.pipes.msg[local][1])
        os.write(msg_w, frame({"hello": os.getpid()}))  # the kernel watches this pid from now on
        for fd in self.pipes.all_fds() + listening_fds(self.port):
            with contextlib.suppress(OSError):
                os.close(fd)
        # Fresh streams on the new fds: the kernel's stream objects hold locks its threads may have held at fork.
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
        capture_kernel_messages(local, msg_w)

    def _setup(self, local: int) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(self.ranks.threads)
        keep_destroyed_groups()
        if not self.ranks.group:
            word_taken_port()
        else:
            if not dist.is_initialized():
                dist.init_process_group(self.ranks.backend, timeout=timedelta(seconds=self.ranks.timeout))
            adopt_init_process_group(self.ranks.backend, print)
            if os.environ.get(shm.ENV) == "shm" and dist.get_world_size() > 1:
                shm.install(self.workdir.segment, self.ranks.timeout, self.ranks.cpus)
        self.body.setup(local)

    def _run_cell(self, rank: int, local: int) -> None:
        """Run the cell, its place sampled for the kernel; a call to os._exit in it leaves no exception, so it is
        recorded, then done as asked."""

        def recorded_exit(code: int) -> None:
            _flush()
            with contextlib.suppress(Exception):
                if code:
                    failure = RankFailure(rank, code, "exit", f"called os._exit({code})", "", time.time())
                    self.workdir.write("error", rank, failure)
            REAL_EXIT(code)

        real_exit, os._exit = os._exit, recorded_exit
        sampler = Sampler(self.places, local, self.cell_filename)
        try:
            self.body.run()
        except BaseException:
            sampler.stop()  # its last place stays: where the cell was
            raise
        else:
            sampler.finish()
        finally:
            os._exit = real_exit

    def _failure(self, rank: int, err: BaseException, phase: Phase) -> RankFailure:
        """The record of an exception: the cell's own (or a collective's), or this machinery's."""
        kind = "exception" if isinstance(err, KeyboardInterrupt) else classify(err)
        first = first_line(err)
        summary = f"{type(err).__name__}: {first}" if first else type(err).__name__
        user_facing = hasattr(err, "_render_traceback_")  # a refusal worded for the user (results too large)
        own = phase != "cell" and kind == "exception" and not isinstance(err, KeyboardInterrupt | MemoryError)
        if not own or user_facing:  # the cell's, a peer's, or out of memory: not a bug of this machinery
            tb = "" if user_facing else cell_traceback(err, self.cell_filename)
            return RankFailure(rank, 1, kind, summary, tb, time.time())
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return RankFailure(
            rank, INTERNAL_EXIT, "internal", f"{phase} the cell ran: {summary}", tb, time.time(), self.ranks.versions()
        )

    def _record(self, kind: Any, rank: int, record: Any) -> None:
        """Write a record; when even that fails, say so on the rank's stderr (the cell's output)."""
        try:
            self.workdir.write(kind, rank, record)
        except BaseException as err:
            with contextlib.suppress(Exception):
                detail = f"{record.summary}\n{record.traceback}" if isinstance(record, RankFailure) else ""
                sys.stderr.write(f"accel_magic could not record rank {rank}'s end ({err!r}). {detail}\n")
