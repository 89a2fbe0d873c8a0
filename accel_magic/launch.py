"""Run a function as N forked ranks under torch's elastic agent: ports, environment, threads, per-rank
output, results, errors and cleanup."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import re
import selectors
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any

__all__ = ["LaunchError", "RankFailure", "LaunchOutcome", "launch", "listener", "check_port", "cuda_fork_blocker"]

# What torch.distributed raises (RuntimeError and its Dist*Error subclasses) when a collective waited past the
# process group's timeout, and when another rank died first (never the root cause).
DIST_ERRORS = ("RuntimeError", "DistError", "DistBackendError", "DistStoreError", "DistNetworkError")
TIMED_OUT = ("timed out waiting", "operation timeout", "socket timeout", "wait timeout")
COLLATERAL = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")
SIGNALS_KEPT = [s for s in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGINT") if hasattr(signal, s)]
_REAL_EXIT = os._exit
INTERNAL_EXIT = 70  # a rank whose own machinery failed (EX_SOFTWARE)
ISSUES_URL = "https://github.com/accel-magic/accel_magic/issues"
ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)


class LaunchError(Exception):
    """A launch that failed; shows one short traceback naming the rank where it started."""

    def __init__(self, headline: str, details: str = "", outcome: LaunchOutcome | None = None):
        super().__init__(headline)
        self.headline = headline
        self.details = details
        self.outcome = outcome

    def _render_traceback_(self) -> list[str]:
        lines = [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self.headline}"]
        if self.details:
            lines += self.details.rstrip("\n").split("\n")
        return lines


@dataclass(frozen=True)
class RankFailure:
    """A rank's failure as plain data (no exception object, which would keep the launch alive)."""

    rank: int
    exitcode: int | None
    kind: str  # "exception", "exit", "signal", "collateral", "timeout", "internal" (accel_magic's own failure)
    summary: str
    traceback: str = ""
    when: float | None = None
    versions: str = ""  # for an internal failure: what a bug report needs


@dataclass
class LaunchOutcome:
    num_processes: int
    wall_time: float = 0.0
    cleanup_time: float = 0.0  # part of wall_time spent putting the kernel back as it was
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    durations: dict[int, float] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    received: Any = None  # what `receive` made of rank 0's results, in the kernel
    receive_error: str = ""
    interrupted: bool = False
    agent_error: str = ""
    skipped: tuple[tuple[str, str], ...] = ()
    results_seconds: dict[str, float] = field(default_factory=dict)  # send (rank 0), receive, apply (kernel)
    ended: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (exit code or -signal, when)

    def __repr__(self) -> str:
        status = "ok" if self.ok else ("interrupted" if self.interrupted else "failed")
        ranks = ", ".join(
            f"rank {r}: exit {c}" + (f" after {self.durations[r]:.2f} s" if r in self.durations else "")
            for r, c in sorted(self.exitcodes.items())
        )
        return f"<accel_train {status}: {self.num_processes} processes, wall time {self.wall_time:.2f} s; {ranks}>"

    @property
    def ok(self) -> bool:
        return not self.failures and not self.interrupted and not self.agent_error

    def root_cause(self) -> RankFailure | None:
        """The rank where the failure started: an exception, exit or kill before any collateral error."""
        if not self.failures:
            return None

        # The first to fail, by the time its record was written or its process was seen to end; errors that a
        # dead peer caused come last whatever their time, and so do ends nobody saw.
        def key(f: RankFailure) -> tuple[bool, bool, float, int]:
            return (f.kind == "collateral", f.when is None, f.when or 0.0, f.rank)

        return min(self.failures, key=key)


# --- ports and fork checks ---------------------------------------------------------------------------------------


