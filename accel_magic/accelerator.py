"""Build the notebook's Accelerator from a plan, guarding the environment traps accelerate falls into.

Private APIs of accelerate, used here only:
- `AcceleratorState._reset_state(reset_partial_state=True)`, `GradientState._reset_state()` and the
  `_shared_state` dicts of `PartialState` and `AcceleratorState` (accelerate 0.17 and later; accelerate's own
  tests use them): an Accelerator built in an earlier cell, or copied into a rank through fork, would otherwise
  fix the settings of every later one. Fallback: none; a test fails on every stack when they move.
- `accelerate.utils.imports._torch_xla_available` (accelerate 0.2x and later): whether an already imported
  accelerate has chosen XLA. Fallback: read with getattr, so a missing name means "not chosen".

Patched, not private: `accelerate.notebook_launcher` (and `accelerate.launchers.notebook_launcher`, the same
function) is wrapped from the first %accel_setup until %unload_ext, so that imports of it in between get a
launcher the notebook's own Accelerator never blocks; `restore_accelerate_launcher` puts the original back.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import sys
from collections.abc import Iterator, MutableMapping
from typing import Any

from .plan import Plan, parse_endpoint

__all__ = [
    "SetupError",
    "LazyAccelerator",
    "build_accelerator",
    "prepare_environment",
    "reset_state",
    "state_set_aside",
    "guard_accelerate_launcher",
    "restore_accelerate_launcher",
    "launcher_refusal_hint",
]

STALE_FLAGS = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")


class SetupError(RuntimeError):
    """The environment forbids the plan; the message is one sentence saying what to do."""


def _accelerate_uses_xla() -> bool:
    imports = sys.modules.get("accelerate.utils.imports")
    return bool(getattr(imports, "_torch_xla_available", False))


def prepare_environment(plan: Plan, env: MutableMapping[str, str] | None = None) -> list[str]:
    """Set what accelerate reads at import or construction; return a note per change the user should know."""
    env = os.environ if env is None else env
    notes = []
    stale = [k for k in STALE_FLAGS if k in env]
    for key in stale:
        del env[key]
    if stale:
        notes.append(f"Removed {' and '.join(stale)} left in the environment by an earlier attempt.")
    if plan.device != "xla":
        if _accelerate_uses_xla():
            raise SetupError(
                "accelerate was imported before %accel_setup on this TPU runtime and will use XLA even in CPU mode: "
                "restart the kernel and run %accel_setup before importing accelerate."
            )
        env["USE_TORCH_XLA"] = "0"  # accelerate picks XLA whenever torch_xla imports, even with cpu=True
    return notes


def reset_state() -> bool:
    """Clear accelerate's shared state so a new Accelerator can differ; True when there was state."""
    if "accelerate" not in sys.modules:
        return False
    from accelerate.state import AcceleratorState, GradientState, PartialState

    had = bool(PartialState._shared_state or AcceleratorState._shared_state)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return had


@contextlib.contextmanager
def state_set_aside() -> Iterator[None]:
    """accelerate's shared state emptied for the block and put back as it was after it: the notebook's
    Accelerator works again afterwards, and nothing the block made of accelerate's state stays."""
    if "accelerate" not in sys.modules:  # nothing to keep; what the block makes is cleared after it
        try:
            yield
        finally:
            reset_state()
        return
    from accelerate.state import AcceleratorState, GradientState, PartialState

    kept = [(cls, dict(cls._shared_state)) for cls in (PartialState, AcceleratorState, GradientState)]
    reset_state()
    try:
        yield
    finally:
        reset_state()
        for cls, state in kept:
            cls._shared_state.update(state)


_guard_plan: Plan | None = None  # the plan %accel_setup made last, which the wrapped launcher follows


def guard_accelerate_launcher(plan: Plan) -> None:
    """Wrap accelerate's notebook_launcher so that, while this extension is loaded, the notebook's Accelerator
    never blocks it (accelerate refuses to fork when its shared state is populated: the state is set aside
    for the call), and on a CPU plan the ranks it forks join one gloo group (accelerate 1.13 and later
    otherwise lets each CPU rank train alone)."""
    global _guard_plan
    import accelerate
    import accelerate.launchers as launchers

    _guard_plan = plan
    original = launchers.notebook_launcher
    if getattr(original, "_accel_magic", False):
        original = original.__wrapped__

    @functools.wraps(original)
    def notebook_launcher(*args: Any, **kwargs: Any) -> Any:
        cpu = _guard_plan is not None and _guard_plan.cpu and "ACCELERATE_USE_CPU" not in os.environ
        with state_set_aside(), _environment({"ACCELERATE_USE_CPU": "true"} if cpu else {}):
            return original(*args, **kwargs)

    notebook_launcher._accel_magic = True  # type: ignore[attr-defined]
    launchers.notebook_launcher = accelerate.notebook_launcher = notebook_launcher


