"""A rank's own `torch.distributed.init_process_group(...)` and `destroy_process_group(...)`. Where the launch made
the group, the call adopts it as long as its arguments agree with it, instead of failing with "trying to initialize
the default process group twice", and arguments that disagree end in one sentence naming the launch's values.
Where the function makes its own group (torch's spawn), a MASTER_PORT that another program holds is said in one
sentence. A group the rank destroys is freed when the rank ends, never while its code runs."""

from __future__ import annotations

import inspect
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["adopt_init_process_group", "word_taken_port", "keep_destroyed_groups"]

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl", "xla", "undefined")


def _backends(backend: Any) -> set[str]:
    """The backends a `backend` argument asks for: "gloo", or each of "cpu:gloo,cuda:nccl"."""
    parts = [p.split(":")[-1].strip().lower() for p in str(backend).split(",")]
    return {p for p in parts if p}


def disagreement(args: dict[str, Any], backend: str, world_size: int, rank: int) -> str | None:
    """What in the call's arguments differs from the launch's group, worded for the user, or None."""
    group = f"this launch's process group has {world_size} ranks on {backend} and this process is rank {rank}"
    asked = args.get("backend")
    if asked is not None and backend not in _backends(asked) and "undefined" not in _backends(asked):
        return f"init_process_group(backend={asked!r}) does not match: {group}; leave backend out or pass {backend!r}"
    if args.get("world_size", -1) not in (-1, None, world_size):
        ws = args["world_size"]
        return (
            f"init_process_group(world_size={ws!r}) does not match: {group}; leave world_size out or pass {world_size}"
        )
    if args.get("rank", -1) not in (-1, None, rank):
        return (
            f"init_process_group(rank={args['rank']!r}) does not match: {group}; leave rank out or pass "
            "int(os.environ['RANK'])"
        )
    return None


def adopt_init_process_group(backend: str, note: Callable[[str], None]) -> None:
    """From now on in this process, the first init_process_group while the launch's group is up checks its
    arguments against the group and adopts it (rank 0 gives `note` one line); after that, or once the group was
    destroyed, it is torch's own, as in a script. Every name bound to torch's function in a loaded module (`from
    torch.distributed import init_process_group` in the notebook) gets the same."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group
    signature = inspect.signature(original)
    adopted = False

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        nonlocal adopted
        if adopted or not dist.is_initialized():
            return original(*args, **kwargs)
        problem = disagreement(
            signature.bind(*args, **kwargs).arguments, backend, dist.get_world_size(), dist.get_rank()
        )
        if problem:
            raise ValueError(problem)
        adopted = True
        if dist.get_rank() == 0:
            note(
                f"accel_magic: init_process_group joined the launch's process group ({backend}, "
                f"{dist.get_world_size()} ranks) rather than making a second one"
            )

    _replace(original, init_process_group)


def word_taken_port() -> None:
    """From now on in this process, an init_process_group whose rendezvous port is taken raises torch's own
    error in one sentence that says which port and what to do."""
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        try:
            return original(*args, **kwargs)
        except RuntimeError as err:
            text = str(err)
            if "EADDRINUSE" not in text and "address already in use" not in text.lower():
                raise
            port = os.environ.get("MASTER_PORT", "?")
            raise type(err)(
                f"MASTER_PORT {port} is taken on this machine (by another program, or a process group still up): "
                f"set os.environ['MASTER_PORT'] to a free port, such as {_free_port()}"
            ) from None

    _replace(original, init_process_group)


# The groups destroy_process_group ended in this process, referenced until it ends (os._exit frees nothing).
KEPT: list[Any] = []


def keep_destroyed_groups() -> None:
    """From now on in this process, a group that destroy_process_group ends stays referenced until the process
    ends. Otherwise DDP's reducer may hold its last reference, and free it with the GIL held when the function's
    locals go: a gloo group's destructor waits for its threads, and one of them waits for the GIL to free the
    tensor of a finished collective, forever (torch 2.10: PyTorch's DDP tutorial through mp.spawn hung at its
    function's return in about one run of six)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.destroy_process_group
    signature = inspect.signature(original)

    def destroy_process_group(*args: Any, **kwargs: Any) -> None:
        group = signature.bind(*args, **kwargs).arguments.get("group")
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        if group is not None:
            KEPT.append(group)
        return original(*args, **kwargs)

    _replace(original, destroy_process_group)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _replace(original: Callable[..., Any], replacement: Callable[..., Any]) -> None:
    """Bind `replacement` wherever a loaded module binds `original` (torch.distributed, the notebook's names)."""
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    replacement.__doc__ = original.__doc__
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for name, value in list(names.items()):
            if value is original:
                names[name] = replacement