def check_port(port: int) -> bool:
    """True when the port can be bound on loopback now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cuda_fork_blocker() -> str | None:
    """Why a forked child could not use CUDA, or None when it could. A throw-away fork asks torch: a parent
    that initialized CUDA, or only poisoned it (torch.cuda.get_arch_list(), a plain is_available()), makes a
    bad fork, which the parent itself cannot see."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if torch.cuda.is_initialized():
        return "CUDA is already initialized in this kernel (a tensor or model on the GPU, or a device query)"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the throw-away child
        _REAL_EXIT(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return "this kernel asked CUDA something that poisons fork (such as torch.cuda.get_arch_list())"


# --- what runs in a rank -----------------------------------------------------------------------------------------


@dataclass
class _Pipes:
    out: list[tuple[int, int]]
    err: list[tuple[int, int]]
    msg: list[tuple[int, int]]  # per rank: a hello with its pid; rank 0 also its kernel messages

    def all_fds(self) -> list[int]:
        return [fd for pair in self.out + self.err + self.msg for fd in pair]


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!I", len(data)) + data


def _forward_kernel_messages(rank: int, msg_fd: int) -> None:
    """In a rank, the kernel's session cannot send (fork check, dead IOPub thread). Rank 0's IOPub messages
    (displays, widgets such as tqdm.auto bars) go to the parent through a pipe; other ranks' are dropped."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    kernel = getattr(get_ipython(), "kernel", None)
    session = getattr(kernel, "session", None)
    if session is None:
        return
    iopub = getattr(kernel, "iopub_socket", None)

    def send(stream: Any, msg_or_type: Any, content: Any = None, parent: Any = None, ident: Any = None,
             buffers: Any = None, track: bool = False, header: Any = None, metadata: Any = None) -> Any:  # fmt: skip
        if rank != 0 or stream is not iopub:
            return None
        message = {"msg_or_type": msg_or_type, "content": content, "parent": parent, "ident": ident,
                   "buffers": [bytes(b) for b in buffers or []], "header": header, "metadata": metadata}  # fmt: skip
        with contextlib.suppress(Exception):
            os.write(msg_fd, _frame(message))
        return None

    session.send = send


def _render_rank_traceback(err: BaseException, cell_filename: str) -> str:
    """The rank's traceback from the cell's first frame on (our own frames are noise to the user)."""
    frames = traceback.extract_tb(err.__traceback__)
    start = next((i for i, f in enumerate(frames) if f.filename == cell_filename), None)
    kept = frames[start:] if start is not None else frames[-1:]
    lines = ["Traceback (most recent call last):\n"]
    for f in kept:
        where = f"Cell line {f.lineno}" if f.filename == cell_filename else f'File "{f.filename}", line {f.lineno}'
        lines.append(f"  {where}, in {f.name}\n")
        if f.line:
            lines.append(f"    {f.line.strip()}\n")
    lines += traceback.format_exception_only(type(err), err)
    return "".join(lines)


def _first_line(err: BaseException) -> str:
    """The first line of the message, without gloo's source-file prefix and sign-off."""
    text = str(err).splitlines()[0] if str(err) else ""
    text = re.sub(r"^\[[^\]]+\.(?:cc|cpp|h):\d+\] ", "", text)
    return text.split(" This is typically caused")[0]


def _classify(err: BaseException) -> str:
    if type(err).__name__ not in DIST_ERRORS:
        return "exception"
    text = str(err).lower()
    if any(t in text for t in TIMED_OUT):
        return "timeout"
    if any(t in text for t in COLLATERAL):
        return "collateral"
    return "exception"


class _Rank:
    """Everything a rank needs, inherited through fork. A failure of this machinery, before or after the
    user's cell, is recorded as such (kind "internal"), never left to look like the cell's own exit."""

    def __init__(self, body: Any, pipes: _Pipes, workdir: str, env: dict[str, str], threads: int, backend: str,
                 timeout: float, cell_filename: str, port: int):  # fmt: skip
        self.body, self.pipes, self.workdir, self.env = body, pipes, workdir, env
        self.threads, self.backend, self.timeout, self.cell_filename = threads, backend, timeout, cell_filename
        self.port = port
        self.results_dir = os.path.join(workdir, "results")

    def path(self, kind: str, rank: int) -> str:
        return os.path.join(self.workdir, f"{kind}-{rank}")

    def _write(self, kind: str, rank: int, obj: Any) -> None:
        tmp = self.path(kind, rank) + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self.path(kind, rank))

    def _rendezvous_fds(self) -> list[int]:
        """The kernel's rendezvous store sockets (listening on the launch's port, IPv4 or IPv6), which a rank
        inherits and must not keep listening."""
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
                    and sock.getsockname()[1] == self.port
                ):
                    found.append(fd)
            except OSError:
                pass
            finally:
                sock.detach()
        return found

    def _redirect(self, rank: int) -> None:
        os.dup2(self.pipes.out[rank][1], 1)
        os.dup2(self.pipes.err[rank][1], 2)
        msg_w = os.dup(self.pipes.msg[rank][1])
        os.write(msg_w, _frame({"hello": os.getpid()}))  # the kernel watches this pid from now on
        for fd in self.pipes.all_fds() + self._rendezvous_fds():
            with contextlib.suppress(OSError):
                os.close(fd)
        # Fresh streams on the new fds: the kernel's stream objects hold locks its threads may have held at fork.
        sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
        _forward_kernel_messages(rank, msg_w)

    def _record_os_exit(self, rank: int) -> None:
        """A cell that calls os._exit leaves no exception: record the call, then exit as asked."""

        def _exit(code: int) -> None:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
                if code:
                    summary = f"called os._exit({code})"
                    self._write("error", rank, RankFailure(rank, code, "exit", summary, "", time.time()))
            _REAL_EXIT(code)

        os._exit = _exit

    def __call__(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        start = time.time()
        phase = "before"
        try:
            self._write("started", rank, os.getpid())
            self._redirect(rank)
            os.environ.update(self.env)
            self._setup(rank)
            phase = "cell"
            self._run_cell(rank)
            phase = "after"
            payload = self.body.results(rank, self.results_dir)
            if payload is not None:
                tmp = self.path("results", rank) + ".tmp"
                with open(tmp, "wb") as f:
                    f.write(payload)
                os.replace(tmp, self.path("results", rank))
            self._write("status", rank, {"duration": time.time() - start})
            exit_code = 0
        except SystemExit as exc:  # only the cell raises it: its own exit, as the user asked
            exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exit_code == 0:
                self._write_or_tell("status", rank, {"duration": time.time() - start})
            else:
                summary = f"called sys.exit({exc.code!r})"
                self._write_or_tell("error", rank, RankFailure(rank, exit_code, "exit", summary, "", time.time()))
        except BaseException as err:  # the rank must never unwind into the kernel's code
            self._write_or_tell("error", rank, self._failure(rank, err, phase))
            exit_code = 1 if phase == "cell" else INTERNAL_EXIT
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if exit_code:
            _REAL_EXIT(exit_code)

    def _setup(self, rank: int) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(self.threads)
        self._reset_accelerate()
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timedelta(seconds=self.timeout))
        self.body.setup(rank)

    def _run_cell(self, rank: int) -> None:
        real_exit = os._exit
        self._record_os_exit(rank)
        try:
            self.body.run()
        finally:
            os._exit = real_exit

    def _failure(self, rank: int, err: BaseException, phase: str) -> RankFailure:
        """The record of an exception: the cell's own (or a collective's), or this machinery's."""
        kind = "exception" if isinstance(err, KeyboardInterrupt) else _classify(err)
        first = _first_line(err)
        summary = f"{type(err).__name__}: {first}" if first else type(err).__name__
        user_facing = getattr(err, "no_traceback", False)  # a refusal worded for the user (results too large)
        own = phase != "cell" and kind == "exception" and not isinstance(err, (KeyboardInterrupt, MemoryError))
        if not own or user_facing:  # the cell's, a peer's, or out of memory: not a bug of this machinery
            tb = "" if user_facing else _render_rank_traceback(err, self.cell_filename)
            return RankFailure(rank, 1, kind, summary, tb, time.time())
        tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        return RankFailure(rank, INTERNAL_EXIT, "internal", f"{phase} the cell ran: {summary}", tb, time.time(),
                           versions_line())  # fmt: skip

    def _write_or_tell(self, kind: str, rank: int, record: Any) -> None:
        """Write a record; when even that fails, say so on the rank's stderr (the cell's output)."""
        try:
            self._write(kind, rank, record)
        except BaseException as err:
            with contextlib.suppress(Exception):
                detail = f"{record.summary}\n{record.traceback}" if isinstance(record, RankFailure) else ""
                sys.stderr.write(f"accel_magic could not record rank {rank}'s end ({err!r}). {detail}\n")

    @staticmethod
    def _reset_accelerate() -> None:
        """State copied from the notebook (an Accelerator or PartialState made in the kernel) would make the
        rank believe it trains alone."""
        if "accelerate" in sys.modules:
            from accelerate.state import AcceleratorState, GradientState

            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()


