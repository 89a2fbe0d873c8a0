"""Everything that touches torch's elastic agent: the rendezvous store on a socket bound to one address
(loopback for one node; node 0's own for several), the `LaunchConfig`, and the one long-lived thread that runs
each launch's agent.

Private APIs of torch, used here only:
- `torch.distributed.elastic.rendezvous.rendezvous_handler_registry._registry` (a dict, torch 2.0 and later):
  our bound rendezvous is put there by name, which survives `%reload_ext` (`register()` refuses a name
  twice). Fallback: none needed while the dict exists; `bound_rendezvous()` says False when the store
  cannot take a socket.
- `static_tcp_rendezvous.create_rdzv_handler` and the handler's `_store`, `master_addr`, `master_port`,
  `world_size`, `timeout` (torch 2.0 and later): the static handler, with its store replaced by one serving
  on our socket (`TCPStore(master_listen_fd=)`, torch 2.4 and later). Fallback: on a torch whose TCPStore
  takes no socket, the static rendezvous binds the port itself (it then also listens on `::`).
- `LaunchConfig.numa_options` and `torch.numa.binding` (torch 2.9 and later): given explicitly so that
  `LaunchConfig` does not ask CUDA in the kernel, then cleared. Fallback: absent fields are not passed.
- The text of the store's timeout on node 0 ("... 1/2 clients joined."): read for how many nodes joined.
  Fallback: where it says no count, the error is shown as torch wrote it.
"""

from __future__ import annotations

import math
import os
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .outcome import LaunchOutcome

__all__ = ["BOUND_BACKEND", "Nodes", "bound_rendezvous", "release_socket", "served_store", "launch_config", "run_agent",
           "AgentThread", "agent_thread", "shutdown_agent_thread"]  # fmt: skip

BOUND_BACKEND = "accel_magic_bound"
_JOINED = re.compile(r"(\d+)/(\d+) clients joined")  # node 0's store, when not every node joined in time
_stores: dict[int, Any] = {}  # listening fd -> the TCP store that took it over (and closes it), kept to the end


@dataclass(frozen=True)
class Nodes:
    """The machines whose ranks form one group, and this one's place: node 0 hosts the rendezvous store on
    `host` (this machine's own address), the others connect to it. Ranks are numbered by node rank."""

    count: int = 1
    rank: int = 0
    host: str = "127.0.0.1"
    run_id: str = ""  # the same on every node; chosen from the endpoint when empty
    timeout: float = 60.0  # seconds the nodes wait for each other at the rendezvous

    @property
    def wait(self) -> int:
        """The rendezvous timeout in whole seconds (torch's store counts whole seconds), never below `timeout`."""
        return max(1, math.ceil(self.timeout))

    def endpoint(self, port: int) -> str:
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"


ONE_NODE = Nodes()


def _create_bound_handler(params: Any) -> Any:
    """torch's static rendezvous, with its TCP store serving on a socket already bound to one address (left to
    itself it listens on every interface). It waits up to the rendezvous timeout for every node to connect."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    fd = int(params.config.pop("listen_fd"))
    handler = create_rdzv_handler(params)
    _stores[fd] = None  # the store owns the socket from here on, and closes it even when it fails to start
    handler._store = TCPStore(
        handler.master_addr,
        handler.master_port,
        handler.world_size,
        True,
        timedelta(seconds=handler.timeout.total_seconds()),
        master_listen_fd=fd,
    )
    _stores[fd] = handler._store  # node 0 serves its peers until the launch ends, after its agent
    handler.get_backend = lambda: BOUND_BACKEND  # the registry checks the name it was asked for
    return handler


def bound_rendezvous() -> bool:
    """Whether torch's TCP store takes a pre-bound listening socket (feature-detected); registers the backend."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    if "master_listen_fd" not in (TCPStore.__init__.__doc__ or ""):
        return False
    registry._registry[BOUND_BACKEND] = _create_bound_handler  # reload-safe, unlike register()
    return True


def release_socket(fd: int) -> None:
    """Close the launch's listening socket: its store, when one took it over; else the socket itself."""
    if fd in _stores:
        del _stores[fd]
    else:
        os.close(fd)


def served_store(fd: int | None) -> Any:
    """The TCP store serving on the launch's socket, once the rendezvous has made it (else None)."""
    return _stores.get(fd) if fd is not None else None


def launch_config(
    nprocs: int, port: int, log_dir: str, monitor: float, listen_fd: int | None, nodes: Nodes = ONE_NODE
) -> Any:
    """`nprocs` forked ranks on this node, no restarts, logs in the launch's folder; the rendezvous on
    `nodes.host` (127.0.0.1 for one node), served from `listen_fd` on node 0."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    names = {f.name for f in fields(LaunchConfig)}
    rdzv_configs: dict[str, Any] = {"rank": nodes.rank, "timeout": nodes.wait}
    if listen_fd is not None:
        rdzv_configs["listen_fd"] = listen_fd
    run_id = nodes.run_id or (f"accel_magic_{os.getpid()}_{port}" if nodes.count == 1 else f"accel_magic_{port}")
    kwargs: dict[str, Any] = dict(
        min_nodes=nodes.count,
        max_nodes=nodes.count,
        nproc_per_node=nprocs,
        run_id=run_id,
        rdzv_endpoint=nodes.endpoint(port),
        rdzv_backend=BOUND_BACKEND if listen_fd is not None else "static",
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


def run_agent(config: Any, entry: Callable[[], None], outcome: LaunchOutcome) -> None:
    """The elastic agent, in a thread of its own: it then installs no signal handlers in the kernel, and the
    kernel's main thread stays free to relay output and take interrupts."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    ranks = outcome.ranks
    try:
        elastic_launch(config, entry)()
        outcome.exitcodes = dict.fromkeys(ranks, 0)
    except ChildFailedError as err:  # its failures are keyed by global rank
        codes: dict[int, int | None] = dict.fromkeys(ranks, 0)
        for rank, failure in err.failures.items():
            codes[rank] = failure.exitcode
        outcome.exitcodes = codes
    except BaseException as err:  # anything else is reported as text: no exception object survives the launch
        outcome.agent_error = f"{type(err).__name__}: {err}"
        joined = _JOINED.search(str(err)) if outcome.num_nodes > 1 else None
        if joined:
            outcome.nodes_joined = int(joined[1])


class AgentThread:
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


_agent: AgentThread | None = None


def agent_thread() -> AgentThread:
    global _agent
    if _agent is None or not _agent.thread.is_alive():
        _agent = AgentThread()
    return _agent


def shutdown_agent_thread() -> None:
    global _agent
    if _agent is not None:
        _agent.stop()
        _agent = None
