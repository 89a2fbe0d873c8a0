"""The options of `%accel_setup` and `%%accel_train`, parsed and checked: each bad value one UsageError that
says what to give instead.

Private API of the standard library's argparse, used here only:
- `ArgumentParser._option_string_actions` (every Python 3): maps an option string to its action, to refuse an
  option given twice (argparse keeps the last silently). Fallback: none; a test fails when it moves.
"""

from __future__ import annotations

import keyword
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument, parse_argstring
from IPython.utils.process import arg_split

__all__ = ["identifier", "positive_int", "count", "given", "choice", "parse", "positive_float", "parse_port",
           "plan_arguments", "nodes", "returned_names"]  # fmt: skip


def identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def positive_int(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not text.lstrip("+").isdigit() or int(text) < 1:
        raise UsageError(f"{option} must be a whole number of at least 1, not {value!r}.")
    return int(text)


def count(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not text.lstrip("+").isdigit():
        raise UsageError(f"{option} must be a whole number of at least 0, not {value!r}.")
    return int(text)


def given(value: Any, default: Any) -> Any:
    """An option's value where it was given (0 included), else the default."""
    return default if value is None else value


def choice(value: str | None, choices: tuple[str, ...], option: str) -> str | None:
    if value is None:
        return None
    if value.lower() not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}, not {value!r}.")
    return value.lower()


def parse(magic: Any, line: str, name: str) -> Any:
    try:
        args = parse_argstring(magic, line)
    except UsageError as err:
        raise UsageError(f"%{name}: {str(err).rstrip('.')}; see %{name}? for the options.") from None
    seen: dict[str, str] = {}
    for token in arg_split(line):
        action = magic.parser._option_string_actions.get(token.split("=", 1)[0])
        if action is None:
            continue
        if action.dest in seen:
            raise UsageError(f"%{name}: {seen[action.dest]} is given twice: give each option once.")
        seen[action.dest] = "/".join(action.option_strings)
    return args


def positive_float(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0 or number == float("inf"):
        raise UsageError(f"{option} must be a number of seconds or megabytes above 0, not {value!r}.")
    return number


def parse_port(value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit() or not 1 <= int(value) <= 65535:
        raise UsageError(f"--port must be a whole number from 1 to 65535, not {value!r}.")
    return int(value)


def plan_arguments(func: Any) -> Any:
    """The options %accel_setup and %%accel_train share, spelled the same in both."""
    for decorator in reversed(
        [
            argument("-n", "--num-processes", metavar="N", help="processes (ranks); default: 1 on CPU, one per GPU"),
            argument("--cpu", action="store_true", help="use the CPU even where a GPU or TPU is present"),
            argument("--mixed-precision", metavar="P", help="no, fp16, bf16 or fp8"),
            argument("--allreduce", metavar="A", help="how CPU ranks average gradients: shm (default) or gloo"),
        ]
    ):
        func = decorator(func)
    return func


def nodes(args: Any) -> dict[str, Any]:
    """--nodes, --node-rank and --rdzv-endpoint as the request's fields: all three, or none."""
    nodes = positive_int(args.nodes, "--nodes") or 1
    given = args.node_rank is not None or args.rdzv_endpoint is not None
    if nodes == 1 and not given:
        return {}
    if nodes == 1:
        raise UsageError("--node-rank and --rdzv-endpoint train across machines: add --nodes M, the number of them.")
    if args.port is not None:
        raise UsageError("--port is for one machine: across machines, node 0's port goes in --rdzv-endpoint.")
    if args.node_rank is None or args.rdzv_endpoint is None:
        raise UsageError(
            f"--nodes {nodes} needs --node-rank (this machine's, 0 to {nodes - 1}) and --rdzv-endpoint HOST:PORT "
            "(node 0's address, the same on every node)."
        )
    rank = args.node_rank.strip()
    if not rank.isdigit():
        raise UsageError(f"--node-rank must be a whole number from 0 to {nodes - 1}, not {args.node_rank!r}.")
    return {"num_nodes": nodes, "node_rank": int(rank), "rdzv_endpoint": args.rdzv_endpoint}


def returned_names(args: Any, bound: tuple[str, ...]) -> tuple[str, ...] | None:
    """The names to bring back; None for --no-return (nothing at all comes back then)."""
    if args.no_return:
        if args.returns is not None:
            raise UsageError("--return and --no-return contradict each other: use one of them.")
        return None
    if args.returns is None:
        return bound
    names = tuple(n for n in args.returns.replace(",", " ").split() if n)
    missing = [n for n in names if n not in bound]
    if missing:
        raise UsageError(
            f"--return names {', '.join(missing)}, which the cell never binds: "
            f"choose among {', '.join(bound) or 'nothing (the cell binds no names)'}."
        )
    return names
