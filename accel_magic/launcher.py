"""`notebook_launcher`: accelerate's function, same signature and meaning, run by accel_magic's launcher
(one real process group on CPU, threads by the CPU budget, per-rank output, one error naming the rank where a
failure started, a fresh port) and returning rank 0's return value; and accelerate's own `notebook_launcher`
run the same way while the extension is loaded.

Patched, not private: `accelerate.notebook_launcher` (and `accelerate.launchers.notebook_launcher`, the same
function) is wrapped from the first %accel_setup until %unload_ext, so that imports of it in between launch
through this module (`guard_accelerate_launcher`); `restore_accelerate_launcher` puts the original back.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from .accelerator import join_uneven_inputs_on_cpu, rank_state, reset_state, state_set_aside
from .display import write_rank_text
from .errors import LauncherError, PlanError
from .footprint import used_by
from .jobs import refuse_while_running
from .launch import Hooks, NodeOptions, Results
from .launch.relay import publish_kernel_message
from .plan import Plan, Request, make_plan
from .results import pack_payload, receive_payload
from .runtime import probe
from .session import current
from .train import (
    FrontDoor,
    describe,
    function_source,
    launch_interrupted,
    launch_plan,
    plan_nodes,
    stopped_before_start,
)

__all__ = [
    "notebook_launcher",
    "LauncherError",
    "guard_accelerate_launcher",
    "restore_accelerate_launcher",
    "launcher_refusal_hint",
]


class _DefaultPort(str):
    """accelerate's default port, told apart from the same port given explicitly."""


DEFAULT_PORT = _DefaultPort("29500")
RDZV_BACKENDS = ("static", "c10d")  # either way torch's static TCP rendezvous on node 0's store, ranks by node_rank


class FunctionBody:
    """What each rank runs: the function with its arguments; rank 0 sends back its return value."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], plan: Plan, max_bytes: int) -> None:
        self.function, self.args, self.plan, self.max_bytes = function, args, plan, max_bytes
        self.value: Any = None

    def setup(self, rank: int) -> None:
        reset_state()  # state copied from the notebook would make the rank believe it trains alone
        rank_state(self.plan)  # the function builds its own Accelerator, which joins the launch's group
        join_uneven_inputs_on_cpu()

    def run(self) -> None:
        self.value = self.function(*self.args)

    def uses(self) -> list[Any]:
        """The notebook's models and optimizers the function uses."""
        return used_by(self.function, self.args)

    def results(self, rank: int, folder: str) -> bytes | None:
        if rank != 0 or self.value is None:
            return None
        return pack_payload({"return": self.value}, ["return"], {}, {}, folder, self.max_bytes)


def _check(log_line_prefix_template: str | None) -> None:
    if log_line_prefix_template is not None:
        raise LauncherError(
            "log_line_prefix_template is not supported: accel_magic marks the lines of ranks other than 0 with "
            "[rank N]; leave it at None."
        )


def _nodes(
    num_nodes: Any,
    node_rank: Any,
    master_addr: str,
    use_port: str,
    rdzv_backend: str,
    rdzv_endpoint: str,
    rdzv_conf: dict[str, Any] | None,
) -> dict[str, Any]:
    """The multi-node options as the request's fields, as accelerate reads them: the rendezvous at
    `rdzv_endpoint`, else at `master_addr:use_port`."""
    if rdzv_backend not in RDZV_BACKENDS:
        raise LauncherError(
            f"rdzv_backend must be 'static' or 'c10d', not {rdzv_backend!r}: either way node 0 hosts the rendezvous "
            "and the ranks are numbered by node_rank."
        )
    unknown = sorted(set(rdzv_conf or {}) - {"timeout", "rank"})
    if unknown:
        raise LauncherError(
            f"rdzv_conf takes only 'timeout' (seconds the nodes wait for each other) here, not {', '.join(unknown)}: "
            "leave the others out."
        )
    rank = (rdzv_conf or {}).get("rank", node_rank)
    if rank != node_rank:  # accelerate sets it to node_rank for the static rendezvous; c10d's does not read it
        raise LauncherError(
            f"rdzv_conf={{'rank': {rank!r}}} is not read (accelerate numbers the nodes by node_rank, here "
            f"{node_rank!r}): give this node's rank as node_rank and leave 'rank' out of rdzv_conf."
        )
    if num_nodes == 1:
        for name, value, default in (
            ("node_rank", node_rank, 0),
            ("master_addr", master_addr, "127.0.0.1"),
            ("rdzv_endpoint", rdzv_endpoint, ""),
        ):
            if value != default:
                raise LauncherError(
                    f"{name}={value!r} is for a launch across machines: add num_nodes=M (the number of machines), or "
                    f"leave {name} at {default!r} to train on this machine."
                )
        return {}
    endpoint = rdzv_endpoint or f"{master_addr}:{use_port}"
    return {"num_nodes": num_nodes, "node_rank": node_rank, "rdzv_endpoint": endpoint}


def _num_processes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LauncherError(f"num_processes must be a whole number of at least 1, not {value!r}.")
    return value


def _port(value: Any) -> int | None:
    if value is DEFAULT_PORT:
        return None  # a fresh free port: a fixed one stays taken after a failed launch
    text = str(value).strip()
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise LauncherError(f"use_port must be a port number from 1 to 65535, not {value!r}.")
    return int(text)


