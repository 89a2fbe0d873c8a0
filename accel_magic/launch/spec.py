"""What a launch is, as one frozen description that every front door builds and `launch.run` runs: what each rank
runs, what every rank gets, the machines, where the results go, and the callbacks that watch it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .elastic import ONE_NODE, Nodes
from .rank import RankBody

__all__ = ["Launch", "Ranks", "Results", "Hooks"]


@dataclass(frozen=True)
class Ranks:
    """What every rank of the launch gets: its environment (set before anything in the rank reads it), its
    threads, the process group's backend and timeout (seconds a collective waits), and the times every rank is
    started again after one failed. `cpus` is this machine's CPU budget (a waiting rank spins only where the
    ranks' threads leave CPUs free); `versions` gives the line of versions a record of an internal failure
    carries. `group=False`: the body makes its own process group (torch's spawn), and each rank sees the
    kernel's environment with `env`, without what torch's agent sets for the group it would have made.
    `memory_limit`: the memory the kernel and its ranks may use (bytes, and where that comes from: "cgroup v2",
    "cgroup v1" or "machine"), for the words of a rank the out-of-memory killer ends. `preload`: modules the
    kernel imports before it forks the ranks once an earlier launch's ranks imported them, so that the ranks
    inherit them instead of each importing them anew."""

    num_processes: int
    backend: str = "gloo"
    threads: int = 1
    timeout: float = 900.0
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    cpus: int = 1
    max_restarts: int = 0
    versions: Callable[[], str] = str
    group: bool = True
    memory_limit: tuple[int, str] | None = None
    preload: tuple[str, ...] = ()


@dataclass(frozen=True)
class Results:
    """Where the first rank's results go: `receive(payload, folder)` in the kernel, whose answer becomes
    `outcome.received`; payloads over `max_bytes` are refused in the rank. No `receive`: nothing comes back."""

    receive: Callable[[bytes, str], Any] | None = None
    max_bytes: int = 0


def _ignore_text(rank: int, stream: str, text: str) -> None: ...


def _ignore_message(message: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Hooks:
    """What the kernel hears while the launch runs: each rank's text, the first rank's kernel messages, one line
    per restart; in the background, `stop` ends the launch and `watch(relay, places)` sees ranks start and end,
    and where each is (rank -> places.Place), after every poll. The agent checks on the ranks every
    `monitor_interval` seconds."""

    on_text: Callable[[int, str, str], None] = _ignore_text
    on_message: Callable[[dict[str, Any]], None] = _ignore_message
    on_restart: Callable[[str], None] = print
    stop: threading.Event | None = None
    watch: Callable[[Any, dict[int, Any]], None] | None = None
    monitor_interval: float = 0.05


@dataclass(frozen=True)
class Launch:
    """One launch: `body` in each rank (its tracebacks start at the frames of `filename`), on this node of
    `nodes`, meeting at `port` (None: a free one for each start; across machines, node 0's)."""

    body: RankBody
    ranks: Ranks
    filename: str = ""
    nodes: Nodes = ONE_NODE
    port: int | None = None
    results: Results = Results()
    hooks: Hooks = Hooks()

    @property
    def first_rank(self) -> int:
        """This node's first rank in the whole group."""
        return self.nodes.rank * self.ranks.num_processes
