"""The launch's private files: its folder and the records each rank leaves in it, the writer (in the rank) and
the reader (in the kernel) in one place, and the name of its shared-memory segment, removed with the folder."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
from typing import Any, Literal

from .outcome import RankRecords

__all__ = ["RecordKind", "Workdir"]

RecordKind = Literal[
    "started",  # the rank's pid, written first
    "status",  # {"duration": seconds, "imported": the modules of Ranks.preload it had}: the rank ended well
    "error",  # a RankFailure
    "results",  # rank 0's results manifest (bytes, as the rank's body made them)
]


def _root(max_bytes: int) -> str | None:
    """Where the folder goes: /dev/shm (memory, so results travel at memory speed) when it can hold the result
    limit, unless TMPDIR says otherwise; else the usual temp folder."""
    if os.environ.get("TMPDIR") or not os.access("/dev/shm", os.W_OK):
        return None
    stats = os.statvfs("/dev/shm")
    return "/dev/shm" if stats.f_bavail * stats.f_frsize > max_bytes else None


class Workdir:
    """A 0700 folder with an unguessable name that starts with the kernel's pid (`accel_magic-PID-...`: whose
    it is, were one ever left), made for one launch and removed after it. Ranks inherit it through fork;
    `results` is the folder rank 0 writes its result files into; `segment` is where the ranks may make the
    launch's shared-memory segment (under /dev/shm, named after the folder), which goes with it."""

    def __init__(self, max_bytes: int = 0) -> None:
        self.path = tempfile.mkdtemp(prefix=f"accel_magic-{os.getpid()}-", dir=_root(max_bytes))
        self.results = os.path.join(self.path, "results")
        os.mkdir(self.results, 0o700)
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else self.path
        self.segment = os.path.join(shm, os.path.basename(self.path) + ".grads")

    def file(self, kind: RecordKind, rank: int) -> str:
        return os.path.join(self.path, f"{kind}-{rank}")

    def write_bytes(self, kind: RecordKind, rank: int, data: bytes) -> None:
        """Write a record whole or not at all (a reader never sees half of one)."""
        tmp = self.file(kind, rank) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.file(kind, rank))

    def write(self, kind: RecordKind, rank: int, obj: Any) -> None:
        self.write_bytes(kind, rank, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def read_bytes(self, kind: RecordKind, rank: int) -> bytes | None:
        with contextlib.suppress(OSError), open(self.file(kind, rank), "rb") as f:
            return f.read()
        return None

    def read(self, kind: RecordKind, rank: int) -> Any:
        """The record, or None when the rank left none (or a damaged one)."""
        data = self.read_bytes(kind, rank)
        with contextlib.suppress(Exception):  # truncated, corrupted, or of a class that no longer imports
            return pickle.loads(data) if data is not None else None
        return None

    def records(self, rank: int) -> RankRecords:
        status = self.read("status", rank)
        return RankRecords(
            started=self.read("started", rank) is not None,
            duration=status["duration"] if isinstance(status, dict) else None,
            error=self.read("error", rank),
        )

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.segment)