# accelerate's refusal to fork while its shared state is populated (accelerate 0.x to 1.16).
LAUNCHER_REFUSAL = "the `Accelerator` should only be initialized inside your training function"


def launcher_refusal_hint(err: BaseException) -> str | None:
    """One sentence for accelerate's refusal to launch that a function imported before %accel_setup can still
    give (the wrapped launcher never does); None for any other error."""
    if not isinstance(err, ValueError) or LAUNCHER_REFUSAL not in str(err):
        return None
    return (
        "accelerate's notebook_launcher refuses to launch because an Accelerator was used in this kernel: "
        "run `from accelerate import notebook_launcher` again after %accel_setup (that one sets the notebook's "
        "Accelerator aside for the launch), or use `from accel_magic import notebook_launcher`."
    )


def restore_accelerate_launcher() -> None:
    """Put accelerate's own notebook_launcher back (on %unload_ext)."""
    global _guard_plan
    _guard_plan = None
    launchers = sys.modules.get("accelerate.launchers")
    wrapper = getattr(launchers, "notebook_launcher", None)
    if getattr(wrapper, "_accel_magic", False):
        launchers.notebook_launcher = sys.modules["accelerate"].notebook_launcher = wrapper.__wrapped__  # type: ignore[union-attr]


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    return {"cpu": plan.cpu, "mixed_precision": plan.mixed_precision}


class LazyAccelerator:
    """The notebook's Accelerator on CPU and on a multi-GPU runtime: built on first use, so until then
    accelerate's shared state stays empty (which accelerate's own notebook_launcher requires) and the kernel
    stays CUDA-free (so %%accel_train can still fork GPU ranks)."""

    def __init__(self, plan: Plan):
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_real", None)

    @property
    def built(self) -> bool:
        return self._real is not None

    def _build(self) -> Any:
        if self._real is None:
            from accelerate import Accelerator

            object.__setattr__(self, "_real", Accelerator(**accelerator_kwargs(self._plan)))
        return self._real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._build(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._build(), name, value)

    def __repr__(self) -> str:
        if self._real is not None:
            return repr(self._real)
        return f"<Accelerator on {self._plan.device}, built on first use>"


def build_accelerator(plan: Plan) -> Any:
    """The CPU-safe Accelerator for the notebook (or a LazyAccelerator when the plan says so).

    On CPU it passes ``cpu=True``; it never imports torch_xla unless the plan is XLA.
    """
    if plan.accelerator == "lazy":
        return LazyAccelerator(plan)
    from accelerate import Accelerator

    return Accelerator(**accelerator_kwargs(plan))


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def rank_environment(plan: Plan) -> dict[str, str]:
    """What a rank sets before anything reads it: CPU mode (accelerate 1.13+ otherwise lets every CPU rank
    train alone), precision, threads (so ranks do not oversubscribe the cores), gloo on loopback when every rank
    is on this machine (across machines gloo takes the interface of the host name, or GLOO_SOCKET_IFNAME), and
    whether DDP averages gradients in shared memory."""
    env = {
        "ACCELERATE_MIXED_PRECISION": plan.mixed_precision,
        "FORK_LAUNCHED": "1",
    }
    if plan.num_nodes == 1 or _loopback(parse_endpoint(plan.rdzv_endpoint)[0]):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if plan.cpu:
        env["ACCELERATE_USE_CPU"] = "true"
    if plan.device != "xla":
        env["USE_TORCH_XLA"] = "0"
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(plan.threads_per_process)
    if plan.allreduce == "shm":
        env["ACCEL_MAGIC_ALLREDUCE"] = "shm"  # launch.shm.ENV: DDP averages gradients in the launch's segment
    if plan.strategy == "fsdp":
        env["ACCELERATE_USE_FSDP"] = "true"
    elif plan.strategy == "deepspeed":
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
    return env


def rank_accelerator(plan: Plan) -> Any:
    """The fresh Accelerator a launched rank gets (always built at once: the rank may use the device)."""
    from accelerate import Accelerator

    return Accelerator(**accelerator_kwargs(plan))
