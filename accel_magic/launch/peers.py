"""What the nodes of a launch across machines tell each other, through node 0's rendezvous store: the first
failure (or interrupt) on any node, so every node stops its ranks at its next look at the store (every POLL
seconds), even ranks that are not in a collective. On one node there is nothing to tell.

Every call here is made once the rendezvous is done and while node 0 serves the store (node 0 waits for the
others to finish with it): a store call that fails makes torch log a long C++ warning into the cell.

The first rank's hello starts these calls while the agent may still be forking the next ranks. A rank forked in
the middle of a store call can inherit a lock that the call holds in torch's C++ code and wait on it for ever
(seen: node 0's second rank stuck in `init_process_group`, and every other rank waiting for it in gloo's
connect). So each store call holds `_STORE_CALL`, and every fork waits for it (`forks.FORK_WAITS_FOR`)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from .elastic import Nodes
from .forks import FORK_WAITS_FOR

__all__ = ["Peers", "reach_node0"]

POLL = 0.2  # seconds between two looks at the store
LINGER = 5.0  # seconds node 0 serves the store, at most, after its own launch ended

_STORE_CALL = threading.Lock()  # held by each store call here; every fork in the kernel waits for it
FORK_WAITS_FOR.append(_STORE_CALL)


def reach_node0(nodes: Nodes, port: int) -> bool:
    """On a node other than 0: wait, quietly and for at most the rendezvous timeout, until node 0 listens (torch's
    own client would log each failed try into the cell)."""
    deadline = time.monotonic() + nodes.wait
    while True:
        try:
            with socket.create_connection((nodes.host, port), timeout=min(2.0, nodes.timeout)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


class Peers:
    """This node's view of the others. `failure` says what another node reported (or that node 0's store went
    away while this node still trained); `tell` reports this node's own failure."""

    def __init__(self, nodes: Nodes, port: int, run_id: str) -> None:
        self.nodes, self.port = nodes, port
        self.key, self.done_key = f"accel_magic/{run_id}/failed", f"accel_magic/{run_id}/done"
        self.store: Any = None
        self.failure = ""
        self.told = False  # this node reported a failure
        self.acted = False  # this node stopped its ranks after another's report
        self._next = 0.0

    def join(self, served: Any = None) -> None:
        """Start listening to the others, once this node's ranks have started (the rendezvous is done). Node 0
        passes the store it serves; the others connect to it."""
        if self.store is not None:
            return
        if served is not None:
            self.store = served
            return
        from torch.distributed import TCPStore

        try:  # not counted among the rendezvous' workers
            with _STORE_CALL:
                self.store = TCPStore(
                    self.nodes.host, self.port, None, False, timedelta(seconds=5), wait_for_workers=False
                )
        except Exception:
            self.failure = "node 0's rendezvous store did not answer"

    def poll(self) -> None:
        """Read what the others reported, every POLL seconds at most."""
        if self.store is None or self.failure or self.told or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + POLL
        try:
            with _STORE_CALL:
                if self.store.check([self.key]):
                    self.failure = self.store.get(self.key).decode(errors="replace")
        except Exception:  # node 0's store went away while this node still trains: node 0's launch ended
            self.failure = "node 0's launch ended"
            self.store = None

    def tell(self, what: str) -> None:
        """Report this node's failure to the others (the first report of the launch stays)."""
        self.told = True
        if self.store is not None:
            with contextlib.suppress(Exception), _STORE_CALL:
                self.store.compare_set(self.key, "", what)

    def close(self) -> None:
        """Done with the store: the others say so; node 0 serves it until they have (LINGER seconds at most)."""
        store, self.store = self.store, None
        if store is None:
            return
        with contextlib.suppress(Exception):
            if self.nodes.rank != 0:
                with _STORE_CALL:
                    store.add(self.done_key, 1)
                return
            deadline = time.monotonic() + LINGER
            while time.monotonic() < deadline:
                with _STORE_CALL:
                    if store.add(self.done_key, 0) >= self.nodes.count - 1:
                        return
                time.sleep(POLL / 4)