def versions_line() -> str:
    """The versions a bug report needs, in one line."""
    from .runtime import _versions

    return ", ".join(f"{name} {version or '-'}" for name, version in _versions())


# --- the parent's side -------------------------------------------------------------------------------------------


LOOPBACK_BACKEND = "accel_magic_loopback"
_store_took: set[int] = set()  # listening fds a TCP store took over (it closes them itself)


def _create_loopback_handler(params: Any) -> Any:
    """torch's static rendezvous, with its TCP store serving on a socket already bound to 127.0.0.1 (left to
    itself it listens on every interface)."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    fd = int(params.config.pop("listen_fd"))
    handler = create_rdzv_handler(params)
    handler._store = TCPStore(
        handler.master_addr,
        handler.master_port,
        handler.world_size,
        True,
        timedelta(seconds=handler.timeout.total_seconds()),
        master_listen_fd=fd,
    )
    _store_took.add(fd)
    handler.get_backend = lambda: LOOPBACK_BACKEND  # the registry checks the name it was asked for
    return handler


def _loopback_rendezvous_supported() -> bool:
    """torch's TCP store takes a pre-bound listening socket on recent releases; feature-detect it."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if "master_listen_fd" not in (TCPStore.__init__.__doc__ or ""):
        return False
    registry._registry[LOOPBACK_BACKEND] = _create_loopback_handler  # reload-safe, unlike register()
    return True


