"""Run a compiled cell under a plan: in the kernel like a normal cell, or as forked ranks whose rank 0 results
are applied to the notebook afterwards (at once; or, for a background launch, by jobs.py at the next cell)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .accelerator import join_uneven_inputs_on_cpu, rank_accelerator, rank_environment, reset_state
from .cell import CellCode
from .display import launch_banner, write_rank_text
from .errors import LaunchError, LaunchInterrupted, TrainError, ranks_failed
from .footprint import banner_line, estimate, fit_words, kernel_private, used_objects
from .launch import (
    Hooks,
    Launch,
    LaunchOutcome,
    NodeOptions,
    Nodes,
    RankBody,
    RankFailure,
    Ranks,
    Results,
    failure_words,
    forks,
    interrupted_words,
    run,
)
from .launch.interrupts import Interrupts
from .launch.ports import check_port
from .launch.relay import publish_kernel_message
from .plan import Plan, parse_endpoint
from .results import Received, pack_payload, receive_payload, track_prepare, unpack_results
from .runtime import memory

__all__ = ["CellBody", "FrontDoor", "run_in_kernel", "plan_nodes", "describe", "check_launch", "fit", "fit_in_kernel",
           "start", "launch_error", "function_source", "launch_interrupted", "launch_failure", "stopped_before_start",
           "launch_plan", "bring_back", "results_interrupted", "run_ranks"]  # fmt: skip

_MISSING = object()
# What DDP and accelerate's `prepare` import in a rank (torch._dynamo, DTensor: 440 to 880 modules, 1 to 1.7 s of
# CPU in every rank of every launch here): once a launch's ranks imported them, the kernel imports them before the
# next launch forks, and the ranks of every launch after inherit them. Only where no GPU or TPU is seen: a kernel
# that has touched CUDA can no longer fork ranks that use it, and what these modules touch as they load was not
# watched on a GPU.
PRELOAD = ("torch.distributed.tensor", "torch._dynamo")


class CellBody:
    """What each rank runs: a fresh accelerator (setup), the cell in the rank's copy of the namespace (run),
    and on rank 0 the results written into the launch's private folder (results: the manifest)."""

    def __init__(
        self,
        cell: CellCode,
        ns: dict[str, Any],
        *,
        make_accelerator: Callable[[], Any],
        name: str,
        returns: tuple[str, ...] | None,
        notebook: Mapping[int, tuple[str, Any]],
        max_bytes: int,
    ):
        self.cell, self.ns, self.make_accelerator, self.name = cell, ns, make_accelerator, name
        self.returns, self.notebook, self.max_bytes = returns, notebook, max_bytes
        self.prepared: dict[int, Any] = {}
        self.registered: list[Any] = []

    def setup(self, rank: int) -> None:
        reset_state()  # state copied from the notebook would make the rank believe it trains alone
        track_prepare(self.prepared, self.registered)
        join_uneven_inputs_on_cpu()
        self.ns[self.name] = self.make_accelerator()

    def run(self) -> None:
        exec(self.cell.code, self.ns)

    def uses(self) -> list[Any]:
        """The notebook's models and optimizers the cell uses."""
        return used_objects(self.cell.code, self.ns)

    def results(self, rank: int, folder: str) -> bytes | None:
        if rank != 0 or self.returns is None:  # --no-return
            return None
        return pack_payload(
            self.ns, self.returns, self.prepared, self.notebook, folder, self.max_bytes, registered=self.registered
        )


def run_in_kernel(shell: Any, cell: str, result_name: str) -> None:
    """Run the cell in the kernel like a normal cell (its errors show as a normal cell's do); how it ended goes
    to `result_name` whatever the end."""
    began = time.perf_counter()
    result = shell.run_cell(cell, store_history=False)
    outcome = LaunchOutcome(1, wall_time=time.perf_counter() - began, exitcodes={0: 0 if result.success else 1})
    err = result.error_in_exec or result.error_before_exec
    if isinstance(err, KeyboardInterrupt):
        outcome.interrupted = True
    elif err is not None:
        first = str(err).splitlines()[0] if str(err) else ""
        summary = f"{type(err).__name__}: {first}" if first else type(err).__name__
        outcome.failures.append(RankFailure(0, 1, "exception", summary, when=time.time()))
    del err, result  # the exception is IPython's to keep (sys.last_value), not the outcome's
    shell.user_ns[result_name] = outcome


