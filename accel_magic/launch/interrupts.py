"""The kernel's interrupts while a launch runs: counted and told, never raised, so that no step is cut short."""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["Interrupts"]


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