def _launch_config(nprocs: int, port: int, log_dir: str, monitor: float, listen_fd: int | None) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    names = {f.name for f in fields(LaunchConfig)}
    rdzv_configs: dict[str, Any] = {"rank": 0, "timeout": 60}
    if listen_fd is not None:
        rdzv_configs["listen_fd"] = listen_fd
    kwargs: dict[str, Any] = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"accel_magic_{os.getpid()}_{port}",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_backend=LOOPBACK_BACKEND if listen_fd is not None else "static",
        rdzv_configs=rdzv_configs,
        max_restarts=0,
        monitor_interval=monitor,
        start_method="fork",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    if "shutdown_timeout" in names:
        kwargs["shutdown_timeout"] = 2  # a rank that ignores SIGTERM is killed after 2 s, not 30
    numa = "numa_options" in names
    if numa:  # an explicit value stops LaunchConfig from asking CUDA in the kernel
        from torch.numa.binding import AffinityMode, NumaOptions

        kwargs["numa_options"] = NumaOptions(AffinityMode.NODE)
    config = LaunchConfig(**kwargs)
    if numa:
        config.numa_options = None
    return config


def listener(port: int | None) -> socket.socket:
    """The rendezvous socket, bound to 127.0.0.1 now (port None: a free one), so no other launch or program
    can take the port between choosing and using it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port or 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class _AgentThread:
    """One daemon thread, kept for the kernel's life, runs every launch's agent. It forks the ranks, and a
    kernel gives each thread that touches its output streams (fork flushes them) resources of its own; a
    daemon thread is also never joined at exit, which a forked rank (whose main thread it becomes) would try."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="accel_magic-agent", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()

    def submit(self, job: Callable[[], None]) -> threading.Event:
        done = threading.Event()

        def run() -> None:
            try:
                job()
            finally:
                done.set()

        self.jobs.put(run)
        return done

    def stop(self) -> None:
        self.jobs.put(None)


