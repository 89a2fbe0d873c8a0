"""torch.multiprocessing's `spawn` and `start_processes`, called in the kernel with a function defined in the
notebook, run by the launcher: `fn(i, *args)` in `nprocs` forked processes (nothing pickled, whatever the start
method), each one's output in the cell, the function's own init_process_group on its MASTER_ADDR/MASTER_PORT,
one error that is torch's exception for the process where a failure started, one line for an interrupt, and
nothing left behind. Anywhere else (a function from a module, another thread, a forked child, a rank, after
%unload_ext) torch's own functions run.

Patched, not private: `torch.multiprocessing.spawn` and `start_processes` (the names in torch.multiprocessing,
in its `spawn` module and in the notebook) are wrapped from the first cell that runs once torch.multiprocessing
is imported, or that names it, until %unload_ext (`install`, `restore`); a forked child gets torch's own back.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from .accelerator import join_uneven_inputs_on_cpu, reset_state
from .display import write_rank_text
from .errors import LauncherError, LaunchError, TrainError, processes_failed
from .footprint import used_by
from .jobs import refuse_while_running
from .launch import Hooks, forks
from .launch.relay import publish_kernel_message
from .launcher import plan_here
from .plan import Request
from .session import current, existing
from .train import FrontDoor, describe, function_source, launch_plan

__all__ = ["SpawnBody", "install", "restore", "hook", "unhook"]

MODULES = ("torch.multiprocessing", "torch.multiprocessing.spawn")
NAMES = ("spawn", "start_processes")


class SpawnBody:
    """What each process runs: the function with its index and arguments. Nothing comes back: torch's spawn
    returns None."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.function, self.args, self.index = function, args, 0

    def setup(self, rank: int) -> None:
        reset_state()  # an Accelerator the function builds starts from nothing, as in a spawned process
        if "accelerate" in sys.modules:
            join_uneven_inputs_on_cpu()
        self.index = rank

    def run(self) -> None:
        self.function(self.index, *self.args)

    def uses(self) -> list[Any]:
        """The notebook's models and optimizers the function uses."""
        return used_by(self.function, self.args)

    def results(self, rank: int, folder: str) -> bytes | None:
        return None


def defined_in_notebook(function: Any) -> bool:
    """A function of the notebook's (torch's spawn pickles it by a name that its processes do not have)."""
    function = getattr(function, "func", function)  # functools.partial
    return getattr(function, "__module__", None) == "__main__"


