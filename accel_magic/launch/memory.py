"""The ranks' memory (Linux): each rank the out-of-memory killer's first choice, its peak as the kernel sees it,
whether the killer ended a process while the launch ran, and the words of a rank it ended."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

__all__ = ["first_for_the_oom_killer", "oom_kills", "look", "killed_words"]

ADVICE = "try fewer ranks, a smaller batch or bf16 mixed precision"


def first_for_the_oom_killer() -> None:
    """In a rank: the out-of-memory killer takes this process before any other, the kernel that forked it
    included (oom_score_adj 1000, which any process may raise its own to)."""
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")


def oom_kills() -> int | None:
    """How many processes the out-of-memory killer has ended on this machine since it started, a memory cgroup's
    included (/proc/vmstat); None where that is not counted."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak(pid: int) -> int | None:
    """The most memory the process has held at once so far (VmHWM), in bytes."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def look(peaks: dict[int, int], pids: Mapping[int, int]) -> None:
    """Each rank's peak so far into `peaks` (rank -> bytes), from its process (rank -> pid) while it runs."""
    for rank, pid in pids.items():
        peak = _peak(pid)
        if peak is not None and peak > peaks.get(rank, 0):
            peaks[rank] = peak


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def killed_words(peak: int | None, limit: tuple[int, str] | None) -> str:
    """What a rank the out-of-memory killer ended says: its peak, the limit that applies to the kernel and its
    ranks (bytes, and where it comes from: "cgroup v2", "cgroup v1" or "machine"), and what to try."""
    at = f" at {_gib(peak)} (its peak" if peak is not None else " (its peak unknown"
    if limit is None:
        within = ""
    elif limit[1] == "machine":
        within = f"; the machine has {_gib(limit[0])}"
    else:
        within = f"; the kernel and its ranks may use {_gib(limit[0])}, the {limit[1]} limit"
    return f"was killed by the out-of-memory killer{at}{within}): {ADVICE}"
