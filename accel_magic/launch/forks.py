"""Forks from the kernel: every fork waits until no thread holds the kernel's output streams' buffers (or a lock
listed in FORK_WAITS_FOR), and whether a forked child could use CUDA.

Private API of torch, used here only:
- `torch.cuda._is_in_bad_fork()` (torch 1.x and later): asked in a throw-away forked child, the only place where
  a poisoned fork shows. Fallback: a torch without it (a CPU build) cannot poison fork, and the check says so.

Private API of ipykernel, used here only:
- `OutStream._buffer_lock` (ipykernel 6.17 to 7.x, tested): taken around every fork. Fallback: a stream without it
  is left alone, as a fork finds it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .processes import REAL_EXIT

__all__ = ["FORK_WAITS_FOR", "cuda_fork_blocker"]

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
