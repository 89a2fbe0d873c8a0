"""A memory cgroup made under the test process's own (cgroup v1 or v2, whichever holds the memory controller), for
processes the test starts in it; removed afterwards. Where the machine allows none, the test is skipped with the
reason."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class MemoryCgroup:
    folder: Path
    version: str  # "cgroup v1" or "cgroup v2", as the probe names it

    def enter(self) -> None:
        """Move the calling process into the cgroup (a preexec_fn for subprocess)."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))


def _own() -> tuple[str, Path]:
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "cgroup v1", ROOT / "memory" / path.lstrip("/")
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers and (ROOT / "cgroup.controllers").exists():
            return "cgroup v2", ROOT / path.lstrip("/")
    raise OSError("no cgroup tree with the memory controller is mounted at /sys/fs/cgroup")


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[MemoryCgroup]:
    """A cgroup limited to `limit` bytes, under this process's own; its processes must have ended when the block
    ends."""
    try:
        version, own = _own()
        folder = own / f"accel-magic-test-{os.getpid()}-{time.monotonic_ns()}"
        folder.mkdir()
    except OSError as err:
        pytest.skip(f"this machine lets the test make no memory cgroup: {err}")
    try:
        try:
            (folder / ("memory.limit_in_bytes" if version == "cgroup v1" else "memory.max")).write_text(str(limit))
        except OSError as err:
            pytest.skip(f"this machine lets the test set no memory limit on its cgroup: {err}")
        yield MemoryCgroup(folder, version)
    finally:
        for _ in range(50):  # a process that just ended may still be counted for a moment
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)
