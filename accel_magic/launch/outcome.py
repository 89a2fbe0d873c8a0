"""How a launch ended, as plain data: each rank's failure, the outcome, the rank where a failure started, and
the one `LaunchError` the user sees. `collect` builds the outcome from what the ranks recorded; it reads nothing
itself."""

from __future__ import annotations

import functools
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "FailureKind",
    "RankFailure",
    "RankRecords",
    "LaunchOutcome",
    "LaunchError",
    "LaunchInterrupted",
    "NodeOptions",
    "collect",
    "launch_error",
    "launch_interrupted",
    "error_line",
]

ISSUES_URL = "https://github.com/accel-magic/accel_magic/issues"

FailureKind = Literal[
    "exception",  # the cell raised
    "exit",  # the cell called sys.exit or os._exit with a non-zero code
    "signal",  # the rank ended without a record: killed, crashed, or ended by the agent
    "collateral",  # an error that a dead peer caused (never the root cause)
    "timeout",  # a collective waited past the process group's timeout
    "internal",  # accel_magic's own machinery failed inside the rank, before or after the cell
]


@dataclass(frozen=True)
class RankFailure:
    """A rank's failure as plain data (no exception object, which would keep the launch alive)."""

    rank: int
    exitcode: int | None
    kind: FailureKind
    summary: str
    traceback: str = ""
    when: float | None = None
    versions: str = ""  # for an internal failure: what a bug report needs


@dataclass(frozen=True)
class RankRecords:
    """What one rank recorded in the launch's folder: that it started, how it ended."""

    started: bool = False
    duration: float | None = None  # set when the rank ended well
    error: RankFailure | None = None


@dataclass
class LaunchOutcome:
    num_processes: int  # this node's ranks
    first_rank: int = 0  # this node's first global rank (0 on one node)
    num_nodes: int = 1
    endpoint: str = ""  # HOST:PORT of the rendezvous, for several nodes
    rdzv_timeout: float = 0.0  # seconds the nodes waited for each other at the rendezvous, for several nodes
    nodes_joined: int | None = None  # on node 0: the nodes (itself included) that joined before the rendezvous gave up
    remote_failure: str = ""  # what another node reported before this node's ranks were stopped
    wall_time: float = 0.0
    cleanup_time: float = 0.0  # part of wall_time spent putting the kernel back as it was
    exitcodes: dict[int, int | None] = field(default_factory=dict)
    durations: dict[int, float] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    received: Any = None  # what `receive` made of rank 0's results, in the kernel
    receive_error: str = ""
    interrupted: bool = False
    restarts: int = 0  # how many times the ranks were started again after a failure before this run
    started: tuple[int, ...] = ()  # the ranks whose program began (an interrupt may come before any did)
    agent_error: str = ""
    skipped: tuple[tuple[str, str], ...] = ()
    results_seconds: dict[str, float] = field(default_factory=dict)  # send (rank 0), receive, apply (kernel)
    ended: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (exit code or -signal, when)

    def __repr__(self) -> str:
        status = "ok" if self.ok else ("interrupted" if self.interrupted else "failed")
        ranks = ", ".join(
            f"rank {r}: exit {c}" + (f" after {self.durations[r]:.2f} s" if r in self.durations else "")
            for r, c in sorted(self.exitcodes.items())
        )
        ranks = f"; {ranks}" if ranks else ""  # none when no rank ran
        return f"<accel_train {status}: {self.num_processes} processes, wall time {self.wall_time:.2f} s{ranks}>"

    @property
    def ranks(self) -> range:
        """This node's global ranks."""
        return range(self.first_rank, self.first_rank + self.num_processes)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.interrupted and not self.agent_error

    def root_cause(self) -> RankFailure | None:
        """The rank where the failure started: an exception, exit or kill before any collateral error."""
        if not self.failures:
            return None

        # The first to fail, by the time its record was written or its process was seen to end; errors that a
        # dead peer caused come last whatever their time, and so do ends nobody saw.
        def key(f: RankFailure) -> tuple[bool, bool, float, int]:
            return (f.kind == "collateral", f.when is None, f.when or 0.0, f.rank)

        return min(self.failures, key=key)


def error_line(kind: str, message: str) -> str:
    """The first line of an error as IPython shows it: the exception's name in red, then the message."""
    return f"\x1b[0;31m{kind}\x1b[0m: {message}"