def plan_here(request: Request) -> Plan:
    """The plan for the request on this machine now; a request it cannot honour is one LauncherError."""
    from IPython import get_ipython

    try:
        return make_plan(probe(get_ipython()), request)
    except PlanError as err:
        raise LauncherError(str(err)) from None


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = DEFAULT_PORT,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> Any:
    """Run `function(*args)` in `num_processes` processes, as accelerate's `notebook_launcher` does, and return
    what rank 0's call returned (accelerate's returns None).

    On a CPU runtime the processes form one gloo group, so a plain `Accelerator()` in the function trains with
    all of them (MULTI_CPU), each with its share of the CPU budget as threads. `num_processes=None` means one
    process on CPU and one per GPU; one process runs the function in the kernel itself. A port is chosen free
    for each launch unless `use_port` is given. Across machines (`num_nodes` > 1) every node calls it with its
    own `node_rank`; node 0 hosts the rendezvous at `rdzv_endpoint`, else at `master_addr:use_port`, and each
    node gets its first rank's return value; `rdzv_backend` "static" or "c10d" both run torch's static TCP
    rendezvous on node 0's store. With `max_restarts=N`, every rank starts again after a rank failed, up to N
    times, as torch elastic does, and rank 0's value comes from the run that succeeded. A failure raises
    LaunchError, which is also torch elastic's `ChildFailedError`, as accelerate's launcher raises. Log line
    prefixes and an rdzv_conf "rank" other than node_rank are refused with a sentence saying so.
    """
    setup_plan = current().setup_plan
    try:  # the arguments checked, each refusal one LauncherError, and the plan made from them
        _check(log_line_prefix_template)
        refuse_while_running()
        if not callable(function):
            raise LauncherError(f"function must be callable, not a {type(function).__name__}.")
        port = _port(use_port)
        nodes = _nodes(num_nodes, node_rank, master_addr, str(use_port), rdzv_backend, rdzv_endpoint, rdzv_conf)
        plan = plan_here(
            Request(
                cpu=setup_plan is not None and setup_plan.request.cpu,  # %accel_setup --cpu holds for launches
                num_processes=_num_processes(num_processes),
                mixed_precision=str(mixed_precision).lower(),
                max_restarts=max_restarts,
                **nodes,
            )
        )
    except KeyboardInterrupt:  # before the launch held the interrupts: one line, as for a launch stopped later
        n = num_processes if type(num_processes) is int and num_processes > 0 else 0
        raise launch_interrupted(stopped_before_start(n)) from None
    if plan.launch == "kernel":
        with state_set_aside():  # the function's own Accelerator is not bound by the notebook's settings
            return function(*args)
    max_bytes = 1 << 30
    filename = getattr(getattr(function, "__code__", None), "co_filename", "")
    spec = describe(
        FunctionBody(function, tuple(args), plan, max_bytes),
        plan,
        filename=filename,
        port=port,
        results=Results(receive_payload, max_bytes),
        hooks=Hooks(write_rank_text, publish_kernel_message, monitor_interval=float(monitor_interval)),
        nodes=plan_nodes(plan, "" if rdzv_id == "none" else str(rdzv_id), (rdzv_conf or {}).get("timeout")),
    )
    door = FrontDoor(
        port_option="use_port",
        endpoint_option="master_addr and use_port (or rdzv_endpoint)",
        nodes=NodeOptions(
            "call notebook_launcher",
            "rdzv_conf's 'timeout'",
            "node_rank",
            "num_nodes, rdzv_id and rdzv_endpoint (or master_addr and use_port)",
        ),
        source=function_source(function, filename),
    )
    outcome = launch_plan(spec, plan, door)
    if outcome.received is None:
        return None
    for skipped in outcome.received.skipped:
        print(f"rank 0's return value could not come back to the notebook ({skipped.reason}); returning None.")
    return next((item.value for item in outcome.received.items), None)


def guard_accelerate_launcher(plan: Plan) -> None:
    """Route accelerate's notebook_launcher through this module's while the extension is loaded, for the names
    imported after %accel_setup: its ranks form one group whatever the function builds first, their lines come
    whole and marked [rank N], each launch takes a fresh port unless the call names one, and the notebook's
    Accelerator never blocks it. It returns None, as accelerate's does."""
    import accelerate
    import accelerate.launchers as launchers

    current().setup_plan = plan
    original = launchers.notebook_launcher
    if getattr(original, "_accel_magic", False):
        original = original.__wrapped__

    @functools.wraps(original)
    def accelerates_notebook_launcher(*args: Any, **kwargs: Any) -> None:
        notebook_launcher(*args, **kwargs)

    accelerates_notebook_launcher._accel_magic = True  # type: ignore[attr-defined]
    launchers.notebook_launcher = accelerate.notebook_launcher = accelerates_notebook_launcher


def restore_accelerate_launcher() -> None:
    """Put accelerate's own notebook_launcher back (on %unload_ext)."""
    launchers = sys.modules.get("accelerate.launchers")
    wrapper = getattr(launchers, "notebook_launcher", None)
    if getattr(wrapper, "_accel_magic", False):
        launchers.notebook_launcher = sys.modules["accelerate"].notebook_launcher = wrapper.__wrapped__  # type: ignore[union-attr]


# accelerate's refusal to fork while its shared state is populated (accelerate 0.x to 1.16).
LAUNCHER_REFUSAL = "the `Accelerator` should only be initialized inside your training function"


def launcher_refusal_hint(err: BaseException) -> str | None:
    """One sentence for accelerate's refusal to launch that a function imported before %accel_setup can still
    give (the wrapped launcher never does); None for any other error."""
    if not isinstance(err, ValueError) or LAUNCHER_REFUSAL not in str(err):
        return None
    return (
        "accelerate's notebook_launcher refuses to launch because an Accelerator was used in this kernel: "
        "run `from accelerate import notebook_launcher` again after %accel_setup (that one launches through "
        "accel_magic's launcher), or use `from accel_magic import notebook_launcher`."
    )
