"""Every error a user can see, and the one way it shows: `_render_traceback_`, which IPython calls instead of
printing a traceback (and which a rank reads as "worded for the user: no traceback"). A OneSentence says what to
do in one sentence; a LaunchError names the rank where a failure started, with that rank's traceback; a
LaunchInterrupted is one line. The words of a launch's failure come from `launch.outcome` (`failure_words`,
`interrupted_words`); this module imports nothing of the package at run time."""

from __future__ import annotations

import functools
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .launch.outcome import LaunchOutcome

__all__ = [
    "error_line",
    "OneSentence",
    "PlanError",
    "CellError",
    "SetupError",
    "ExportError",
    "TrainError",
    "LauncherError",
    "ResultsTooLarge",
    "LaunchError",
    "LaunchInterrupted",
    "ranks_failed",
    "processes_failed",
]


def error_line(kind: str, message: str) -> str:
    """The first line of an error as IPython shows it: the exception's name in red, then the message."""
    return f"\x1b[0;31m{kind}\x1b[0m: {message}"


class OneSentence(Exception):
    """An error whose message is one sentence saying what to do; IPython shows that sentence alone."""

    def _render_traceback_(self) -> list[str]:
        return [error_line(type(self).__name__, str(self))]


class PlanError(OneSentence, ValueError):
    """A request that cannot be honoured here."""


class CellError(OneSentence, ValueError):
    """The cell cannot run."""


class SetupError(OneSentence, RuntimeError):
    """The environment forbids the plan."""


class ExportError(OneSentence, ValueError):
    """The cell cannot be exported."""


class TrainError(OneSentence, RuntimeError):
    """The launch cannot start here."""


class LauncherError(OneSentence, ValueError):
    """An argument notebook_launcher or torch's spawn cannot honour here (a ValueError, as they raise for bad
    arguments)."""


class ResultsTooLarge(OneSentence):
    """Rank 0's results exceed the limit; the message names the biggest."""


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


@functools.cache
def _processes_failed_type(exited: bool) -> type[LaunchError]:
    """LaunchError that is also torch.multiprocessing's ProcessExitedException (a process that ended without
    raising) or ProcessRaisedException (one that raised), as torch's spawn raises."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    class ProcessesFailed(LaunchError, ProcessExitedException if exited else ProcessRaisedException):
        __doc__ = LaunchError.__doc__

    ProcessesFailed.__name__ = ProcessesFailed.__qualname__ = "LaunchError"
    return ProcessesFailed


def processes_failed(err: LaunchError) -> LaunchError:
    """The failure of torch's spawn run by the launcher: the same words, as torch's exception for the process
    where it started (`error_index`, `error_pid`; `exit_code` and `signal_name` for one that did not raise)."""
    outcome = err.outcome
    root = outcome.root_cause() if outcome is not None else None
    if root is None:
        return err
    exited = root.kind in ("exit", "signal", "memory")
    failed = _processes_failed_type(exited)(err.headline, err.details, outcome)
    failed.error_index, failed.error_pid = root.rank, outcome.pids.get(root.rank)  # type: ignore[attr-defined,union-attr]
    if exited:
        code = root.exitcode
        failed.exit_code = code  # type: ignore[attr-defined]
        failed.signal_name = signal.Signals(-code).name if code is not None and code < 0 else None  # type: ignore[attr-defined]
    return failed


# Front ends and notebooks name an error by its class (the reply's ename): this one is a KeyboardInterrupt to them.
LaunchInterrupted.__name__ = LaunchInterrupted.__qualname__ = "KeyboardInterrupt"
