"""Run a compiled cell under a plan: in the kernel like a normal cell, or as forked ranks whose rank 0 results
are applied to the notebook afterwards (at once; or, for a background launch, by jobs.py at the next cell)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from .cell import CellCode
from .plan import Plan

if TYPE_CHECKING:
    from .launch import LaunchInterrupted, LaunchOutcome, NodeOptions, Nodes, RankBody

__all__ = ["OneSentence", "TrainError", "CellBody", "run_in_kernel", "plan_nodes", "check_launch", "launch_ranks",
           "launch_failure", "stopped_before_start", "launch_plan", "bring_back", "results_interrupted",
           "run_ranks"]  # fmt: skip

_MISSING = object()


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


def check_launch(plan: Plan, port: int | None, nodes: Nodes, *, port_option: str = "--port",
                 endpoint_option: str = "--rdzv-endpoint") -> None:  # fmt: skip
    """Raise TrainError (one sentence) when the plan's ranks cannot start here now."""
    from .launch.guard import check_port, cuda_fork_blocker
    from .plan import parse_endpoint

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


def launch_ranks(body: RankBody, plan: Plan, nodes: Nodes, *, cell_filename: str, port: int | None, max_bytes: int,
                 receive: Callable[[bytes, str], Any] | None, on_text: Callable[[int, str, str], None],
                 on_message: Callable[[dict[str, Any]], None], on_restart: Callable[[str], None] = print,
                 **options: Any) -> LaunchOutcome:  # fmt: skip
    """The plan's ranks on this node, launched; how it ended (`options`: launch()'s monitor_interval, stop,
    watch). After a rank failed, every rank starts again, as torch elastic does, up to `plan.max_restarts` times,
    each on a fresh port unless `port` names one; `on_restart` gets one line for each restart. The outcome is the
    last run's."""
    from .accelerator import rank_environment
    from .launch import launch, launch_error
    from .plan import parse_endpoint

    if plan.num_nodes > 1:
        port = parse_endpoint(plan.rdzv_endpoint)[1]
    env = rank_environment(plan)
    restarts = 0
    while True:
        outcome = launch(
            body,
            plan.num_processes,
            backend=plan.backend or "gloo",
            threads=plan.threads_per_process,
            timeout=plan.timeout,
            env={**env, "TORCHELASTIC_RESTART_COUNT": str(restarts)},
            cell_filename=cell_filename,
            on_text=on_text,
            on_message=on_message,
            port=port,
            receive=receive,
            max_bytes=max_bytes,
            nodes=nodes,
            **options,
        )
        outcome.restarts = restarts
        if restarts >= plan.max_restarts or outcome.ok or outcome.interrupted or not outcome.failures:
            return outcome
        restarts += 1
        ranks = f"the {plan.num_processes} ranks" if plan.num_processes > 1 else "the rank"
        on_restart(f"Restarting {ranks} ({restarts} of {plan.max_restarts}): {launch_error(outcome, plan.timeout)}")


def launch_failure(outcome: LaunchOutcome, plan: Plan, source: str = "",
                   node_options: NodeOptions | None = None) -> Exception | KeyboardInterrupt | None:  # fmt: skip
    """The one exception that says how a launch went wrong (LaunchInterrupted is a KeyboardInterrupt), or None.
    `node_options` names the settings of a launch across machines as the user gave them (None: %%accel_train's)."""
    from .launch import LaunchError, NodeOptions, launch_error, launch_interrupted

    if outcome.interrupted:
        return launch_interrupted(outcome, source)
    if not outcome.ok:
        return launch_error(outcome, plan.timeout, node_options or NodeOptions())
    if outcome.receive_error:
        return LaunchError(
            f"rank 0's results could not be read back ({outcome.receive_error}); nothing in the notebook changed.",
            outcome=outcome,
        )
    return None


def stopped_before_start(num_processes: int, first_rank: int = 0) -> LaunchOutcome:
    """The outcome of a launch interrupted before any of its ranks started."""
    from .launch import LaunchOutcome

    return LaunchOutcome(num_processes, first_rank, interrupted=True)


def launch_plan(body: RankBody, plan: Plan, *, cell_filename: str, port: int | None, max_bytes: int,
                receive: Callable[[bytes, str], Any] | None, monitor_interval: float = 0.05,
                port_option: str = "--port", endpoint_option: str = "--rdzv-endpoint",
                nodes: Nodes | None = None, source: str = "",
                node_options: NodeOptions | None = None) -> LaunchOutcome:  # fmt: skip
    """Launch `body` as the plan's ranks, with the launch banner first. Raises TrainError before anything
    starts, LaunchError when the launch failed, LaunchInterrupted (a KeyboardInterrupt) when it was interrupted;
    both carry the outcome. `source` is the file of a launched function that is not a notebook cell, which the
    interrupt's message names instead of the cell."""
    from .display import launch_banner, write_rank_text
    from .launch.relay import publish_kernel_message

    nodes = nodes or plan_nodes(plan)
    try:
        check_launch(plan, port, nodes, port_option=port_option, endpoint_option=endpoint_option)
        print(launch_banner(plan))
        outcome = launch_ranks(
            body,
            plan,
            nodes,
            cell_filename=cell_filename,
            port=port,
            max_bytes=max_bytes,
            receive=receive,
            on_text=write_rank_text,
            on_message=publish_kernel_message,
            monitor_interval=monitor_interval,
        )
    except KeyboardInterrupt:  # before the launch held the kernel's interrupts (it returns those it held)
        outcome = stopped_before_start(plan.num_processes, nodes.rank * plan.num_processes)
    failure = launch_failure(outcome, plan, source, node_options)
    if failure is not None:
        raise failure
    return outcome