@dataclass(frozen=True)
class FrontDoor:
    """How a front door names a launch's settings in the sentences it can end with (%%accel_train's by default);
    `source` is the file of a launched function that is not a notebook cell, which an interrupt names instead;
    `banner`, when given, is printed at the start instead of the plan's launch banner."""

    port_option: str = "--port"
    endpoint_option: str = "--rdzv-endpoint"
    nodes: NodeOptions = NodeOptions()
    source: str = ""
    banner: str = ""


CELL = FrontDoor()


def function_source(function: Callable[..., Any], filename: str) -> str:
    """What holds a launched function, as an interrupt names it: the notebook cell that defined it, or its file."""
    if getattr(function, "__module__", None) == "__main__":
        return f"{getattr(function, '__name__', 'the function')}'s cell"
    return os.path.basename(filename) or "the function"


def versions_line() -> str:
    """The versions a bug report needs, in one line."""
    from .runtime import versions

    return ", ".join(f"{name} {version or '-'}" for name, version in versions())


def plan_nodes(plan: Plan, run_id: str = "", rdzv_timeout: float | None = None) -> Nodes:
    """The plan's machines as the launch sees them; the nodes wait for each other as long as a collective."""
    if plan.num_nodes == 1:
        return Nodes()
    host, _ = parse_endpoint(plan.rdzv_endpoint)
    return Nodes(plan.num_nodes, plan.node_rank, host, run_id, rdzv_timeout or plan.timeout)


def describe(
    body: RankBody,
    plan: Plan,
    *,
    filename: str,
    port: int | None,
    results: Results | None = None,
    hooks: Hooks | None = None,
    nodes: Nodes | None = None,
) -> Launch:
    """The launch of `body` as the plan's ranks: their environment from the plan, the machines (`nodes`, by
    default the plan's), and the port (across machines, node 0's from the plan's endpoint)."""
    ranks = Ranks(
        plan.num_processes,
        backend=plan.backend or "gloo",
        threads=plan.threads_per_process,
        timeout=plan.timeout,
        env=MappingProxyType(rank_environment(plan)),
        cpus=plan.runtime.cpu_budget,
        max_restarts=plan.max_restarts,
        versions=versions_line,
        memory_limit=(plan.runtime.ram_bytes, plan.runtime.ram_limit) if plan.runtime.ram_bytes else None,
        preload=PRELOAD if plan.launch == "fork" and not (plan.runtime.gpus or plan.runtime.tpu) else (),
    )
    if plan.num_nodes > 1:
        port = parse_endpoint(plan.rdzv_endpoint)[1]
    return Launch(body, ranks, filename, nodes or plan_nodes(plan), port, results or Results(), hooks or Hooks())


def check_launch(spec: Launch, plan: Plan, door: FrontDoor = CELL) -> None:
    """Raise TrainError (one sentence) when the launch cannot start here now."""
    if plan.num_nodes > 1:
        if plan.node_rank == 0 and not check_port(spec.port, spec.nodes.host):
            raise TrainError(
                f"Node 0 cannot listen on {plan.rdzv_endpoint} (not an address of this machine, or the port is in "
                f"use): give node 0's own address and a free port in {door.endpoint_option}, the same on every node."
            )
    elif spec.port is not None and not check_port(spec.port):
        raise TrainError(
            f"Port {spec.port} is in use: choose another with {door.port_option}, or leave {door.port_option} out."
        )
    blocker = forks.cuda_fork_blocker() if plan.device == "cuda" else None
    if blocker:
        raise TrainError(
            f"{blocker}, so GPU ranks cannot be forked: restart the kernel, run %accel_setup first and keep "
            "CUDA work inside %%accel_train cells."
        )


ROOT = Path("/")  # the machine's files, where the memory available is read


def fit(objects: list[Any], plan: Plan, in_kernel: bool = False) -> tuple[str, str]:
    """Whether training `objects` (the notebook's models and optimizers the launch uses) under the plan fits in
    the memory available now: the sentence that says it will need more than there is (TrainError with it under
    --strict), and the banner's line when it will need more than half ("" each else)."""
    if not objects:
        return "", ""
    shm = plan.allreduce == "shm" and not in_kernel
    footprint = estimate(
        objects, plan.num_processes, in_kernel=in_kernel, shared_memory=shm, kernel_private=kernel_private()
    )
    available = memory(ROOT)[1]
    words = fit_words(footprint, available, plan.request.strict)
    if words and plan.request.strict:
        raise TrainError(words)
    return words, banner_line(footprint, available)


