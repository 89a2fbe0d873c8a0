"""Run a body as N forked ranks that form one process group, under torch's elastic agent, and return how it
ended. One launch, start to finish; each step lives in a module of its own (see CONTRIBUTING.md)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from threading import Event
from typing import Any

from . import elastic, memory, processes
from .elastic import Nodes
from .interrupts import Interrupts
from .kernel import kernel_state_kept
from .outcome import (
    LaunchOutcome,
    NodeOptions,
    RankFailure,
    Words,
    collect,
    failure_words,
    interrupted_words,
)
from .peers import Peers, reach_node0
from .places import Place, Places, stuck
from .ports import listener
from .rank import RankBody, RankProgram
from .relay import Pipes, Relay
from .spec import Hooks, Launch, Ranks, Results
from .workdir import Workdir

JUDGE_EVERY = 0.25  # seconds between two looks at the ranks' places (whether they can still meet)
_imported: set[str] = set()  # modules of a launch's preload that its ranks imported: the kernel imports them next

__all__ = [
    "run",
    "Launch",
    "Ranks",
    "Results",
    "Hooks",
    "Nodes",
    "LaunchOutcome",
    "NodeOptions",
    "RankFailure",
    "RankBody",
    "Words",
    "failure_words",
    "interrupted_words",
]


def run(spec: Launch) -> LaunchOutcome:
    """Run the launch and return how it ended. After a rank failed, every rank starts again, as torch elastic
    does, up to `spec.ranks.max_restarts` times (TORCHELASTIC_RESTART_COUNT in their environment), each on a fresh
    port unless the launch names one; `hooks.on_restart` gets one line for each. The outcome is the last start's."""
    ranks = spec.ranks
    restarts = 0
    while True:
        outcome = _start(spec, {**ranks.env, "TORCHELASTIC_RESTART_COUNT": str(restarts)})
        outcome.restarts = restarts
        if restarts >= ranks.max_restarts or outcome.ok or outcome.interrupted or outcome.stuck or not outcome.failures:
            return outcome
        restarts += 1
        which = f"the {ranks.num_processes} ranks" if ranks.num_processes > 1 else "the rank"
        spec.hooks.on_restart(
            f"Restarting {which} ({restarts} of {ranks.max_restarts}): {failure_words(outcome, ranks.timeout).headline}"
        )


