"""Run a compiled cell under a plan: in the kernel like a normal cell, or as forked ranks whose rank 0 results
are applied to the notebook afterwards."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from .cell import CellCode
from .plan import Plan

if TYPE_CHECKING:
    from .launch import LaunchOutcome, Nodes, RankBody

__all__ = ["OneSentence", "TrainError", "CellBody", "run_in_kernel", "plan_nodes", "launch_plan", "run_ranks"]


class OneSentence(Exception):
    """An error whose message is one sentence saying what to do; IPython shows that sentence alone."""

    def _render_traceback_(self) -> list[str]:
        from .launch.outcome import error_line

        return [error_line(type(self).__name__, str(self))]


class TrainError(OneSentence, RuntimeError):
    """The launch cannot start here."""


class CellBody:
    """What each rank runs: a fresh accelerator (setup), the cell in the rank's copy of the namespace (run),
    and on rank 0 the results written into the launch's private folder (results: the manifest)."""

    def __init__(self, cell: CellCode, ns: dict[str, Any], *, make_accelerator: Callable[[], Any], name: str,
                 returns: tuple[str, ...] | None, notebook: Mapping[int, tuple[str, Any]], max_bytes: int):  # fmt: skip
        self.cell, self.ns, self.make_accelerator, self.name = cell, ns, make_accelerator, name
        self.returns, self.notebook, self.max_bytes = returns, notebook, max_bytes
        self.prepared: dict[int, Any] = {}
        self.registered: list[Any] = []

    def setup(self, rank: int) -> None:
        from .results import track_prepare

        track_prepare(self.prepared, self.registered)
        self.ns[self.name] = self.make_accelerator()

    def run(self) -> None:
        exec(self.cell.code, self.ns)

    def results(self, rank: int, folder: str) -> bytes | None:
        from .results import pack_payload

        if rank != 0 or self.returns is None:  # --no-return
            return None
        return pack_payload(
            self.ns, self.returns, self.prepared, self.notebook, folder, self.max_bytes, registered=self.registered
        )


def run_in_kernel(shell: Any, cell: str, result_name: str) -> None:
    """Run the cell in the kernel like a normal cell (its errors show as a normal cell's do); how it ended goes
    to `result_name` whatever the end."""
    from .launch import LaunchOutcome, RankFailure

    start = time.perf_counter()
    result = shell.run_cell(cell, store_history=False)
    outcome = LaunchOutcome(1, wall_time=time.perf_counter() - start, exitcodes={0: 0 if result.success else 1})
    err = result.error_in_exec or result.error_before_exec
    if isinstance(err, KeyboardInterrupt):
        outcome.interrupted = True
    elif err is not None:
        first = str(err).splitlines()[0] if str(err) else ""
        summary = f"{type(err).__name__}: {first}" if first else type(err).__name__
        outcome.failures.append(RankFailure(0, 1, "exception", summary, when=time.time()))
    del err, result  # the exception is IPython's to keep (sys.last_value), not the outcome's
    shell.user_ns[result_name] = outcome


def plan_nodes(plan: Plan, run_id: str = "", rdzv_timeout: float | None = None) -> Nodes:
    """The plan's machines as the launch sees them; the nodes wait for each other as long as a collective."""
    from .launch import Nodes
    from .plan import parse_endpoint

    if plan.num_nodes == 1:
        return Nodes()
    host, _ = parse_endpoint(plan.rdzv_endpoint)
    return Nodes(plan.num_nodes, plan.node_rank, host, run_id, rdzv_timeout or plan.timeout)