def _nprocs(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LauncherError(f"nprocs must be a whole number of at least 1, not {value!r}.")
    return value


def run_spawn(
    name: str, function: Callable[..., Any], args: tuple[Any, ...], nprocs: Any, join: bool, options: dict[str, Any]
) -> None:
    """torch.multiprocessing.`name`(function, args, nprocs, join) run by the launcher in the foreground."""
    if not join:
        raise LauncherError(
            f"{name}(join=False) is not supported here: accel_magic runs the processes until they end and shows "
            "their output in the cell, so call it with join=True (the default)."
        )
    given = sorted(k for k, v in options.items() if v is not None)
    if given:
        raise LauncherError(
            f"{name}'s {', '.join(given)} is not supported here: accel_magic forks the processes itself; leave it out."
        )
    refuse_while_running()
    n = _nprocs(nprocs)
    plan = plan_here(Request(num_processes=n, cpu=True, allreduce="gloo"))
    blocker = forks.cuda_fork_blocker() if plan.runtime.gpu_count else None
    if blocker:
        raise TrainError(
            f"{blocker}, so the processes of {name} cannot be forked: restart the kernel and keep CUDA work inside "
            "the function."
        )
    filename = getattr(getattr(function, "__code__", None), "co_filename", "")
    spec = describe(
        SpawnBody(function, tuple(args)),
        plan,
        filename=filename,
        port=None,
        hooks=Hooks(write_rank_text, publish_kernel_message),
    )
    env = {"OMP_NUM_THREADS": str(plan.threads_per_process)} if "OMP_NUM_THREADS" not in os.environ else {}
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # every process is on this machine
    spec = replace(spec, ranks=replace(spec.ranks, group=False, env=MappingProxyType(env)))
    threads = plan.threads_per_process
    banner = [
        f"torch.multiprocessing.{name}: {n} process{'es' if n != 1 else ''} forked by accel_magic, {threads} "
        f"thread{'s' if threads != 1 else ''} each; the function makes its own process group"
    ]
    door = FrontDoor(source=function_source(function, filename), banner="\n".join(banner + list(plan.notes)))
    try:
        launch_plan(spec, plan, door)
    except LaunchError as err:
        raise processes_failed(err) from None


def _wrapper(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    kernel = os.getpid()

    @functools.wraps(original)
    def wrapper(
        fn: Any,
        args: tuple[Any, ...] = (),
        nprocs: int = 1,
        join: bool = True,
        daemon: bool = False,
        start_method: str = "spawn",
        **options: Any,
    ) -> Any:
        if os.getpid() != kernel or threading.current_thread() is not threading.main_thread():
            return original(fn, args, nprocs, join, daemon, start_method, **options)
        if not defined_in_notebook(fn):
            return original(fn, args, nprocs, join, daemon, start_method, **options)
        return run_spawn(name, fn, args, nprocs, join, options)

    wrapper._accel_magic = True  # type: ignore[attr-defined]
    return wrapper


def install(namespace: dict[str, Any] | None = None) -> bool:
    """Wrap torch's spawn and start_processes where torch.multiprocessing and the notebook's `namespace` bind
    them, once torch.multiprocessing is imported; whether they are wrapped now."""
    session = current()
    if session.spawn_patched:
        return True
    if "torch.multiprocessing" not in sys.modules:
        return False
    import torch.multiprocessing.spawn  # noqa: F401  (the module, which holds the functions too)

    originals = [getattr(sys.modules["torch.multiprocessing"], name) for name in NAMES]
    wrappers = [_wrapper(name, original) for name, original in zip(NAMES, originals, strict=True)]
    spaces = [vars(sys.modules[m]) for m in MODULES] + ([namespace] if namespace is not None else [])
    for space in spaces:
        for name, value in list(space.items()):
            for original, wrapper in zip(originals, wrappers, strict=True):
                if value is original:
                    space[name] = wrapper
                    session.spawn_patched.append((space, name, original))
    _at_fork_once()
    return True


def restore() -> None:
    """Put torch's own functions back wherever `install` wrapped them (on %unload_ext; in a forked child)."""
    session = existing()
    if session is None:
        return
    for space, name, original in session.spawn_patched:
        if getattr(space.get(name), "_accel_magic", False):
            space[name] = original
    session.spawn_patched.clear()


@functools.cache
def _at_fork_once() -> None:
    os.register_at_fork(after_in_child=restore)  # a rank, a DataLoader worker: torch's own functions


def _before_cell(info: Any = None) -> None:
    """pre_run_cell: wrap torch's functions once torch.multiprocessing is imported, or before a cell that names
    it runs (the cell may import it and call spawn at once)."""
    shell = current().spawn_hooked
    if current().spawn_patched or shell is None:
        return
    if "torch.multiprocessing" not in sys.modules and "torch.multiprocessing" in getattr(info, "raw_cell", ""):
        try:
            import torch.multiprocessing  # noqa: F401
        except ImportError:
            return
    install(shell.user_ns)


def hook(shell: Any) -> None:
    """From %load_ext: wrap torch's functions now if torch.multiprocessing is imported, else before the first cell
    that runs once it is, or that names it."""
    session = current()
    if session.spawn_hooked is None:
        shell.events.register("pre_run_cell", _before_cell)
        session.spawn_hooked = shell
    install(shell.user_ns)


def unhook() -> None:
    """On %unload_ext: torch's own functions back, and no more wrapping."""
    session = existing()
    if session is None:
        return
    restore()
    if session.spawn_hooked is not None:
        try:
            session.spawn_hooked.events.unregister("pre_run_cell", _before_cell)
        except ValueError:
            pass
        session.spawn_hooked = None