def _start(spec: Launch, env: dict[str, str]) -> LaunchOutcome:
    """Run `spec.body` in this node's ranks, forked, that form one process group (with the ranks of the other
    nodes, whose launches meet at node 0's port), each with `env`. What this node's first rank's `body.results`
    returns (bytes) and the files it wrote in the folder it is given reach `spec.results.receive(payload,
    folder)` in the kernel, whose answer is `outcome.received`. The kernel is left as it was: no process, port,
    file or handler.

    In the kernel's main thread, an interrupt stops the ranks (a second one stops them at once) whenever it comes:
    the kernel's interrupts are held from here to the end, so none cuts a step short, and any of them marks the
    outcome interrupted. In another thread (a background launch), setting `hooks.stop` does, and
    `hooks.watch(relay)` sees which ranks have started and ended after every poll; the ranks then leave the
    kernel's process group, so the kernel's interrupts reach only the kernel."""
    nprocs, nodes, port, hooks = spec.ranks.num_processes, spec.nodes, spec.port, spec.hooks
    first = spec.first_rank
    outcome = LaunchOutcome(nprocs, first, nodes.count, nodes.endpoint(port or 0) if nodes.count > 1 else "")
    outcome.memory_limit = spec.ranks.memory_limit
    if nodes.count > 1:
        outcome.rdzv_timeout = nodes.wait
    started = time.perf_counter()
    if nodes.rank > 0 and not reach_node0(nodes, port or 0):
        outcome.agent_error = f"node 0 did not answer within {nodes.wait} s"
        outcome.wall_time = time.perf_counter() - started
        return outcome
    known = {p.pid for p in processes.descendants(set())}
    workdir: Workdir | None = None
    pipes: Pipes | None = None
    relay: Relay | None = None
    peers: Peers | None = None
    fd: int | None = None
    places: Places | None = None
    background = threading.current_thread() is not threading.main_thread()

    def ours() -> list[Any]:
        """The launch's processes: every new child of the kernel while the launch holds the kernel; in the
        background, once every rank has said hello, those ranks and their children alone (the notebook's other
        cells start processes of their own meanwhile)."""
        if background and relay is not None and len(relay.started) == nprocs:
            return processes.family(list(relay.started.values()))
        return processes.descendants(known)

    interrupts = Interrupts.hold(hooks.stop)
    kills = memory.oom_kills()
    try:
        workdir = Workdir(spec.results.max_bytes)
        pipes = Pipes.open(nprocs)
        places = Places(nprocs)
        if nodes.rank == 0:  # this node hosts the rendezvous
            sock = listener(port, nodes.host)
            port = sock.getsockname()[1]
            fd = sock.detach() if elastic.bound_rendezvous() else None
            if fd is None:
                sock.close()  # an older torch: its static store binds the port itself
        assert port is not None, "a node other than 0 connects to node 0's port"
        program = RankProgram(spec, env, pipes, workdir, port, places, detach=background)
        relay = Relay(pipes, hooks.on_text, hooks.on_message, first)
        with kernel_state_kept(all_env=not background):
            if not background:  # an interrupt meanwhile is held, and stops the launch before it forks
                _preload([n for n in spec.ranks.preload if n in _imported])  # the environment is put back after
            logs = os.path.join(workdir.path, "logs")
            config = elastic.launch_config(nprocs, port, logs, hooks.monitor_interval, fd, nodes)

            def accel_train() -> None:  # torch's agent names its entrypoint after the function
                program()

            done = Event()
            if interrupts.stop.is_set():  # stopped before the agent forked any rank
                done.set()
            else:
                done = elastic.agent_thread().submit(partial(elastic.run_agent, config, accel_train, outcome))
                peers = Peers(nodes, port, config.run_id) if nodes.count > 1 else None
            del config
            judged = 0.0
            while not done.is_set() and not interrupts.stop.is_set():
                relay.poll(0.05)
                if time.monotonic() >= judged:
                    judged = time.monotonic() + JUDGE_EVERY
                    outcome.places = _places(places, relay, first)
                    memory.look(outcome.peaks, {r: p for r, p in relay.started.items() if r not in relay.ended})
                    if nodes.count == 1 and not any(code for code, _ in relay.ended.values()):
                        outcome.stuck = stuck(outcome.places, set(relay.started), time.monotonic())
                        if outcome.stuck:
                            _stop(done, ours, interrupts.again)
                            break
                if hooks.watch is not None:
                    hooks.watch(relay, outcome.places)
                if peers is not None:
                    _exchange(peers, relay, workdir, ours, elastic.served_store(fd))
            if interrupts.stop.is_set() and (interrupts.count or not done.is_set()):
                outcome.interrupted = True
                if peers is not None:
                    peers.tell(f"node {nodes.rank} was interrupted")
                _interrupt(relay, done, ours, nprocs, interrupts.again)
                _stop(done, ours, interrupts.again)
            relay.drain()
            if peers is not None and not outcome.interrupted:  # a failure seen only as the agent ended: tell it
                _exchange(peers, relay, workdir, ours, elastic.served_store(fd))
            outcome.places = _places(places, relay, first)
            outcome.ended = relay.ended
            outcome.pids = dict(relay.started)
    finally:
        try:
            cleanup_started = time.perf_counter()
            if peers is not None:
                peers.close()
                outcome.remote_failure = peers.failure
            if relay is not None:
                relay.close()
            if pipes is not None:
                pipes.close()
            if places is not None:
                places.close()
            if fd is not None:
                elastic.release_socket(fd)
            leftovers = ours()
            if leftovers:
                processes.stop(leftovers, hurry=interrupts.again)
            if interrupts.count:  # also one that came while the ranks ended on their own: nothing comes back
                outcome.interrupted = True
            outcome.oom_killed = kills is not None and (memory.oom_kills() or 0) > kills
            if workdir is not None:
                try:
                    collect(outcome, {r: workdir.records(r) for r in outcome.ranks})
                    _imported.update((workdir.read("status", first) or {}).get("imported", ()))
                    if outcome.ok and spec.results.receive is not None:
                        _receive(outcome, workdir, spec.results.receive)
                finally:
                    workdir.remove()
            outcome.cleanup_time = time.perf_counter() - cleanup_started
            outcome.wall_time = time.perf_counter() - started
        finally:
            interrupts.release()  # the kernel's own handler again
    return outcome


