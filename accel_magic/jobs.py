"""A background launch as a Job: the ranks run from a thread of the kernel while the notebook runs other cells;
the Job keeps their state and output, stops them, and applies rank 0's results at the first cell boundary after
they end (IPython's pre_run_cell event) or at `%accel_wait`. One background launch at a time."""

from __future__ import annotations

import atexit
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from .accelerator import rank_accelerator
from .cell import CellCode
from .display import GLOO_CHATTER
from .errors import TrainError
from .launch import Hooks, Launch, LaunchOutcome, Results, run
from .launch.places import Place
from .launch.relay import Relay
from .plan import Plan
from .results import receive_payload
from .session import current
from .train import CellBody, bring_back, describe, launch_failure, results_interrupted, start

if TYPE_CHECKING:
    from .status import StatusView

__all__ = ["Job", "start_job", "running_job", "last_job", "refuse_while_running", "stop_jobs"]

KEPT_TEXT = 4 * 2**20  # characters of the ranks' output a job keeps; the oldest go first
REFRESH = 0.5  # seconds between two updates of the status view while nothing changes state

_atexit = False  # stop_jobs registered to run at the process's exit


class Job:
    """A launch in the background. `status` is "starting", "running", "done", "failed" or "stopped";
    `wait(timeout)` waits for the end and returns the outcome (as a foreground launch leaves in accel_result),
    `stop()` ends every rank. Once it ended: `outcome`, `error` (a failure's message, with `details`, the root
    cause's traceback), and `results`, rank 0's values that were not applied because the notebook had rebound
    their names. Every rank's output: `output`, and `last_line[rank]`; `rank_states[rank]`, `rank_time(rank)`
    (seconds it ran) and, while it runs, `places[rank]` ("at cell line 4", "in barrier at cell line 7")."""

    def __init__(
        self,
        shell: Any,
        code: CellCode,
        plan: Plan,
        *,
        name: str,
        result_name: str,
        returns: tuple[str, ...] | None,
        port: int | None,
        max_bytes: int,
    ):
        self.shell, self.plan, self.name = shell, plan, result_name
        self.status = "starting"
        self.outcome: LaunchOutcome | None = None
        self.error = ""
        self.details = ""
        self.note = ""  # what the notebook got, once applied
        self.results: dict[str, Any] = {}
        self.applied = False
        self.told_in: int | None = None  # the cell whose start said what was applied
        self.ranks = range(plan.node_rank * plan.num_processes, (plan.node_rank + 1) * plan.num_processes)
        self.rank_states = dict.fromkeys(self.ranks, "starting")
        self.pids: dict[int, int] = {}  # rank -> its process, once it runs
        self.last_line = dict.fromkeys(self.ranks, "")
        self.places: dict[int, str] = {}  # rank -> where it is while it runs: its cell line, the collective it waits in
        self._rank_started: dict[int, float] = {}
        self._rank_ended: dict[int, float] = {}
        self._text: list[str] = []
        self._kept = 0
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.ended = threading.Event()
        self._stop = threading.Event()
        self._before = {k: v for k, v in shell.user_ns.items() if not k.startswith("_")}
        body = CellBody(
            code,
            shell.user_ns,
            make_accelerator=partial(rank_accelerator, plan),
            name=name,
            returns=returns,
            notebook={id(v): (k, v) for k, v in self._before.items()},
            max_bytes=max_bytes,
        )
        hooks = Hooks(self._on_text, self._on_message, self._on_restart, stop=self._stop, watch=self._watch)
        results = Results(receive_payload, max_bytes)
        self._spec: Launch | None = describe(
            body, plan, filename=code.filename, port=port, results=results, hooks=hooks
        )
        self.view: StatusView | None = None  # the status widget, when the front end shows widgets
        self._refreshed = 0.0
        self._thread = threading.Thread(target=self._run, name="accel_magic-job", daemon=True)

    def __repr__(self) -> str:
        n = self.plan.num_processes
        return f"<accel_train background job: {self.status}, {n} rank{'s' if n > 1 else ''}, {self.elapsed:.1f} s>"

    @property
    def elapsed(self) -> float:
        return (self.ended_at or time.time()) - self.started_at

    @property
    def output(self) -> str:
        """Everything the ranks printed (other ranks' lines marked `[rank N]`), as a foreground cell shows it."""
        return "".join(self._text)

    def rank_time(self, rank: int) -> float | None:
        started = self._rank_started.get(rank)
        return None if started is None else self._rank_ended.get(rank, time.time()) - started

    def wait(self, timeout: float | None = None) -> LaunchOutcome | None:
        """Wait for the end (at most `timeout` seconds); the outcome, or None while it runs. Its results reach
        the notebook at the next cell, or at once with %accel_wait."""
        self.ended.wait(timeout)
        return self.outcome

    def stop(self, wait: bool = True) -> str:
        """End every rank (each records where its cell was); the status once it ended (with wait)."""
        self._stop.set()
        if wait:
            self.ended.wait(30)
        return self.status

    # -- in the job's thread --------------------------------------------------------------------------------------

    def start(self) -> None:
        assert self._spec is not None, "a job starts once"
        start(self._spec, self.plan)
        if self.view is not None:
            self.view.show()
        self._thread.start()

    def _run(self) -> None:
        assert self._spec is not None, "a job runs once"
        try:
            outcome = run(self._spec)
        except BaseException as err:  # a thread has nobody to raise to: the failure is the job's outcome
            outcome = LaunchOutcome(self.plan.num_processes, self.ranks.start)
            outcome.agent_error = f"{type(err).__name__}: {err}"
        self._spec = None  # the body, and the notebook's objects it holds
        self._finish(outcome)

    def _finish(self, outcome: LaunchOutcome) -> None:
        failure = launch_failure(outcome, self.plan)
        root = outcome.root_cause()
        for rank in self.ranks:
            if rank in outcome.durations:
                self.rank_states[rank] = "done"
            elif root is not None and rank == root.rank and not outcome.interrupted:
                self.rank_states[rank] = "failed"
            elif failure is not None:
                self.rank_states[rank] = "stopped"
            self._rank_ended.setdefault(rank, time.time())
        if failure is None:
            self.status = "done"
        else:
            self.status = "stopped" if outcome.interrupted else "failed"
            self.error = str(getattr(failure, "headline", failure))
            self.details = getattr(failure, "details", "")
        self.outcome = outcome
        self.ended_at = time.time()
        self.ended.set()
        self._refresh(force=True)

    def _on_text(self, rank: int, stream: str, text: str) -> None:
        text = GLOO_CHATTER.sub("", text)
        if not text:
            return
        self._text.append(text)
        self._kept += len(text)
        while self._kept > KEPT_TEXT and len(self._text) > 1:
            self._kept -= len(self._text.pop(0))
        prefix = f"[rank {rank}] "
        for line in reversed(text.replace("\r", "\n").split("\n")):
            line = line.removeprefix(prefix).strip()
            if line:
                self.last_line[rank] = line
                break

    def _on_restart(self, line: str) -> None:
        """Every rank starts again: the line in the output, each rank's state afresh."""
        self._on_text(self.ranks.start, "stdout", line + "\n")
        self.rank_states = dict.fromkeys(self.ranks, "starting")
        self._rank_started.clear()
        self._rank_ended.clear()
        self._refresh(force=True)

    def _on_message(self, message: dict[str, Any]) -> None:
        if self.view is not None:
            self.view.rank_message(message)

    def _watch(self, relay: Relay, places: dict[int, Place]) -> None:
        self.places = {rank: place.words() for rank, place in places.items() if rank not in self._rank_ended}
        changed = False
        for rank in relay.started:
            if self.rank_states.get(rank) == "starting":
                self.rank_states[rank] = "running"
                self.pids[rank] = relay.started[rank]
                self._rank_started[rank] = time.time()
                changed = True
        for rank, (code, when) in relay.ended.items():
            if rank not in self._rank_ended:
                self._rank_ended[rank] = when
                self.rank_states[rank] = "done" if code == 0 else "failed"
                changed = True
        if self.status == "starting" and len(relay.started) == len(self.ranks):
            self.status = "running"
        self._refresh(force=changed)

    def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.view is not None and (force or now - self._refreshed >= REFRESH):
            self._refreshed = now
            try:
                self.view.refresh(self)
            except Exception:  # a view that failed must not end the launch
                self.view = None

    # -- in the kernel's main thread ------------------------------------------------------------------------------

    def started(self) -> bool:
        """Wait until every rank runs (so they forked from a kernel that ran no other cell) or the job ended;
        True when it runs. An interrupt meanwhile stops it."""
        try:
            while self.status == "starting" and not self.ended.wait(0.02):
                pass
        except KeyboardInterrupt:
            self.stop()
        return not self.ended.is_set()

    def apply(self) -> str:
        """Bring rank 0's results into the notebook (once); the one line that says what happened, also shown in
        the status widget."""
        self.note = self._apply()
        self.applied = True
        self._before = {}  # the notebook's objects, held while the launch ran
        self._refresh(force=True)
        return self.note

    def conclude(self) -> None:
        """In the cell that waited for the end (%accel_wait, or the one that started a launch that ended at once):
        the results applied now and one line says so, or the failure raised as a foreground launch's."""
        line = self.apply()
        assert self.outcome is not None, "a job that ended has its outcome"
        failure = launch_failure(self.outcome, self.plan) if self.status != "done" else None
        if failure is None and self.outcome.interrupted:  # the interrupt came while the results were applied
            failure = results_interrupted(self.outcome)
        if failure is not None:
            raise failure
        print(line)

    def _apply(self) -> str:
        n = len(self.ranks)
        ranks = f"{n} rank{'s' if n > 1 else ''}"
        if self.status == "stopped":
            return f"Background launch ({self.name}): {self.error}; nothing was applied."
        if self.status == "failed" or self.outcome is None:
            return f"Background launch ({self.name}) failed: {self.error} (the traceback: {self.name}.details)."
        applied, self.results = bring_back(self.outcome, self.shell.user_ns, self._before, f"{self.name}.results")
        line = f"Background launch ({self.name}): {ranks} done in {self.elapsed:.1f} s"
        line += f"; applied {', '.join(applied)}" if applied else "; nothing to apply"
        if self.outcome.skipped:
            line += "; not applied: " + "; ".join(f"{name} ({why})" for name, why in self.outcome.skipped)
        return line + "."


