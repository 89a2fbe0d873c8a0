"""What a launch will need in memory beyond what it shares with the kernel, estimated before it starts from the
notebook's models and optimizers that the code it runs uses, and the sentence that says so when that is much of
what is available.

Each forked rank comes to hold its own copy of the weights and buffers it writes (copy-on-write pages of the
kernel's), its gradients, its optimizer's state and the temporaries of its step (the largest parameter twice over),
DDP's gradient buckets, and the pages of the kernel's heap it writes as Python and torch run (reference counts, the
collector's marks, the allocator's arenas: measured at about BASE_SHARE of the kernel's own private memory less
those tensors). The ranks together share the launch's segment of gradient averages in shared memory, when they
use one. A cell that runs in the kernel (`-n 1`) adds only its gradients, its optimizer's state and the step's
temporaries. Activations depend on the batch and are not counted, nor are modules imported for the first time:
`make bench` sets the estimate against the measured peak.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import CodeType, FunctionType, ModuleType
from typing import Any

__all__ = ["Footprint", "used_objects", "used_by", "estimate", "kernel_private", "fit_words", "banner_line"]

BASE_SHARE = 0.35  # of the kernel's private memory, which a forked rank comes to write (bench: footprint)
# Tensors of state each optimizer keeps per parameter (torch.optim); one that is not listed is taken as Adam's 2.
STATE_PER_PARAMETER = {"SGD": 0, "Adagrad": 1, "Adadelta": 2, "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2,
                       "RAdam": 2, "RMSprop": 1, "Rprop": 2, "ASGD": 1, "SparseAdam": 2, "Adafactor": 1}  # fmt: skip
DEPTH = 3  # how deep the notebook's functions, containers and objects that the code reads are followed
ITEMS = 64  # the items of a container, or attributes of an object, looked at


@dataclass(frozen=True)
class Footprint:
    """Bytes: what each rank adds (`per_rank`), what the ranks share among themselves (`shared`), for
    `num_processes` ranks; `in_kernel` when the code runs in the kernel itself."""

    num_processes: int
    per_rank: int
    shared: int = 0
    in_kernel: bool = False

    @property
    def total(self) -> int:
        return self.num_processes * self.per_rank + self.shared


def _names(code: CodeType) -> Iterable[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _names(const)


def used_objects(code: CodeType | None, namespace: Mapping[str, Any], args: Iterable[Any] = ()) -> list[Any]:
    """The torch models and optimizers that `code` reads from `namespace` (or is given in `args`), directly or
    through the notebook's functions it calls, the lists and dicts it reads, and the public attributes of the
    objects it reads (a Trainer's model), each once."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found: dict[int, Any] = {}
    seen: set[int] = set()

    def visit(value: Any, depth: int) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            found[id(value)] = value
        elif isinstance(value, FunctionType) and depth < DEPTH and value.__globals__ is namespace:
            for name in set(_names(value.__code__)):
                if name in namespace:
                    visit(namespace[name], depth + 1)
        elif isinstance(value, (list, tuple, dict)) and depth < DEPTH:
            for item in itertools.islice(value.values() if isinstance(value, dict) else value, ITEMS):
                visit(item, depth + 1)
        elif depth < DEPTH - 1 and not isinstance(value, (type, ModuleType)) and hasattr(value, "__dict__"):
            for key, item in list(vars(value).items())[:ITEMS]:  # a Trainer's model and optimizer
                if not key.startswith("_"):
                    visit(item, depth + 1)

    for name in set(_names(code)) if code is not None else ():
        if name in namespace:
            visit(namespace[name], 0)
    for arg in args:
        visit(arg, 0)
    return list(found.values())


def used_by(function: Any, args: Iterable[Any] = ()) -> list[Any]:
    """The torch models and optimizers a launched function uses: from its module's names, and its arguments."""
    return used_objects(getattr(function, "__code__", None), getattr(function, "__globals__", {}), args)


def _nbytes(tensors: Iterable[Any]) -> int:
    unique = {id(t): t for t in tensors if t is not None}
    return sum(t.numel() * t.element_size() for t in unique.values())


def _held(optimizer: Any) -> int:
    """Bytes of the state tensors the optimizer holds already."""
    return _nbytes(v for state in optimizer.state.values() for v in state.values() if hasattr(v, "element_size"))


def _optimizer_state(optimizer: Any) -> int:
    """Bytes of state the optimizer will hold: what it holds already, or what its kind keeps per parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per = STATE_PER_PARAMETER.get(type(optimizer).__name__, 2)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if type(optimizer).__name__ == "SGD" and group.get("momentum"):
        per = 1
    per += (
        bool(group.get("amsgrad"))
        + bool(group.get("centered"))
        + (type(optimizer).__name__ == "RMSprop" and bool(group.get("momentum")))
    )
    return max(_held(optimizer), per * _nbytes(params))


def estimate(
    objects: Iterable[Any], num_processes: int, *, in_kernel: bool, shared_memory: bool, kernel_private: int
) -> Footprint:
    """The footprint of training `objects` (models and optimizers) as `num_processes` forked ranks, or in the
    kernel; `shared_memory` when the ranks average gradients in a shared segment; `kernel_private`: the kernel's
    private memory, in bytes."""
    objects = list(objects)
    models = [o for o in objects if hasattr(o, "parameters") and hasattr(o, "buffers")]
    optimizers = [o for o in objects if hasattr(o, "param_groups")]
    params = {id(p): p for m in models for p in m.parameters()}
    params.update({id(p): p for o in optimizers for group in o.param_groups for p in group["params"]})
    trainable = _nbytes(p for p in params.values() if p.requires_grad)
    gradients = trainable - _nbytes(p for p in params.values() if p.requires_grad and p.grad is not None)
    held = sum(_held(o) for o in optimizers)
    state = sum(_optimizer_state(o) for o in optimizers)
    largest = max((_nbytes([p]) for p in params.values() if p.requires_grad), default=0)
    step = 2 * largest if optimizers else 0
    if in_kernel:
        return Footprint(1, gradients + state - held + step, in_kernel=True)
    weights = _nbytes(params.values()) + _nbytes(b for m in models for b in m.buffers())
    buckets = trainable if num_processes > 1 else 0
    heap = max(kernel_private - weights - held - (trainable - gradients), 0)  # less the tensors counted above
    per_rank = weights + trainable + state + step + buckets + int(BASE_SHARE * heap)
    shared = (num_processes + 1) * trainable if shared_memory and num_processes > 1 else 0
    return Footprint(num_processes, per_rank, shared)


def kernel_private() -> int:
    """This process's private memory (Private_Clean and Private_Dirty of /proc/self/smaps_rollup), in bytes; 0
    where that is not read."""
    total = 0
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith((b"Private_Clean:", b"Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**29 else f"{n / 2**20:.0f} MiB"


def fit_words(footprint: Footprint, available: int | None, strict: bool) -> str:
    """The sentence a launch that will need more than is available says before it starts (or refuses with,
    under --strict); "" when it fits or nothing is known of what is available."""
    if available is None or footprint.total <= available:
        return ""
    if footprint.in_kernel:
        who, beyond, advice = "This cell", "", "try a smaller batch or bf16 mixed precision"
        risk, stopped = "the kernel may run out of memory and restart, losing the notebook's variables", "nothing ran"
    else:
        who = "The rank" if footprint.num_processes == 1 else f"The {footprint.num_processes} ranks"
        beyond, advice = (
            " beyond what they share with the kernel",
            "try fewer ranks, a smaller batch or bf16 mixed precision",
        )
        risk, stopped = "a rank may be killed for memory", "nothing was launched"
    then = f"{stopped} (without --strict it would start anyway)" if strict else risk
    need, have = _gib(footprint.total), _gib(available)
    return f"{who} will need about {need}{beyond}, more than the {have} available: {then}; {advice}."


def banner_line(footprint: Footprint, available: int | None) -> str:
    """The banner's line when the launch will need more than half of what is available; "" else."""
    if available is None or footprint.total * 2 <= available:
        return ""
    return f"memory: about {_gib(footprint.total)} needed beyond the kernel's, of {_gib(available)} available"