_agent: _AgentThread | None = None


def _agent_thread() -> _AgentThread:
    global _agent
    if _agent is None or not _agent.thread.is_alive():
        _agent = _AgentThread()
    return _agent


def shutdown_agent_thread() -> None:
    global _agent
    if _agent is not None:
        _agent.stop()
        _agent = None


def _run_agent(config: Any, entry: Callable[[], None], outcome: LaunchOutcome) -> None:
    """The elastic agent, in a thread of its own: it then installs no signal handlers in the kernel, and the
    kernel's main thread stays free to relay output and take interrupts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config, entry)()
        outcome.exitcodes = dict.fromkeys(range(config.nproc_per_node), 0)
    except ChildFailedError as err:
        codes: dict[int, int | None] = dict.fromkeys(range(config.nproc_per_node), 0)
        for rank, failure in err.failures.items():
            codes[rank] = failure.exitcode
        outcome.exitcodes = codes
    except BaseException as err:  # anything else is reported as text: no exception object survives the launch
        outcome.agent_error = f"{type(err).__name__}: {err}"


@contextlib.contextmanager
def _kernel_state_kept() -> Any:
    """Whatever torch's elastic agent changes in the kernel (environment, signal handlers, loggers) is put
    back as it was."""
    env = dict(os.environ)
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS_KEPT}
    levels = {name: logging.getLogger(name).level for name in ELASTIC_LOGGERS}
    for name in ELASTIC_LOGGERS:  # its error wall would repeat what the launch reports in one traceback
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for key in set(os.environ) - set(env):
            del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if threading.current_thread() is threading.main_thread():
            for name, handler in handlers.items():
                if handler is not None and signal.getsignal(getattr(signal, name)) is not handler:
                    signal.signal(getattr(signal, name), handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _descendants(known: set[int]) -> list[Any]:
    import psutil

    try:
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in known]
    except psutil.Error:
        return []


def _stop(procs: list[Any], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; reap what we can."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)


class _Relay:
    """Reads every rank's fds 1 and 2 (and rank 0's kernel messages) in the kernel's main thread."""

    def __init__(self, pipes: _Pipes, on_text: Callable[[int, str, str], None],
                 on_message: Callable[[dict[str, Any]], None]):  # fmt: skip
        from .display import RankLines

        self.lines = RankLines()
        self.on_text, self.on_message = on_text, on_message
        self.sel = selectors.DefaultSelector()
        for rank, (r, _) in enumerate(pipes.out):
            os.set_blocking(r, False)
            self.sel.register(r, selectors.EVENT_READ, (rank, "stdout"))
        for rank, (r, _) in enumerate(pipes.err):
            os.set_blocking(r, False)
            self.sel.register(r, selectors.EVENT_READ, (rank, "stderr"))
        for rank, (r, _) in enumerate(pipes.msg):
            os.set_blocking(r, False)
            self.sel.register(r, selectors.EVENT_READ, (rank, "msg"))
        self.msg_buffers: dict[int, bytes] = {}
        self.ended: dict[int, tuple[int, float]] = {}  # rank -> (exit code or -signal, when it ended)

    def watch(self, rank: int, pid: int) -> bool:
        """Wake when the rank's process ends, to read how and when before anyone reaps it."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here, or already reaped
            return False
        self.sel.register(pidfd, selectors.EVENT_READ, (rank, "exit"))
        return True

    def _ended(self, rank: int, pidfd: int) -> None:
        self.sel.unregister(pidfd)
        with contextlib.suppress(OSError):
            info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            if info is not None:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                self.ended.setdefault(rank, (code, time.time()))
        os.close(pidfd)

    def poll(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            rank, stream = key.data
            if stream == "exit":
                self._ended(rank, key.fd)
                continue
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                self.sel.unregister(key.fd)
                continue
            if stream == "msg":
                self._messages(rank, data)
            else:
                text = self.lines.feed(rank, stream, data)
                if text:
                    self.on_text(rank, stream, text)

    def _messages(self, rank: int, data: bytes) -> None:
        buffer = self.msg_buffers.get(rank, b"") + data
        while len(buffer) >= 4:
            (size,) = struct.unpack("!I", buffer[:4])
            if len(buffer) < 4 + size:
                break
            frame, buffer = buffer[4 : 4 + size], buffer[4 + size :]
            with contextlib.suppress(Exception):
                message = pickle.loads(frame)
                if "hello" in message:
                    self.watch(rank, message["hello"])
                elif rank == 0:
                    self.on_message(message)
        self.msg_buffers[rank] = buffer

    def close_watches(self) -> None:
        for key in list(self.sel.get_map().values()):
            if key.data[1] == "exit":
                self.sel.unregister(key.fd)
                os.close(key.fd)

    def drain(self) -> None:
        self.close_watches()
        for _ in range(1000):
            if not self.sel.get_map() or not self.sel.select(0):
                break
            self.poll(0)
        for rank, stream, text in self.lines.flush():
            self.on_text(rank, stream, text)
        self.sel.close()


def launch(
    body: Any,
    nprocs: int,
    *,
    backend: str,
    threads: int,
    timeout: float,
    env: dict[str, str],
    cell_filename: str,
    on_text: Callable[[int, str, str], None],
    on_message: Callable[[dict[str, Any]], None],
    port: int | None = None,
    receive: Callable[[bytes, str], Any] | None = None,
    max_bytes: int = 0,
) -> LaunchOutcome:
    """Run `body` (a RankBody: setup(rank), run(), results(rank, folder)) in `nprocs` forked ranks that form one
    process group. What rank 0's results() returns (bytes) and the files it wrote in the folder it is given reach
    `receive(payload, folder)` in the kernel, whose answer is `outcome.received`. The kernel is left as it was:
    no process, port, file or handler."""
    outcome = LaunchOutcome(nprocs)
    started = time.perf_counter()
    known = {p.pid for p in _descendants(set())}
    workdir = tempfile.mkdtemp(prefix="accel_magic-", dir=_work_root(max_bytes))  # 0700, unguessable, removed below
    os.mkdir(os.path.join(workdir, "results"), 0o700)
    pipes = _Pipes(*([os.pipe() for _ in range(nprocs)] for _ in range(3)))
    sock = listener(port)
    port = sock.getsockname()[1]
    fd = sock.detach() if _loopback_rendezvous_supported() else None
    if fd is None:
        sock.close()  # an older torch: its static store binds the port itself
    rank = _Rank(body, pipes, workdir, env, threads, backend, timeout, cell_filename, port)
    relay = _Relay(pipes, on_text, on_message)
    try:
        with _kernel_state_kept():
            config = _launch_config(nprocs, port, os.path.join(workdir, "logs"), 0.05, fd)

            def accel_train() -> None:  # torch's agent names its entrypoint after the function
                rank()

            done = _agent_thread().submit(partial(_run_agent, config, accel_train, outcome))
            del config
            try:
                while not done.is_set():
                    relay.poll(0.05)
            except KeyboardInterrupt:
                outcome.interrupted = True
                _stop(_descendants(known))
                done.wait(10)
            relay.drain()
            outcome.ended = relay.ended
    finally:
        cleanup_started = time.perf_counter()
        for pipe_fd in pipes.all_fds():
            with contextlib.suppress(OSError):
                os.close(pipe_fd)
        if fd is not None and fd not in _store_took:
            os.close(fd)  # the store was never made: the socket is still ours
        _store_took.discard(fd)  # type: ignore[arg-type]
        leftovers = _descendants(known)
        if leftovers:
            _stop(leftovers)
        _collect(outcome, rank, nprocs, receive)
        shutil.rmtree(workdir, ignore_errors=True)
        outcome.cleanup_time = time.perf_counter() - cleanup_started
        outcome.wall_time = time.perf_counter() - started
    return outcome


def _work_root(max_bytes: int) -> str | None:
    """Where the launch's private folder goes: /dev/shm (memory, so results travel at memory speed) when it can
    hold the result limit, unless TMPDIR says otherwise; else the usual temp folder."""
    if os.environ.get("TMPDIR") or not os.access("/dev/shm", os.W_OK):
        return None
    stats = os.statvfs("/dev/shm")
    return "/dev/shm" if stats.f_bavail * stats.f_frsize > max_bytes else None


def _load(path: str) -> Any:
    with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError), open(path, "rb") as f:
        return pickle.load(f)
    return None


def _abrupt(rank: int, code: int | None) -> RankFailure:
    """A rank that ended without leaving a record: killed, crashed, or ended by the agent."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (as the out-of-memory killer does)" if name == "SIGKILL" else ""
        return RankFailure(rank, code, "signal", f"was killed by {name}{hint}")
    if code:
        return RankFailure(rank, code, "signal", f"ended with exit code {code} without raising an exception")
    return RankFailure(
        rank, None, "signal", "died without raising an exception (killed, e.g. by the out-of-memory killer, or crashed)"
    )