def start_job(shell: Any, code: CellCode, plan: Plan, **options: Any) -> Job:
    """Start the plan's ranks in the background and return once they run (or ended); the job's status widget is
    shown in the cell when the front end shows widgets."""
    global _atexit
    refuse_while_running()
    job = Job(shell, code, plan, **options)
    if getattr(shell, "kernel", None) is not None:
        from .status import StatusView  # ipywidgets, only where a front end shows widgets

        job.view = StatusView(job)
    job.start()
    current().last_job = job
    _hook(shell)
    if not _atexit:
        atexit.register(stop_jobs)
        _atexit = True
    job.started()
    return job


def running_job() -> Job | None:
    job = current().last_job
    return job if job is not None and not job.ended.is_set() else None


def last_job() -> Job | None:
    return current().last_job


def refuse_while_running() -> None:
    job = running_job()
    if job is not None:
        raise TrainError(
            f"A background launch is still running ({job.name}): wait for it with %accel_wait or stop it with "
            f"{job.name}.stop(), then launch again; nothing was launched."
        )


def _at_next_cell(*_: Any) -> None:
    """pre_run_cell: the results of a background launch that ended are applied before the cell runs."""
    job = current().last_job
    if job is not None and job.ended.is_set() and not job.applied:
        print(job.apply())
        job.told_in = job.shell.execution_count


def _hook(shell: Any) -> None:
    session = current()
    if session.hooked is not shell:
        _unhook()
        shell.events.register("pre_run_cell", _at_next_cell)
        session.hooked = shell


def _unhook() -> None:
    session = current()
    if session.hooked is not None:
        try:
            session.hooked.events.unregister("pre_run_cell", _at_next_cell)
        except ValueError:
            pass
        session.hooked = None


def stop_jobs() -> None:
    """At the kernel's exit or the extension's unload: end a running job's ranks and leave nothing behind."""
    job = running_job()
    if job is not None:
        job.stop()
    _unhook()
    current().last_job = None
