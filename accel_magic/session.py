"""What the extension keeps for its kernel between cells, in one object: made on first use (%load_ext, or the
drop-in launcher imported alone), dropped on %unload_ext."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import Job
    from .plan import Plan

__all__ = ["Session", "current", "existing", "drop"]


@dataclass
class Session:
    """The kernel's state of the extension."""

    env_set: set[str] = field(default_factory=set)  # environment variables the extension set, removed on unload
    hint_shell: Any = None  # the shell whose ValueErrors are shown with the launcher's hint
    setup_plan: Plan | None = None  # the plan %accel_setup made last: launches keep its --cpu
    panel_shown: tuple[int, int] | None = None  # (plan id, execution count) of the panel the magic showed
    last_job: Job | None = None  # the latest background launch; its results wait for the next cell once it ended
    hooked: Any = None  # the shell whose pre_run_cell event applies them
    spawn_hooked: Any = None  # the shell whose pre_run_cell event wraps torch's spawn (spawn.hook)
    # where torch's spawn and start_processes were wrapped: (namespace, name, torch's function)
    spawn_patched: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)


_current: Session | None = None


def current() -> Session:
    """The kernel's session, made on first use."""
    global _current
    if _current is None:
        _current = Session()
    return _current


def existing() -> Session | None:
    """The kernel's session, if the extension made one."""
    return _current


def drop() -> Session | None:
    """Forget the session (on unload); the one dropped, for the caller to undo what it holds."""
    global _current
    dropped, _current = _current, None
    return dropped