def _collect(outcome: LaunchOutcome, rank: _Rank, nprocs: int, receive: Callable[[bytes, str], Any] | None) -> None:
    failed = bool(outcome.agent_error) or any(outcome.exitcodes.get(r) for r in range(nprocs))
    failed = failed or any(code for code, _ in outcome.ended.values())
    for r, (code, _) in outcome.ended.items():
        outcome.exitcodes[r] = code
    for r in range(nprocs):
        status = _load(rank.path("status", r))
        if status is not None:
            outcome.durations[r] = status["duration"]
        error = _load(rank.path("error", r))
        if error is not None:
            outcome.failures.append(error)
        elif status is None and (failed or outcome.exitcodes.get(r)) and _load(rank.path("started", r)):
            code, when = outcome.ended.get(r, (outcome.exitcodes.get(r), None))
            outcome.failures.append(replace(_abrupt(r, code), when=when))
    if outcome.ok and receive is not None:
        payload = None
        with contextlib.suppress(OSError), open(rank.path("results", 0), "rb") as f:
            payload = f.read()
        if payload is not None:
            try:
                outcome.received = receive(payload, rank.results_dir)
            except Exception as err:  # a damaged transfer: reported, nothing applied
                outcome.receive_error = f"{type(err).__name__}: {err}"