def fit_in_kernel(code: CellCode, ns: Mapping[str, Any], plan: Plan) -> None:
    """Before a cell runs in the kernel: the sentence that says it will need more memory than is available (under
    --strict, TrainError with it)."""
    warning, _ = fit(used_objects(code.code, ns), plan, in_kernel=True)
    if warning:
        print(warning)


def start(spec: Launch, plan: Plan, door: FrontDoor = CELL) -> None:
    """The launch's first steps in every front door: refused in one sentence (TrainError) when it cannot start
    here or, under --strict, will need more memory than is available; else announced by the launch banner, with
    what it will need in memory when that is more than half of what is available. `launch.run(spec)` runs it
    next."""
    check_launch(spec, plan, door)
    warning, memory_line = fit(spec.body.uses(), plan)
    print("\n".join(filter(None, [door.banner or launch_banner(plan), memory_line, warning])))


def launch_failure(outcome: LaunchOutcome, plan: Plan, door: FrontDoor = CELL) -> Exception | KeyboardInterrupt | None:
    """The launch's last step in every front door: the one exception that says how it went wrong
    (LaunchInterrupted is a KeyboardInterrupt), or None."""
    if outcome.interrupted:
        return launch_interrupted(outcome, door.source)
    if not outcome.ok:
        return launch_error(outcome, plan.timeout, door.nodes)
    if outcome.receive_error:
        return LaunchError(
            f"rank 0's results could not be read back ({outcome.receive_error}); nothing in the notebook changed.",
            outcome=outcome,
        )
    return None


def launch_error(outcome: LaunchOutcome, timeout: float, options: NodeOptions | None = None) -> LaunchError:
    """One exception for a failed launch, built outside any `except` block: it names the rank where the
    failure started and holds nothing of the launch (so the rendezvous port is freed)."""
    words = failure_words(outcome, timeout, options or NodeOptions())
    if words.ranks:
        return ranks_failed(words.headline, words.details, outcome)
    return LaunchError(words.headline, words.details, outcome)


def launch_interrupted(outcome: LaunchOutcome, source: str = "") -> LaunchInterrupted:
    """The one line an interrupted launch ends with, as a KeyboardInterrupt."""
    return LaunchInterrupted(interrupted_words(outcome, source), outcome)


def stopped_before_start(num_processes: int, first_rank: int = 0) -> LaunchOutcome:
    """The outcome of a launch interrupted before any of its ranks started."""
    return LaunchOutcome(num_processes, first_rank, interrupted=True)


def launch_plan(spec: Launch, plan: Plan, door: FrontDoor = CELL) -> LaunchOutcome:
    """The launch in the foreground, start to end: `start`, `launch.run`, `launch_failure`. Raises TrainError
    before anything starts, LaunchError when the launch failed, LaunchInterrupted (a KeyboardInterrupt) when it
    was interrupted; both carry the outcome."""
    try:
        start(spec, plan, door)
        outcome = run(spec)
    except KeyboardInterrupt:  # before the launch held the kernel's interrupts (it returns those it held)
        outcome = stopped_before_start(plan.num_processes, spec.first_rank)
    failure = launch_failure(outcome, plan, door)
    if failure is not None:
        raise failure
    return outcome


def bring_back(
    outcome: LaunchOutcome, ns: dict[str, Any], before: Mapping[str, Any] | None = None, held_in: str = ""
) -> tuple[list[str], dict[str, Any]]:
    """Apply rank 0's results to the notebook, each name in full; returns the names applied, and the values held
    back. What could not come is in `outcome.skipped`. With `before` (the namespace when a background launch
    started), a name the notebook rebound since then keeps its new value: the launch's is held back, by name, and
    listed as not applied, found in `held_in` (such as "accel_result.results"). The kernel's interrupts are held
    meanwhile: after one, the names not yet applied are left as they were, listed as not applied, and the outcome
    is marked interrupted."""
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


def run_ranks(
    shell: Any,
    code: CellCode,
    plan: Plan,
    *,
    name: str,
    result_name: str,
    returns: tuple[str, ...] | None,
    port: int | None,
    max_bytes: int,
) -> None:
    """Run the cell as the plan's ranks and apply rank 0's results to the notebook at once (nothing changes
    when the launch fails or is interrupted; an interrupt while they are applied leaves each name applied in full
    or as it was). `result_name` gets the outcome of every launch that ran, or was stopped before it could."""
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
        hooks = Hooks(on_text=write_rank_text, on_message=publish_kernel_message)
        results = Results(receive_payload, max_bytes)
        outcome = launch_plan(
            describe(body, plan, filename=code.filename, port=port, results=results, hooks=hooks), plan
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
