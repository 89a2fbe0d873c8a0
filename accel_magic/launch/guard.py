"""The kernel kept as it was around a launch (environment, signal handlers, loggers, leftover processes; its
interrupts held while a launch runs), and the checks made before one: a free loopback port, and a fork that CUDA
has not poisoned. Every fork in the kernel waits until no thread holds its output streams' buffers.

Private API of torch, used here only:
- `torch.cuda._is_in_bad_fork()` (torch 1.x and later): asked in a throw-away forked child, the only place where
  a poisoned fork shows. Fallback: a torch without it (a CPU build) cannot poison fork, and the check says so.

Private API of ipykernel, used here only:
- `OutStream._buffer_lock` (ipykernel 6.17 to 7.x, tested): taken around every fork. Fallback: a stream without it
  is left alone, as a fork finds it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = [
    "kernel_state_kept",
    "Interrupts",
    "descendants",
    "family",
    "interrupt",
    "stop",
    "check_port",
    "listener",
    "cuda_fork_blocker",
    "REAL_EXIT",
]

SIGNALS_KEPT = [s for s in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGINT") if hasattr(signal, s)]
ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)
AGENT_ENV = "TORCHELASTIC_"  # what the elastic agent sets in the kernel's environment
REAL_EXIT = os._exit  # as the kernel had it: a rank's cell may replace os._exit, and the rank ends through this


@contextlib.contextmanager
def kernel_state_kept(all_env: bool = True) -> Iterator[None]:
    """Whatever torch's elastic agent changes in the kernel (environment, signal handlers, loggers) is put
    back as it was. With `all_env` False (a launch in the background, while the notebook's cells may change the
    environment), only the agent's own TORCHELASTIC_ variables are."""
    env = {k: v for k, v in os.environ.items() if all_env or k.startswith(AGENT_ENV)}
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS_KEPT}
    levels = {name: logging.getLogger(name).level for name in ELASTIC_LOGGERS}
    for name in ELASTIC_LOGGERS:  # its error wall would repeat what the launch reports in one traceback
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for key in set(os.environ) - set(env):
            if all_env or key.startswith(AGENT_ENV):
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


class Interrupts:
    """The kernel's interrupts (SIGINT in its main thread) while a launch holds them: counted and told through
    `stop`, never raised, so no step of the launch (forking, stopping the ranks, cleaning up, applying results)
    is cut short half-way; the second sets `again` (stop the ranks now). Off the main thread nothing is held:
    `stop` is then the caller's own (a background launch's Stop)."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop if stop is not None else threading.Event()
        self.again = threading.Event()
        self.count = 0
        self._previous: Any = None
        self._holds = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        self.stop.set()
        if self.count > 1:
            self.again.set()

    @classmethod
    def hold(cls, stop: threading.Event | None = None) -> Interrupts:
        """Hold the kernel's interrupts until `release()`. Within a hold already in place, that one is returned
        (and stays in place until it is released as often as it was held)."""
        if threading.current_thread() is not threading.main_thread():
            return cls(stop)
        current = signal.getsignal(signal.SIGINT)
        if isinstance(current, Interrupts):
            current._holds += 1
            return current
        held = cls(stop)
        if current is not None and current != signal.SIG_IGN:  # else interrupts do nothing here anyway
            signal.signal(signal.SIGINT, held)
            held._previous, held._holds = current, 1
        return held

    def release(self) -> None:
        """Interrupts as they were before the hold; what came meanwhile stays in `count`."""
        if self._holds:
            self._holds -= 1
            if not self._holds:
                signal.signal(signal.SIGINT, self._previous)


def descendants(known: set[int]) -> list[Any]:
    """The kernel's child processes (recursively), except those in `known`."""
    import psutil

    try:
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in known]
    except psutil.Error:
        return []


def family(pids: list[int]) -> list[Any]:
    """These processes and their children (recursively), those still there."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            parent = psutil.Process(pid)
            procs += [parent, *parent.children(recursive=True)]
    return procs


def interrupt(procs: list[Any]) -> None:
    """SIGINT, without waiting: a rank ends its cell with a KeyboardInterrupt and records where it was."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGINT)


def terminate(procs: list[Any]) -> None:
    """SIGTERM, without waiting or reaping: the agent that started them sees them end and stops the rest."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()


def stop(procs: list[Any], grace: float = 2.0, hurry: threading.Event | None = None) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds, or as soon as `hurry` is set; reap what we can."""
    import psutil

    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + grace
    alive = procs
    while alive and not (hurry is not None and hurry.is_set()):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, alive = psutil.wait_procs(alive, timeout=min(left, 0.05))
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port(port: int, host: str = "127.0.0.1") -> bool:
    """True when the port can be bound on `host` now."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listener(port: int | None, host: str = "127.0.0.1") -> socket.socket:
    """The rendezvous socket, bound now to `host` alone (port None: a free one), so no other launch or program
    can take the port between choosing and using it."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.bind((host, port or 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


FORK_WAITS_FOR: list[Any] = []  # locks of the kernel that every fork waits for (peers' store calls)
_HELD: list[Any] = []


def _hold() -> None:
    """Before a fork: take FORK_WAITS_FOR's locks and the buffer lock of the kernel's output streams (ipykernel's,
    `_buffer_lock`). Its IOPub thread and the thread that reads the process's own stdout and stderr take that one
    for each write and flush; a child forked while one of them held it would stop for ever at its first print
    (accelerate's own launcher, DataLoader workers, multiprocessing)."""
    streams = [lock for stream in (sys.stdout, sys.stderr) if (lock := getattr(stream, "_buffer_lock", None))]
    _HELD[:] = [*FORK_WAITS_FOR, *streams]
    for lock in _HELD:
        lock.acquire()


def _release() -> None:
    """After a fork, in the parent and in the child."""
    for lock in reversed(_HELD):
        lock.release()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_hold, after_in_parent=_release, after_in_child=_release)


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
        REAL_EXIT(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return "this kernel asked CUDA something that poisons fork (such as torch.cuda.get_arch_list())"