def _preload(names: list[str]) -> None:
    """Import `names` here, once, so that the ranks of every later launch inherit them: the modules of the
    preload that an earlier launch's ranks imported (a kernel whose cells never needed them pays nothing), in
    the kernel's main thread (never beside the notebook's own cells). A module that cannot be imported is left
    to the rank that needs it, which reports what went wrong in its own words."""
    for name in names:
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _places(places: Places, relay: Relay, first: int) -> dict[int, Place]:
    """Each rank's place as it last wrote it; a rank whose process ended well (os._exit(0)) finished the cell."""
    seen = places.all(first)
    seen.update((rank, Place("done")) for rank, (code, _) in relay.ended.items() if code == 0)
    return seen


def _interrupt(
    relay: Relay, done: Event, ours: Callable[[], list[Any]], nprocs: int, again: Event, grace: float = 1.0
) -> None:
    """Interrupt the ranks (the front end may not have) and give them `grace` seconds to end on their own, each
    with a record of where its cell was; what is left is stopped after, at once after a second interrupt."""
    processes.interrupt(ours())
    deadline = time.monotonic() + grace
    while not done.is_set() and len(relay.ended) < nprocs and time.monotonic() < deadline and not again.is_set():
        relay.poll(0.05)


def _stop(done: Event, ours: Callable[[], list[Any]], again: Event, wait: float = 10.0) -> None:
    """Stop the launch's processes until its agent has ended (it may still fork a rank it was starting), for at
    most `wait` seconds; the cleanup stops what is left after that."""
    deadline = time.monotonic() + wait
    while True:
        processes.stop(ours(), hurry=again)
        if done.wait(0.1) or time.monotonic() >= deadline:
            return


def _exchange(peers: Peers, relay: Relay, workdir: Workdir, ours: Callable[[], list[Any]], served: Any) -> None:
    """Across machines: once the ranks have started, stop them when another node failed; else report this
    node's first failure that is its own (not an error that a lost peer caused) to the others."""
    if not relay.greeted:
        return
    peers.join(served)
    peers.poll()
    if peers.failure:
        if not peers.acted:
            peers.acted = True
            processes.terminate(ours())
        return
    if peers.told:
        return
    # the ranks seen to end first, by when; then any other that recorded its failure (its end may not have been
    # seen: the agent reaps a rank, and may end the launch, before this thread looks)
    ended = [rank for rank, _ in sorted(relay.ended.items(), key=lambda item: item[1][1])]
    for rank in ended + sorted(set(relay.started) - set(ended)):
        code = relay.ended[rank][0] if rank in relay.ended else None  # None: not seen to end
        error = workdir.read("error", rank) if code != 0 else None
        if error is not None and error.kind != "collateral":
            peers.tell(f"rank {rank}: {error.summary}")
            return
        if error is None and code:
            peers.tell(f"rank {rank} ended with exit code {code}")
            return


def _receive(outcome: LaunchOutcome, workdir: Workdir, receive: Callable[[bytes, str], Any]) -> None:
    """Hand rank 0's results to `receive` before the folder goes; a damaged transfer is reported, not raised."""
    payload = workdir.read_bytes("results", outcome.first_rank)
    if payload is None:
        return
    try:
        outcome.received = receive(payload, workdir.results)
    except Exception as err:
        outcome.receive_error = f"{type(err).__name__}: {err}"
