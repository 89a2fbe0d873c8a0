"""Build the notebook's Accelerator from a plan, guarding the environment traps accelerate falls into.

Private APIs of accelerate, used here only:
- `AcceleratorState._reset_state(reset_partial_state=True)`, `GradientState._reset_state()` and the
  `_shared_state` dicts of `PartialState` and `AcceleratorState` (accelerate 0.17 and later; accelerate's own
  tests use them): an Accelerator built in an earlier cell, or copied into a rank through fork, would otherwise
  fix the settings of every later one. Fallback: none; a test fails on every stack when they move.
- `Accelerator._dataloaders` (accelerate 0.1x and later): the loaders whose `even_batches`
  `join_uneven_inputs(even_batches=...)` overrides on CPU ranks, as accelerate does on GPUs. Fallback: none; the
  kernel test that runs accelerate's `test_distributed_data_loop` fails when it moves.
- `accelerate.utils.imports._torch_xla_available` (accelerate 0.2x and later): whether an already imported
  accelerate has chosen XLA. Fallback: read with getattr, so a missing name means "not chosen".

Patched, not private: `Accelerator.join_uneven_inputs` (accelerate 0.1x and later), in a rank only, so that it
does on CPU ranks what it does on GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import ipaddress
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from .errors import SetupError
from .plan import Plan, parse_endpoint

__all__ = [
    "SetupError",
    "lazy_accelerator_class",
    "build_accelerator",
    "prepare_environment",
    "reset_state",
    "state_set_aside",
    "rank_state",
    "join_uneven_inputs_on_cpu",
]

STALE_FLAGS = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP")


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


def join_uneven_inputs_on_cpu() -> None:
    """accelerate's `join_uneven_inputs` does nothing unless the ranks are GPUs (its `multi_device`), although
    torch's `Join` works on gloo: on MULTI_CPU ranks it does here what it does on GPUs (the same steps)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    original = Accelerator.join_uneven_inputs
    if getattr(original, "on_cpu", False):
        return

    @contextlib.contextmanager
    def join_uneven_inputs(self: Any, joinables: Any, even_batches: bool | None = None) -> Iterator[None]:
        if self.multi_device or not self.use_distributed or self.distributed_type != DistributedType.MULTI_CPU:
            with original(self, joinables, even_batches=even_batches):
                yield
            return
        from accelerate.data_loader import DataLoaderDispatcher
        from torch.distributed.algorithms import Join

        kept = []
        if even_batches is None:
            even_batches = self.even_batches
        else:
            for loader in self._dataloaders:
                if isinstance(loader, DataLoaderDispatcher):
                    warnings.warn(
                        "Overriding even_batches is only supported for map-style datasets, yet some dataloaders "
                        "given were iterable",
                        stacklevel=3,
                    )
                    continue
                kept.append((loader, loader.batch_sampler.even_batches))
                loader.batch_sampler.even_batches = even_batches
        try:
            with Join(joinables, enable=not even_batches, throw_on_early_termination=False):
                yield
        finally:
            for loader, value in kept:
                loader.batch_sampler.even_batches = value

    join_uneven_inputs.on_cpu = True  # type: ignore[attr-defined]
    Accelerator.join_uneven_inputs = join_uneven_inputs  # type: ignore[method-assign]


def rank_state(plan: Plan) -> Any:
    """In a launched rank, before its code runs: accelerate's PartialState made from the launch's process group
    on the plan's device, so that whatever the code builds first (`PartialState()`, `Accelerator()`,
    `TrainingArguments(...)`) joins that group; on CPU a bare `PartialState()` would otherwise say NO, and every
    later Accelerator would inherit it."""
    from accelerate.state import PartialState

    return PartialState(cpu=plan.cpu)


def accelerator_kwargs(plan: Plan) -> dict[str, Any]:
    return {"cpu": plan.cpu, "mixed_precision": plan.mixed_precision}


# Looked up by front ends on whatever they display or inspect: answered by the notebook's accelerator once it is
# built, and by nothing before (displaying or inspecting it must not build it).
_PROBED = ("_repr_", "_ipython_", "getdoc")


def _deferred(lazy: Any, name: str, method: types.FunctionType) -> Callable[..., Any]:
    """`lazy.name`, a method of Accelerator, as a function that builds the accelerator when called."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(lazy._build(), name)(*args, **kwargs)

    call.__wrapped__ = types.MethodType(method, lazy)  # type: ignore[attr-defined]  # its signature, without self
    return call


@functools.cache
def lazy_accelerator_class() -> type:
    """`LazyAccelerator`, a subclass of accelerate's `Accelerator` (made when accelerate is imported): the
    notebook's Accelerator on CPU and on a multi-GPU runtime, built on first use, so until then accelerate's shared
    state stays empty (which accelerate's own notebook_launcher requires) and the kernel stays CUDA-free (so
    %%accel_train can still fork GPU ranks). To `isinstance`, `dir`, `help()`, `accelerator?` and completion it is
    an Accelerator, and none of them builds it."""
    from accelerate import Accelerator

    class LazyAccelerator(Accelerator):
        __doc__ = Accelerator.__doc__

        def __init__(self, plan: Plan):  # accelerate's __init__ runs in the real one, on first use
            object.__setattr__(self, "_plan", plan)
            object.__setattr__(self, "_real", None)

        @property
        def built(self) -> bool:
            return object.__getattribute__(self, "_real") is not None

        def _build(self) -> Any:
            if object.__getattribute__(self, "_real") is None:
                plan = object.__getattribute__(self, "_plan")
                object.__setattr__(self, "_real", Accelerator(**accelerator_kwargs(plan)))
            return object.__getattribute__(self, "_real")

        def __getattribute__(self, name: str) -> Any:
            if name.startswith("__") or name in ("built", "_build", "_plan", "_real"):
                return object.__getattribute__(self, name)
            if not object.__getattribute__(self, "built"):
                if name.startswith(_PROBED):
                    raise AttributeError(name)
                method = inspect.getattr_static(Accelerator, name, None)
                if isinstance(method, types.FunctionType):  # completion looks methods up: they build when called
                    return _deferred(self, name, method)
            return getattr(object.__getattribute__(self, "_build")(), name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(self._build(), name, value)

        def __dir__(self) -> list[str]:
            real = object.__getattribute__(self, "_real")
            return sorted(set(dir(Accelerator)) | (set(dir(real)) if real is not None else set()))

        def __repr__(self) -> str:
            real = object.__getattribute__(self, "_real")
            if real is not None:
                return repr(real)
            return f"<Accelerator on {object.__getattribute__(self, '_plan').device}, built on first use>"

    return LazyAccelerator


def build_accelerator(plan: Plan) -> Any:
    """The CPU-safe Accelerator for the notebook (or a LazyAccelerator when the plan says so).

    On CPU it passes ``cpu=True``; it never imports torch_xla unless the plan is XLA.
    """
    if plan.accelerator == "lazy":
        return lazy_accelerator_class()(plan)
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
