"""The launch's processes: found among the kernel's children, interrupted, terminated or stopped; and the
real `os._exit`, through which a rank ends."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any

__all__ = ["descendants", "family", "interrupt", "terminate", "stop", "REAL_EXIT"]

REAL_EXIT = os._exit  # as the kernel had it: a rank's cell may replace os._exit, and the rank ends through this


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