class LaunchError(Exception):
    """A launch that failed; shows one short traceback naming the rank where it started. When ranks failed, it
    is also torch elastic's `ChildFailedError` (see `ranks_failed`), which accelerate's launcher raises."""

    def __init__(self, headline: str, details: str = "", outcome: LaunchOutcome | None = None):
        Exception.__init__(self, headline)  # not ChildFailedError's, which a subclass may have next in line
        self.headline = headline
        self.details = details
        self.outcome = outcome

    def _render_traceback_(self) -> list[str]:
        lines = [error_line(type(self).__name__, self.headline)]
        if self.details:
            lines += self.details.rstrip("\n").split("\n")
        return lines


class LaunchInterrupted(KeyboardInterrupt):
    """An interrupted launch: a KeyboardInterrupt that shows one line saying the ranks were stopped and where the
    first of them was, with none of the frames it passed through."""

    def __init__(self, message: str, outcome: LaunchOutcome | None = None):
        super().__init__(message)
        self.outcome = outcome

    def _render_traceback_(self) -> list[str]:
        return [error_line("KeyboardInterrupt", str(self))]


@functools.cache
def _ranks_failed_type() -> type[LaunchError]:
    """LaunchError that is also torch elastic's ChildFailedError (as accelerate users catch a launch's failure),
    its `failures` each rank's, keyed by global rank; LaunchError alone where torch is missing."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    except ImportError:
        return LaunchError

    class RanksFailed(LaunchError, ChildFailedError):
        __doc__ = LaunchError.__doc__

    RanksFailed.__name__ = RanksFailed.__qualname__ = "LaunchError"  # the name notebooks show (the reply's ename)
    return RanksFailed


def ranks_failed(headline: str, details: str, outcome: LaunchOutcome) -> LaunchError:
    """The LaunchError of a launch whose ranks failed, which is also a ChildFailedError whose `failures` hold each
    failed rank's summary (exit code, and the exception as its message)."""
    err = _ranks_failed_type()(headline, details, outcome)
    if type(err) is not LaunchError:
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        root = outcome.root_cause()
        ordered = sorted(outcome.failures, key=lambda f: f is not root)  # get_first_failure: the earliest, then first
        first = min(int(f.when or time.time()) for f in ordered)
        failures = {}
        for f in ordered:
            code = 1 if f.exitcode is None else f.exitcode
            failure = ProcessFailure(f.rank - outcome.first_rank, 0, code, error_file="")
            failure.message, failure.timestamp = f.summary, first if f is root else int(f.when or first)
            failures[f.rank] = failure
        err.name, err.failures = "accel_train", failures  # type: ignore[attr-defined]
    return err


# Front ends and notebooks name an error by its class (the reply's ename): this one is a KeyboardInterrupt to them.
LaunchInterrupted.__name__ = LaunchInterrupted.__qualname__ = "KeyboardInterrupt"

CELL_LINE = re.compile(r"^  Cell line (\d+), in ", re.MULTILINE)


def launch_interrupted(outcome: LaunchOutcome, source: str = "") -> LaunchInterrupted:
    """The one line an interrupted launch ends with: how many ranks were stopped and the line of the cell (or of
    `source`, what holds a launched function: "train.py", "train's cell") where this node's first rank was, when
    it left one; or that no rank had started yet, or that every rank had ended before the interrupt (and then
    nothing came back)."""
    n = outcome.num_processes
    if not outcome.started:
        return LaunchInterrupted("the launch was stopped before its ranks started", outcome)
    ranks = f"the {n} ranks" if n > 1 else "the rank"
    if all(r in outcome.durations for r in outcome.ranks):
        return LaunchInterrupted(
            f"{ranks} had ended, but the interrupt came before anything came back from them: nothing in the "
            "notebook changed",
            outcome,
        )
    stopped = f"{ranks} were stopped" if n > 1 else f"{ranks} was stopped"
    first = outcome.first_rank
    lines = [int(m) for f in outcome.failures if f.rank == first for m in CELL_LINE.findall(f.traceback)]
    if lines:
        where = f"line {lines[-1]} of {source}" if source else f"cell line {lines[-1]}"
        stopped += f" (rank {first} was at {where})"
    return LaunchInterrupted(stopped, outcome)