def launch_plan(body: RankBody, plan: Plan, *, cell_filename: str, port: int | None, max_bytes: int,
                receive: Callable[[bytes, str], Any] | None, monitor_interval: float = 0.05,
                port_option: str = "--port", endpoint_option: str = "--rdzv-endpoint",
                nodes: Nodes | None = None, source: str = "") -> LaunchOutcome:  # fmt: skip
    """Launch `body` as the plan's ranks, with the launch banner first. Raises TrainError before anything
    starts, LaunchError when the launch failed, LaunchInterrupted (a KeyboardInterrupt) when it was interrupted;
    both carry the outcome. `source` is the file of a launched function that is not a notebook cell, which the
    interrupt's message names instead of the cell."""
    from .accelerator import rank_environment
    from .display import launch_banner, write_rank_text
    from .launch import LaunchError, launch, launch_error, launch_interrupted
    from .launch.guard import check_port, cuda_fork_blocker
    from .launch.relay import publish_kernel_message
    from .plan import parse_endpoint

    nodes = nodes or plan_nodes(plan)
    if plan.num_nodes > 1:
        port = parse_endpoint(plan.rdzv_endpoint)[1]
        if plan.node_rank == 0 and not check_port(port, nodes.host):
            raise TrainError(
                f"Node 0 cannot listen on {plan.rdzv_endpoint} (not an address of this machine, or the port is in "
                f"use): give node 0's own address and a free port in {endpoint_option}, the same on every node."
            )
    elif port is not None and not check_port(port):
        raise TrainError(f"Port {port} is in use: choose another with {port_option}, or leave {port_option} out.")
    blocker = cuda_fork_blocker() if plan.device == "cuda" else None
    if blocker:
        raise TrainError(
            f"{blocker}, so GPU ranks cannot be forked: restart the kernel, run %accel_setup first and keep "
            "CUDA work inside %%accel_train cells."
        )
    print(launch_banner(plan))
    outcome = launch(
        body,
        plan.num_processes,
        backend=plan.backend or "gloo",
        threads=plan.threads_per_process,
        timeout=plan.timeout,
        env=rank_environment(plan),
        cell_filename=cell_filename,
        on_text=write_rank_text,
        on_message=publish_kernel_message,
        port=port,
        receive=receive,
        max_bytes=max_bytes,
        monitor_interval=monitor_interval,
        nodes=nodes,
    )
    if outcome.interrupted:
        raise launch_interrupted(outcome, source)
    if not outcome.ok:
        raise launch_error(outcome, plan.timeout)
    if outcome.receive_error:
        raise LaunchError(
            f"rank 0's results could not be read back ({outcome.receive_error}); nothing in the notebook changed.",
            outcome=outcome,
        )
    return outcome


def run_ranks(shell: Any, code: CellCode, plan: Plan, *, name: str, result_name: str, returns: tuple[str, ...] | None,
              port: int | None, max_bytes: int) -> None:  # fmt: skip
    """Run the cell as the plan's ranks and apply rank 0's results to the notebook at once (nothing changes
    when the launch fails)."""
    from .accelerator import rank_accelerator
    from .launch import LaunchError, LaunchInterrupted
    from .results import receive_payload, unpack_results

    ns = shell.user_ns
    notebook = {id(v): (k, v) for k, v in ns.items() if not k.startswith("_")}
    body = CellBody(
        code,
        ns,
        make_accelerator=partial(rank_accelerator, plan),
        name=name,
        returns=returns,
        notebook=notebook,
        max_bytes=max_bytes,
    )
    try:
        outcome = launch_plan(
            body, plan, cell_filename=code.filename, port=port, max_bytes=max_bytes, receive=receive_payload
        )
    except (LaunchError, LaunchInterrupted) as err:  # a launch that ran and ended badly is an outcome too
        if err.outcome is not None:
            ns[result_name] = err.outcome
        raise
    finally:
        del body, notebook
    apply, skipped = unpack_results(outcome.received, ns) if outcome.received is not None else (None, [])
    outcome.skipped = tuple(skipped)
    if apply is not None:
        started = time.perf_counter()
        apply()
        outcome.results_seconds = {**outcome.received.seconds, "apply": time.perf_counter() - started}
    ns[result_name] = outcome
    if skipped:
        listed = "; ".join(f"{item} ({reason})" for item, reason in skipped)
        print(f"Not brought back to the notebook: {listed}.")