def launch_error(outcome: LaunchOutcome, timeout: float) -> LaunchError:
    """One exception for a failed launch, built outside any `except` block: it names the rank where the
    failure started and holds nothing of the launch (so the rendezvous port is freed)."""
    if outcome.agent_error:
        return LaunchError(f"the launch failed before the cell ran: {outcome.agent_error}", outcome=outcome)
    root = outcome.root_cause()
    assert root is not None
    stopped = " The other ranks were stopped." if outcome.num_processes > 1 else ""
    if root.kind == "timeout":
        headline = (
            f"rank {root.rank}: a collective waited more than {timeout:g} s (--timeout) for the other ranks; "
            f"every rank must reach the same collectives ({root.summary}).{stopped}"
        )
    elif root.kind == "internal":
        headline = (
            f"accel_magic failed inside rank {root.rank} {root.summary}.{stopped} This is a bug in accel_magic, "
            f"not in your cell: please report it at {ISSUES_URL} with the traceback and versions below."
        )
        return LaunchError(headline, f"{root.traceback.rstrip()}\nversions: {root.versions}", outcome)
    elif root.kind == "signal":
        headline = f"rank {root.rank} {root.summary}.{stopped}"
    elif root.kind == "exit":
        headline = f"rank {root.rank} {root.summary}.{stopped}"
    else:
        headline = f"rank {root.rank} raised {root.summary}" + (
            "; the other ranks were stopped." if outcome.num_processes > 1 else ""
        )
    return LaunchError(headline, root.traceback, outcome)