def abrupt(rank: int, code: int | None) -> RankFailure:
    """A rank that ended without leaving a record: killed, crashed, or ended by the agent."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (as the out-of-memory killer does)" if name == "SIGKILL" else ""
        return RankFailure(rank, code, "signal", f"was killed by {name}{hint}")
    if code:
        return RankFailure(rank, code, "signal", f"ended with exit code {code} without raising an exception")
    return RankFailure(
        rank, None, "signal", "died without raising an exception (killed, e.g. by the out-of-memory killer, or crashed)"
    )


def collect(outcome: LaunchOutcome, records: Mapping[int, RankRecords]) -> None:
    """Fill in each rank's duration, exit code and failure from its records and from how its process was seen
    to end (`outcome.ended`, `outcome.exitcodes`). A rank that started, left no record and ended while the
    launch failed is a failure of its own (killed or crashed)."""
    failed = bool(outcome.agent_error) or any(outcome.exitcodes.get(r) for r in records)
    failed = failed or any(code for code, _ in outcome.ended.values())
    for r, (code, _) in outcome.ended.items():
        outcome.exitcodes[r] = code
    outcome.started = tuple(r for r, record in sorted(records.items()) if record.started)
    for r, record in sorted(records.items()):
        if record.duration is not None:
            outcome.durations[r] = record.duration
        if record.error is not None:
            outcome.failures.append(record.error)
        elif record.duration is None and record.started and (failed or outcome.exitcodes.get(r)):
            code, when = outcome.ended.get(r, (outcome.exitcodes.get(r), None))
            outcome.failures.append(replace(abrupt(r, code), when=when))


@dataclass(frozen=True)
class NodeOptions:
    """How the user gives a launch across machines its settings: named in the sentence that says what to change
    when the nodes did not meet. The defaults are %%accel_train's."""

    start: str = "start the cell"
    timeout: str = "--timeout"
    node_rank: str = "--node-rank"
    same: str = "--nodes and --rdzv-endpoint"


def launch_error(outcome: LaunchOutcome, timeout: float, options: NodeOptions = NodeOptions()) -> LaunchError:
    """One exception for a failed launch, built outside any `except` block: it names the rank where the
    failure started and holds nothing of the launch (so the rendezvous port is freed)."""
    if outcome.agent_error and outcome.num_nodes > 1:
        others = outcome.num_nodes - 1
        waited = outcome.rdzv_timeout or timeout
        why = outcome.agent_error
        if outcome.nodes_joined is not None:
            why = f"{outcome.nodes_joined} of the {outcome.num_nodes} nodes joined within {waited:g} s"
        return LaunchError(
            f"this node could not form one group with the other {others} node{'s' if others > 1 else ''} at "
            f"{outcome.endpoint} ({why}): {options.start} on every node within {waited:g} s "
            f"({options.timeout}), each with its own {options.node_rank} and the same {options.same}; nothing was "
            "trained.",
            outcome=outcome,
        )
    if outcome.agent_error:
        return LaunchError(f"the launch failed before the cell ran: {outcome.agent_error}", outcome=outcome)
    root = outcome.root_cause()
    assert root is not None
    stopped = "; the other ranks were stopped." if outcome.num_processes > 1 else "."
    if outcome.num_nodes > 1 and root.kind in ("collateral", "signal") and outcome.remote_failure:
        headline = (
            f"the launch failed on another node ({outcome.remote_failure}), so this node's ranks were stopped; "
            "that node's cell names the rank and the line."
        )
        return ranks_failed(headline, "", outcome)
    if outcome.num_nodes > 1 and root.kind == "collateral":  # every failure here was caused elsewhere
        headline = (
            f"rank {root.rank} lost the ranks of another node ({root.summary}): the failure started on another "
            "node, whose cell names the rank and the line; this node's ranks were stopped."
        )
        return ranks_failed(headline, "", outcome)
    if root.kind == "timeout":
        headline = (
            f"rank {root.rank}: a collective waited more than {timeout:g} s (--timeout) for the other ranks; "
            f"every rank must reach the same collectives ({root.summary}){stopped}"
        )
    elif root.kind == "internal":
        headline = (
            f"accel_magic failed inside rank {root.rank} {root.summary}{stopped} This is a bug in accel_magic, "
            f"not in your cell: please report it at {ISSUES_URL} with the traceback and versions below."
        )
        return ranks_failed(headline, f"{root.traceback.rstrip()}\nversions: {root.versions}", outcome)
    elif root.kind in ("signal", "exit"):
        headline = f"rank {root.rank} {root.summary}{stopped}"
    else:  # one rank: the exception's own words end the line
        headline = f"rank {root.rank} raised {root.summary}" + (stopped if outcome.num_processes > 1 else "")
    return ranks_failed(headline, root.traceback, outcome)
