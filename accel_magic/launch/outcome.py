"""How a launch ended, as plain data: each rank's failure, the outcome, the rank where a failure started, and
the words the user reads of it (`failure_words`, `interrupted_words`; the errors that carry them are in
accel_magic.errors). `collect` builds the outcome from what the ranks recorded; it reads nothing itself."""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from . import memory
from .places import Place, place_words

__all__ = [
    "FailureKind",
    "RankFailure",
    "RankRecords",
    "LaunchOutcome",
    "Words",
    "NodeOptions",
    "collect",
    "failure_words",
    "interrupted_words",
]

ISSUES_URL = "https://github.com/accel-magic/accel_magic/issues"

FailureKind = Literal[
    "exception",  # the cell raised
    "exit",  # the cell called sys.exit or os._exit with a non-zero code
    "signal",  # the rank ended without a record: killed, crashed, or ended by the agent
    "memory",  # the out-of-memory killer ended the rank (the root cause whatever else ended meanwhile)
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
    pids: dict[int, int] = field(default_factory=dict)  # rank -> its process's pid
    places: dict[int, Place] = field(default_factory=dict)  # rank -> its last place: cell line, collective
    stuck: str = ""  # where the ranks waited when they could never meet again (they were stopped)
    peaks: dict[int, int] = field(default_factory=dict)  # rank -> the most memory its process held, in bytes
    oom_killed: bool = False  # whether the out-of-memory killer ended a process while the launch ran
    memory_limit: tuple[int, str] | None = None  # what the kernel and its ranks may use (Ranks.memory_limit)

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
        return not self.failures and not self.interrupted and not self.agent_error and not self.stuck

    def root_cause(self) -> RankFailure | None:
        """The rank where the failure started: an exception, exit or kill before any collateral error."""
        if not self.failures:
            return None

        # A rank the out-of-memory killer ended, else the first to fail, by the time its record was written or its
        # process was seen to end (a killed rank's exit may be seen after the others were stopped for it); errors
        # that a dead peer caused come last whatever their time, then ranks that ended by SIGTERM or without a
        # record or an exit code that says why (as the launch stops the others once one failed), then ends nobody
        # saw.
        def key(f: RankFailure) -> tuple[bool, bool, bool, bool, float, int]:
            stopped = f.kind == "signal" and f.exitcode in (None, 0, -signal.SIGTERM)
            return (f.kind != "memory", f.kind == "collateral", stopped, f.when is None, f.when or 0.0, f.rank)

        return min(self.failures, key=key)


CELL_LINE = re.compile(r"^  Cell line (\d+), in ", re.MULTILINE)


def interrupted_words(outcome: LaunchOutcome, source: str = "") -> str:
    """The one line an interrupted launch ends with (errors.LaunchInterrupted's): how many ranks were stopped and
    where each was: the line of the cell (or of `source`, what holds a launched function: "train.py", "train's
    cell") and the collective it waited in; or that no rank had started yet, or that every rank had ended before
    the interrupt (and then nothing came back)."""
    n = outcome.num_processes
    if not outcome.started:
        return "the launch was stopped before its ranks started"
    ranks = f"the {n} ranks" if n > 1 else "the rank"
    if all(r in outcome.durations for r in outcome.ranks):
        return (
            f"{ranks} had ended, but the interrupt came before anything came back from them: nothing in the "
            "notebook changed"
        )
    stopped = f"{ranks} were stopped" if n > 1 else f"{ranks} was stopped"
    places = dict(outcome.places)
    for failure in outcome.failures:  # the line its interrupt's traceback names is exact; a sample may be older
        lines = CELL_LINE.findall(failure.traceback)
        if lines:
            place = places.get(failure.rank, Place())
            same = place.line == int(lines[-1])
            places[failure.rank] = Place(place.state, int(lines[-1]), place.op if same else "", place.called)
    where = place_words(places, source=source)
    return f"{stopped} ({where})" if where else stopped


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
            failure = replace(abrupt(r, code), when=when)
            if outcome.oom_killed and code == -signal.SIGKILL:
                words = memory.killed_words(outcome.peaks.get(r), outcome.memory_limit)
                failure = replace(failure, kind="memory", summary=words)
            outcome.failures.append(failure)


@dataclass(frozen=True)
class NodeOptions:
    """How the user gives a launch across machines its settings: named in the sentence that says what to change
    when the nodes did not meet. The defaults are %%accel_train's."""

    start: str = "start the cell"
    timeout: str = "--timeout"
    node_rank: str = "--node-rank"
    same: str = "--nodes and --rdzv-endpoint"


class Words(NamedTuple):
    """What a failed launch says: its headline, the traceback under it, and whether ranks failed (the error is
    then also torch elastic's ChildFailedError, with each rank's failure)."""

    headline: str
    details: str = ""
    ranks: bool = True


def failure_words(outcome: LaunchOutcome, timeout: float, options: NodeOptions = NodeOptions()) -> Words:
    """The words of a failed launch (errors.LaunchError's): the rank where the failure started, and why."""
    if outcome.stuck:  # the ranks were stopped: how torch's agent took that says nothing more
        return Words(
            f"{outcome.stuck}: every rank must reach the same collectives in the same order; nothing was brought back.",
            ranks=False,
        )
    if outcome.agent_error and outcome.num_nodes > 1:
        others = outcome.num_nodes - 1
        waited = outcome.rdzv_timeout or timeout
        why = outcome.agent_error
        if outcome.nodes_joined is not None:
            why = f"{outcome.nodes_joined} of the {outcome.num_nodes} nodes joined within {waited:g} s"
        return Words(
            f"this node could not form one group with the other {others} node{'s' if others > 1 else ''} at "
            f"{outcome.endpoint} ({why}): {options.start} on every node within {waited:g} s "
            f"({options.timeout}), each with its own {options.node_rank} and the same {options.same}; nothing was "
            "trained.",
            ranks=False,
        )
    if outcome.agent_error:
        return Words(f"the launch failed before the cell ran: {outcome.agent_error}", ranks=False)
    root = outcome.root_cause()
    assert root is not None
    stopped = "; the other ranks were stopped." if outcome.num_processes > 1 else "."
    if outcome.num_nodes > 1 and root.kind in ("collateral", "signal") and outcome.remote_failure:
        headline = (
            f"the launch failed on another node ({outcome.remote_failure}), so this node's ranks were stopped; "
            "that node's cell names the rank and the line."
        )
        return Words(headline)
    if outcome.num_nodes > 1 and root.kind == "collateral":  # every failure here was caused elsewhere
        headline = (
            f"rank {root.rank} lost the ranks of another node ({root.summary}): the failure started on another "
            "node, whose cell names the rank and the line; this node's ranks were stopped."
        )
        return Words(headline)
    if root.kind == "timeout":
        where = place_words(outcome.places)
        headline = (
            f"rank {root.rank}: a collective waited more than {timeout:g} s (--timeout) for the other ranks; "
            f"every rank must reach the same collectives ({root.summary}{'; ' + where if where else ''}){stopped}"
        )
    elif root.kind == "internal":
        headline = (
            f"accel_magic failed inside rank {root.rank} {root.summary}{stopped} This is a bug in accel_magic, "
            f"not in your cell: please report it at {ISSUES_URL} with the traceback and versions below."
        )
        return Words(headline, f"{root.traceback.rstrip()}\nversions: {root.versions}")
    elif root.kind in ("signal", "exit", "memory"):
        headline = f"rank {root.rank} {root.summary}{stopped}"
    else:  # one rank: the exception's own words end the line
        headline = f"rank {root.rank} raised {root.summary}" + (stopped if outcome.num_processes > 1 else "")
    return Words(headline, root.traceback)
