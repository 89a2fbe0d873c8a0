"""Run a body as N forked ranks that form one process group, under torch's elastic agent, and return how it
ended. One launch, start to finish; each step lives in a module of its own (see CONTRIBUTING.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from . import elastic, guard
from .outcome import LaunchError, LaunchOutcome, RankFailure, collect, launch_error
from .rank import RankBody, RankProgram
from .relay import Pipes, Relay
from .workdir import Workdir

__all__ = ["launch", "LaunchError", "LaunchOutcome", "RankFailure", "RankBody", "launch_error"]


def launch(
    body: RankBody,
    nprocs: int,
    *,
    backend: str,
    threads: int,
    timeout: float,
    env: dict[str, str],
    cell_filename: str,
    on_text: Callable[[int, str, str], None],
    on_message: Callable[[dict[str, Any]], None],
    port: int | None = None,
    receive: Callable[[bytes, str], Any] | None = None,
    max_bytes: int = 0,
    monitor_interval: float = 0.05,
) -> LaunchOutcome:
    """Run `body` in `nprocs` forked ranks that form one process group. What rank 0's `body.results` returns
    (bytes) and the files it wrote in the folder it is given reach `receive(payload, folder)` in the kernel,
    whose answer is `outcome.received`. The agent checks on the ranks every `monitor_interval` seconds. The
    kernel is left as it was: no process, port, file or handler."""
    outcome = LaunchOutcome(nprocs)
    started = time.perf_counter()
    known = {p.pid for p in guard.descendants(set())}
    workdir: Workdir | None = None
    pipes: Pipes | None = None
    relay: Relay | None = None
    fd: int | None = None
    try:
        workdir = Workdir(max_bytes)
        pipes = Pipes.open(nprocs)
        sock = guard.listener(port)
        port = sock.getsockname()[1]
        fd = sock.detach() if elastic.loopback_rendezvous() else None
        if fd is None:
            sock.close()  # an older torch: its static store binds the port itself
        program = RankProgram(body, pipes, workdir, env, threads, backend, timeout, cell_filename, port)
        relay = Relay(pipes, on_text, on_message)
        with guard.kernel_state_kept():
            config = elastic.launch_config(nprocs, port, os.path.join(workdir.path, "logs"), monitor_interval, fd)

            def accel_train() -> None:  # torch's agent names its entrypoint after the function
                program()

            done = elastic.agent_thread().submit(partial(elastic.run_agent, config, accel_train, outcome))
            del config
            try:
                while not done.is_set():
                    relay.poll(0.05)
            except KeyboardInterrupt:
                outcome.interrupted = True
                guard.stop(guard.descendants(known))
                done.wait(10)
            relay.drain()
            outcome.ended = relay.ended
    finally:
        cleanup_started = time.perf_counter()
        if relay is not None:
            relay.close()
        if pipes is not None:
            pipes.close()
        if fd is not None:
            elastic.release_socket(fd)
        leftovers = guard.descendants(known)
        if leftovers:
            guard.stop(leftovers)
        if workdir is not None:
            try:
                collect(outcome, {r: workdir.records(r) for r in range(nprocs)})
                if outcome.ok and receive is not None:
                    _receive(outcome, workdir, receive)
            finally:
                workdir.remove()
        outcome.cleanup_time = time.perf_counter() - cleanup_started
        outcome.wall_time = time.perf_counter() - started
    return outcome


def _receive(outcome: LaunchOutcome, workdir: Workdir, receive: Callable[[bytes, str], Any]) -> None:
    """Hand rank 0's results to `receive` before the folder goes; a damaged transfer is reported, not raised."""
    payload = workdir.read_bytes("results", 0)
    if payload is None:
        return
    try:
        outcome.received = receive(payload, workdir.results)
    except Exception as err:
        outcome.receive_error = f"{type(err).__name__}: {err}"