def bring_back(outcome: LaunchOutcome, ns: dict[str, Any], before: Mapping[str, Any] | None = None,
               held_in: str = "") -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """Apply rank 0's results to the notebook, each name in full; returns the names applied, and the values held
    back. What could not come is in `outcome.skipped`. With `before` (the namespace when a background launch
    started), a name the notebook rebound since then keeps its new value: the launch's is held back, by name, and
    listed as not applied, found in `held_in` (such as "accel_result.results"). The kernel's interrupts are held
    meanwhile: after one, the names not yet applied are left as they were, listed as not applied, and the outcome
    is marked interrupted."""
    from .launch.guard import Interrupts
    from .results import Received, unpack_results

    received = outcome.received
    if received is None:
        return [], {}
    held: dict[str, Any] = {}
    items = []
    for item in received.items:
        names = {item.name} if item.action != "state" else set()
        if item.action in ("load_state", "state", "keep") and item.home:
            names.add(item.home)
        same_module = item.action == "import" and getattr(ns.get(item.name), "__name__", None) == item.home
        if (
            before is not None
            and not same_module
            and any(ns.get(n, _MISSING) is not before.get(n, _MISSING) for n in names)
        ):
            held[item.name] = before.get(item.home) if item.action == "keep" else item.value
        else:
            items.append(item)
    apply, skipped = unpack_results(Received(tuple(items), received.skipped, received.seconds), ns)
    rebound = [(n, f"rebound in the notebook since the launch started; the launch's is {held_in}[{n!r}]") for n in held]
    started = time.perf_counter()
    interrupts = Interrupts.hold()  # within the caller's hold, if it has one: the same interrupts
    try:
        done = set(apply(interrupts.stop.is_set))
    finally:
        interrupts.release()
    if interrupts.count:
        outcome.interrupted = True
    outcome.results_seconds = {**received.seconds, "apply": time.perf_counter() - started}
    failed = {name for name, _ in skipped}
    cut = [(i.name, NOT_APPLIED) for i in items if i.name not in failed and i.name not in done]
    outcome.skipped = tuple(skipped) + tuple(rebound) + tuple(cut)
    return [i.name for i in items if i.name in done and i.action not in ("state", "import")], held


NOT_APPLIED = "the interrupt came before it was applied; it was left as it was"


def results_interrupted(outcome: LaunchOutcome) -> LaunchInterrupted:
    """The one line for an interrupt that came while rank 0's results were applied: which names were, which
    were left as they were."""
    from .launch import LaunchInterrupted

    n = outcome.num_processes
    left = [name for name, why in outcome.skipped if why == NOT_APPLIED]
    received = outcome.received.items if outcome.received is not None else ()
    failed = {name for name, _ in outcome.skipped}
    applied = [item.name for item in received if item.name not in failed]
    ranks = f"the {n} ranks" if n > 1 else "the rank"
    said = f"applied {', '.join(applied)}" if applied else "nothing applied"
    if left:
        said += f"; left as they were: {', '.join(left)}"
    return LaunchInterrupted(
        f"{ranks} had ended, and the interrupt came while their results were applied ({said})", outcome
    )


def run_ranks(shell: Any, code: CellCode, plan: Plan, *, name: str, result_name: str, returns: tuple[str, ...] | None,
              port: int | None, max_bytes: int) -> None:  # fmt: skip
    """Run the cell as the plan's ranks and apply rank 0's results to the notebook at once (nothing changes
    when the launch fails or is interrupted; an interrupt while they are applied leaves each name applied in full
    or as it was). `result_name` gets the outcome of every launch that ran, or was stopped before it could."""
    from .accelerator import rank_accelerator
    from .launch import LaunchError, LaunchInterrupted, launch_interrupted
    from .launch.guard import Interrupts
    from .results import receive_payload

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
    outcome = None
    try:
        outcome = launch_plan(
            body, plan, cell_filename=code.filename, port=port, max_bytes=max_bytes, receive=receive_payload
        )
        interrupts = Interrupts.hold()  # from the launch's end: each name is applied in full or left as it was
    except (LaunchError, LaunchInterrupted) as err:  # a launch that ran and ended badly is an outcome too
        if err.outcome is not None:
            ns[result_name] = err.outcome
        raise
    except KeyboardInterrupt:  # before the launch held interrupts, or between its end and this hold: nothing applied
        outcome = outcome or stopped_before_start(plan.num_processes)
        outcome.interrupted = True
        ns[result_name] = outcome
        raise launch_interrupted(outcome) from None
    finally:
        del body, notebook
    try:
        bring_back(outcome, ns)
        ns[result_name] = outcome
    finally:
        interrupts.release()
    if interrupts.count:
        outcome.interrupted = True
        raise results_interrupted(outcome)
    if outcome.skipped:
        listed = "; ".join(f"{item} ({reason})" for item, reason in outcome.skipped)
        print(f"Not brought back to the notebook: {listed}.")
