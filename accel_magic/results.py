"""Rank 0's results: packed into files in the launch's folder (in the rank), read back, checked, and applied to
the notebook name by name (in the kernel). The manifest that travels between the two is encoded and decoded here.

Patched, not private: `accelerate.Accelerator.prepare` and `Accelerator.register_for_checkpointing` are
wrapped in a rank (public API, accelerate 0.x and later) to remember what each call was given, so trained
state goes back into the notebook's own objects.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from .errors import ResultsTooLarge

__all__ = [
    "Item",
    "Skipped",
    "Packed",
    "Loaded",
    "Received",
    "ResultsTooLarge",
    "pack_results",
    "pack_payload",
    "receive_results",
    "receive_payload",
    "unpack_results",
    "track_prepare",
]

Action = Literal[
    "value",  # a value made in the rank, moved to the CPU
    "load_state",  # a notebook model, optimizer, scheduler or registered object: state loaded into it
    "keep",  # the notebook's own dataloader, which stays as it was
    "state",  # state for a notebook object the cell handed to accelerate without binding it: loaded, no name set
    "import",  # a module: imported again in the kernel
]


class Item(NamedTuple):
    """One name rank 0 sends back."""

    name: str
    action: Action
    home: str | None  # the notebook name of the object it belongs to ("keep", "load_state"), or the module
    file: str  # the file in the results folder that holds its value ("" when nothing is written)


class Skipped(NamedTuple):
    name: str
    reason: str


@dataclass(frozen=True)
class Packed:
    """The manifest rank 0 sends: per name an item, plus what could not come."""

    items: tuple[Item, ...]
    sizes: tuple[tuple[str, int], ...] = ()  # (name, bytes) of what was written
    skipped: tuple[Skipped, ...] = ()
    seconds: float = 0.0  # time rank 0 spent writing them


class Loaded(NamedTuple):
    """One item read back in the kernel, not yet applied."""

    name: str
    action: Action
    home: str | None
    value: Any


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, torch.nn.Module):
        return value.to("cpu")
    if isinstance(value, dict):  # state dicts (OrderedDict), optimizer states (nested dicts)
        items = [(k, _to_cpu(v)) for k, v in value.items()]
        try:
            return type(value)(items)
        except TypeError:  # a dict subclass with another constructor
            return dict(items)
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _reason(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text}"[:120] if text else type(err).__name__


def _too_large(sizes: list[tuple[str, int]], max_bytes: int, unmeasured: int) -> ResultsTooLarge:
    total = sum(size for _, size in sizes)
    biggest = ", ".join(f"{n} {size / 2**20:.1f} MB" for n, size in sorted(sizes, key=lambda x: -x[1])[:3])
    more = f", and {unmeasured} more not measured" if unmeasured else ""
    return ResultsTooLarge(
        f"rank 0's results total {total / 2**20:.1f} MB, over the {max_bytes / 2**20:.0f} MB limit "
        f"(biggest: {biggest}{more}): return fewer names with --return, use --no-return, or raise --max-return-mb"
    )


def pack_results(
    ns: Mapping[str, Any],
    names: Iterable[str],
    prepared: Mapping[int, Any],
    notebook: Mapping[int, tuple[str, Any]],
    folder: str,
    max_bytes: int = 2**62,
    registered: Iterable[Any] = (),
) -> Packed:
    """Write rank 0's results into `folder`, one file per name (torch.save: tensors travel as plain bytes,
    never as file-descriptor-shared storage), and return the manifest.

    ``prepared`` maps id(what accelerator.prepare returned) to what it was given; ``registered`` holds what
    the cell passed to accelerator.register_for_checkpointing; ``notebook`` maps id(object) to (its name in
    the notebook before the launch, the object): fork keeps identities, and holding the objects keeps their ids
    from being reused in the rank. Models, optimizers, LR schedulers and registered objects that came from the
    notebook go back as state to load into the notebook's own objects, whether or not the cell binds a name to
    them; its dataloaders stay as they were; everything else the names hold is moved to the CPU. Raises
    ResultsTooLarge past `max_bytes`.
    """

    started = time.perf_counter()
    names = [n for n in names if n in ns]
    registered_ids = {id(obj) for obj in registered}
    items: list[Item] = []
    sizes: list[tuple[str, int]] = []
    skipped: list[Skipped] = []

    def home_of(original: Any) -> str | None:
        name_and_object = notebook.get(id(original))
        return name_and_object[0] if name_and_object is not None and name_and_object[1] is original else None

    def stateful(original: Any) -> bool:
        return isinstance(original, _stateful_types()) or id(original) in registered_ids

    def write(name: str, value: Callable[[], Any], path: str, action: Action, home: str | None, left: int) -> None:
        try:
            _save(_to_cpu(value()), path)
        except MemoryError:
            raise  # not a property of one value: the sending itself failed
        except Exception as err:
            with contextlib.suppress(OSError):
                os.remove(path)
            skipped.append(Skipped(name, _reason(err)))
            return
        items.append(Item(name, action, home, os.path.basename(path)))
        sizes.append((name, os.path.getsize(path)))
        if sum(size for _, size in sizes) > max_bytes:
            raise _too_large(sizes, max_bytes, left)

    handed = list({id(obj): obj for obj in [*prepared.values(), *registered]}.values())
    for index, name in enumerate(names):
        value = ns[name]
        if type(value).__name__ in ("Accelerator", "LazyAccelerator"):
            continue
        if isinstance(value, types.ModuleType):
            items.append(Item(name, "import", value.__name__, ""))
            continue
        original = prepared.get(id(value), value)
        home = home_of(original)
        left = len(names) - index - 1 + len(handed)
        if home is not None and stateful(original):
            write(name, original.state_dict, os.path.join(folder, f"item-{index}"), "load_state", home, left)
        elif home is not None and original is not value:
            items.append(Item(name, "keep", home, ""))  # the notebook's own dataloader
        else:
            write(name, lambda v=original: v, os.path.join(folder, f"item-{index}"), "value", None, left)
    loaded = {item.home for item in items if item.action == "load_state"} | {s.name for s in skipped}
    for index, original in enumerate(handed):  # what went through prepare or registration, bound or not
        home = home_of(original)
        if home is not None and home not in loaded and stateful(original):
            loaded.add(home)
            path = os.path.join(folder, f"state-{index}")
            write(home, original.state_dict, path, "state", home, len(handed) - index - 1)
    return Packed(tuple(items), tuple(sizes), tuple(skipped), time.perf_counter() - started)


def pack_payload(*args: Any, **kwargs: Any) -> bytes:
    """pack_results, with the manifest pickled: what rank 0's body returns to the launcher."""
    return pickle.dumps(pack_results(*args, **kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def _save(value: Any, path: str) -> None:
    """torch.save without the zip checksums: the file lives for one launch, in a private folder."""
    import torch
    from torch import serialization

    set_crc = getattr(serialization, "set_crc32_options", None)
    if set_crc is not None:
        set_crc(False)
    torch.save(value, path)


def _stateful_types() -> tuple[type, ...]:
    import torch
    from torch.optim import lr_scheduler

    schedulers = (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau)  # the latter's base before torch 2.2
    return (torch.nn.Module, torch.optim.Optimizer, *schedulers)


@dataclass(frozen=True)
class Received:
    """Rank 0's results read back into the kernel, not yet applied."""

    items: tuple[Loaded, ...]
    skipped: tuple[Skipped, ...]
    seconds: dict[str, float]  # "send" (in rank 0) and "receive" (in the kernel)


def receive_results(packed: Packed, folder: str) -> Received:
    """Load every item the rank wrote (before the folder is removed); what cannot load is listed."""
    import torch

    started = time.perf_counter()
    items: list[Loaded] = []
    skipped = list(packed.skipped)
    for name, action, home, filename in packed.items:
        try:
            # mmap: a state is then copied once, straight from the file into the notebook's parameters
            path = os.path.join(folder, filename)
            value = torch.load(path, map_location="cpu", weights_only=False, mmap=True) if filename else None
        except Exception as err:
            skipped.append(Skipped(name, _reason(err)))
            continue
        items.append(Loaded(name, action, home, value))
    return Received(tuple(items), tuple(skipped), {"send": packed.seconds, "receive": time.perf_counter() - started})


def receive_payload(payload: bytes, folder: str) -> Received:
    """receive_results of the pickled manifest that pack_payload made."""
    return receive_results(pickle.loads(payload), folder)


_NO_BINDING = object()


def unpack_results(received: Received, ns: Mapping[str, Any]) -> tuple[Callable[..., list[str]], list[Skipped]]:
    """Decide everything the notebook will take, without changing it. Returns (apply, skipped): apply() makes
    every change, name by name."""
    steps: list[tuple[str, Any, Any, Any]] = []  # (name, object to load state into or None, state, binding)
    skipped = list(received.skipped)
    for name, action, home, value in received.items:
        try:
            if action == "keep":
                steps.append((name, None, None, ns[home]))
            elif action == "import":
                steps.append((name, None, None, importlib.import_module(home)))
            elif action in ("load_state", "state"):
                target = ns[home]
                _check_state(target, value)
                steps.append((name, target, value, target if action == "load_state" else _NO_BINDING))
            else:
                steps.append((name, None, None, value))
        except Exception as err:
            skipped.append(Skipped(name, _reason(err)))

    def apply(stop: Callable[[], bool] = lambda: False) -> list[str]:
        """Load each state and bind each name, one name at a time; `stop()`, asked before each, leaves the rest
        as they were. Returns the names applied."""
        applied = []
        for name, target, state, binding in steps:
            if stop():
                break
            if target is not None:
                target.load_state_dict(state)
            if binding is not _NO_BINDING:
                ns[name] = binding  # type: ignore[index]
            applied.append(name)
        return applied

    return apply, skipped


def _check_state(target: Any, state: Mapping[str, Any]) -> None:
    """Refuse a state that would fail half-way through load_state_dict."""
    import torch

    if isinstance(target, torch.nn.Module):
        mine = target.state_dict()
        if set(mine) != set(state):
            raise ValueError("the model's parameters changed shape or names in the cell")
        for key, tensor in state.items():
            if getattr(mine[key], "shape", None) != getattr(tensor, "shape", None):
                raise ValueError(f"{key} changed shape in the cell")
    elif isinstance(target, torch.optim.Optimizer):
        groups = state.get("param_groups", ())
        if [len(g["params"]) for g in target.param_groups] != [len(g.get("params", ())) for g in groups]:
            raise ValueError("the optimizer's parameter groups changed in the cell")


def track_prepare(prepared: dict[int, Any], registered: list[Any]) -> None:
    """Remember what each accelerator.prepare call was given, by the id of what it returned, and what
    accelerator.register_for_checkpointing was given (rank only)."""
    from accelerate import Accelerator

    original = Accelerator.prepare
    if getattr(original, "_accel_magic", False):
        original = original.__wrapped__
    original_register = Accelerator.register_for_checkpointing
    if getattr(original_register, "_accel_magic", False):
        original_register = original_register.__wrapped__

    def register_for_checkpointing(self: Any, *objects: Any) -> Any:
        result = original_register(self, *objects)
        registered.extend(objects)
        return result

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        outputs = result if isinstance(result, tuple) else (result,)
        for given, returned in zip(args, outputs, strict=False):
            prepared[id(returned)] = given
            prepared.setdefault(id(given), given)
            _keep.append((given, returned))  # ids stay valid while the rank lives
        return result

    for wrapper, wrapped in ((prepare, original), (register_for_checkpointing, original_register)):
        wrapper.__wrapped__ = wrapped  # type: ignore[attr-defined]
        wrapper._accel_magic = True  # type: ignore[attr-defined]
    Accelerator.prepare = prepare  # type: ignore[method-assign]
    Accelerator.register_for_checkpointing = register_for_checkpointing  # type: ignore[method-assign]


_keep: list[Any] = []
