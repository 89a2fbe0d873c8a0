"""The package's layout holds: no import cycle, and every private API of another library is used in one module
only, which lists it in its docstring and whose check below fails, on every stack, the day it moves."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "accel_magic"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def package_imports(name: str) -> set[str]:
    """The package's modules that `name` imports at run time (at the top or inside a function)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        for target in targets:
            # importing a.b.c imports the package a.b first, unless the importer lives inside it
            while target.startswith("accel_magic"):
                if target in MODULES and target != name and not name.startswith(target + "."):
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = {name: package_imports(name) for name in MODULES}
    assert graph["accel_magic.train"] >= {"accel_magic.launch", "accel_magic.cell"}  # the reader sees imports
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            assert state.get(nxt) != "open", "import cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for name in MODULES:
        if name not in state:
            visit(name, [])


def test_launch_is_a_leaf_that_imports_nothing_of_the_package_outside_itself() -> None:
    """What a launch needs of accelerate and of the runtime is handed in with its description (launch.spec), so
    the next front door reuses the launch as it is."""
    launch = {name for name in MODULES if name == "accel_magic.launch" or name.startswith("accel_magic.launch.")}
    assert len(launch) > 5
    outside = {name: package_imports(name) - launch - {"accel_magic"} for name in launch}
    assert not {name: found for name, found in outside.items() if found}, outside


def test_the_errors_a_user_can_see_live_in_errors_py_with_one_way_to_show() -> None:
    """Each exception class is defined in accel_magic.errors, and shows through `_render_traceback_` alone; the
    one other is a rank's own, which reaches the user only as the words of the rank's record."""
    from accel_magic import errors

    elsewhere = {}
    for name, path in MODULES.items():
        text = path.read_text()
        assert "no_traceback" not in text, name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and any(
                re.search(r"Error|Exception|Interrupt|OneSentence", ast.unparse(b)) for b in node.bases
            ):
                if name != "accel_magic.errors":
                    elsewhere[f"{name}.{node.name}"] = ast.unparse(node.bases[0])
    assert elsewhere == {"accel_magic.launch.rank.NodeMismatch": "RuntimeError"}
    shown = [errors.PlanError, errors.CellError, errors.SetupError, errors.ExportError, errors.TrainError]
    shown += [errors.LauncherError, errors.ResultsTooLarge, errors.LaunchError, errors.LaunchInterrupted]
    assert all(callable(getattr(cls, "_render_traceback_", None)) for cls in shown)


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = function.args
    names = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
    return len([a for a in names if a.arg not in ("self", "cls")])


def test_no_function_or_class_but_the_public_notebook_launcher_takes_more_than_8_parameters() -> None:
    """A launch's settings travel as one description (launch.spec.Launch), not as long argument lists; only
    the drop-in keeps accelerate's signature, and a stand-in keeps the one it replaces. (Records of plain data, the dataclasses, are built by keyword.)"""
    wide: dict[str, int] = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                wide[f"{name}.{node.name}"] = _parameters(node)
    others = {
        "accel_magic.launcher.notebook_launcher": "accelerate's",
        "accel_magic.launch.relay.send": "jupyter_client's Session.send, which it stands in for in rank 0",
    }
    assert all(wide[where] > 8 for where in others)  # the check sees signatures
    over = {where: n for where, n in wide.items() if n > 8 and where not in others}
    assert not over, over


def test_plan_and_runtime_import_nothing_of_ipython_or_the_launcher() -> None:
    for name in ("accel_magic.plan", "accel_magic.runtime", "accel_magic.cell", "accel_magic.export"):
        text = MODULES[name].read_text()
        assert not re.search(r"^\s*(from|import) (IPython|ipykernel|ipywidgets)", text, re.M), name
        assert not {m for m in package_imports(name) if m.startswith("accel_magic.launch")}, name


def _accelerate_state() -> bool:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return (
        "reset_partial_state" in inspect.signature(AcceleratorState._reset_state).parameters
        and callable(GradientState._reset_state)
        and isinstance(PartialState._shared_state, dict)
        and isinstance(AcceleratorState._shared_state, dict)
    )


def _accelerate_xla_flag() -> bool:
    import accelerate.utils.imports as imports

    return isinstance(getattr(imports, "_torch_xla_available", None), bool)


def _rendezvous_registry() -> bool:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    return isinstance(registry._registry, dict) and "static" in registry._registry


def _static_handler_fields() -> bool:
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    init = inspect.getsource(static.StaticTCPRendezvous.__init__)
    fields = ("self._store", "self.master_addr", "self.master_port", "self.world_size", "self.timeout")
    return callable(static.create_rdzv_handler) and all(f in init for f in fields)


def _bad_fork_flag() -> bool:
    import torch

    return callable(torch.cuda._is_in_bad_fork) and torch.cuda._is_in_bad_fork() is False


def _kernel_session() -> bool:
    from ipykernel.kernelbase import Kernel
    from jupyter_client.session import Session

    params = list(inspect.signature(Session.send).parameters)[1:]
    expected = ["stream", "msg_or_type", "content", "parent", "ident", "buffers", "track", "header", "metadata"]
    return params == expected and {"session", "iopub_socket"} <= set(Kernel.class_traits())


def _ddp_comm_hook_name() -> bool:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from accel_magic.launch.shm import has_comm_hook

    source = inspect.getsource(DistributedDataParallel.register_comm_hook)
    builtin = inspect.getsource(DistributedDataParallel._register_builtin_comm_hook)
    hooked = "_set_comm_hook_name" in source and "_set_comm_hook_name" in builtin
    if dist.is_initialized():
        return hooked
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(2, 2))
        before = has_comm_hook(model)
        model.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        return hooked and not before and has_comm_hook(model)
    finally:
        dist.destroy_process_group()


def _stream_buffer_lock() -> bool:
    from ipykernel.iostream import OutStream

    source = inspect.getsource(OutStream)  # an RLock the stream takes for every write and flush
    return "self._buffer_lock = threading.RLock()" in source and "with self._buffer_lock" in source


def _group_sequence_number() -> bool:
    import torch
    import torch.distributed as dist

    from accel_magic.launch.places import _sequence_number

    if dist.is_initialized():
        return callable(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group)
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        before = _sequence_number()
        dist.all_reduce(torch.ones(1))
        dist.barrier()
        return before >= 0 and _sequence_number() == before + 2
    finally:
        dist.destroy_process_group()


def _accelerator_dataloaders() -> bool:
    from accelerate import Accelerator
    from accelerate.data_loader import BatchSamplerShard

    prepare = inspect.getsource(Accelerator.prepare_data_loader)
    return "self._dataloaders.append" in prepare and "even_batches" in inspect.signature(BatchSamplerShard).parameters


def _argparse_actions() -> bool:
    parser = argparse.ArgumentParser()
    action = parser.add_argument("-n", "--num-processes")
    return parser._option_string_actions.get("--num-processes") is action


# (module that owns it, the names that are the private API, a check that it is still there)
PRIVATE_APIS: list[tuple[str, tuple[str, ...], Callable[[], bool]]] = [
    ("accel_magic.accelerator", ("_reset_state", "_shared_state"), _accelerate_state),
    ("accel_magic.accelerator", ("_torch_xla_available",), _accelerate_xla_flag),
    ("accel_magic.launch.elastic", ("_registry",), _rendezvous_registry),
    ("accel_magic.launch.elastic", ("_store", "create_rdzv_handler"), _static_handler_fields),
    ("accel_magic.launch.forks", ("_is_in_bad_fork",), _bad_fork_flag),
    ("accel_magic.launch.forks", ("_buffer_lock",), _stream_buffer_lock),
    ("accel_magic.launch.relay", ("session", "iopub_socket"), _kernel_session),
    ("accel_magic.options", ("_option_string_actions",), _argparse_actions),
    ("accel_magic.launch.shm", ("_get_ddp_logging_data",), _ddp_comm_hook_name),
    ("accel_magic.launch.places", ("_get_sequence_number_for_group", "_get_default_group"), _group_sequence_number),
    ("accel_magic.accelerator", ("_dataloaders",), _accelerator_dataloaders),
]


@pytest.mark.parametrize(("owner", "names", "check"), PRIVATE_APIS, ids=[", ".join(p[1]) for p in PRIVATE_APIS])
def test_each_private_api_is_still_there_and_used_only_by_the_module_that_lists_it(
    owner: str, names: tuple[str, ...], check: Callable[[], bool]
) -> None:
    doc = ast.get_docstring(ast.parse(MODULES[owner].read_text())) or ""
    for name in names:
        assert f"{name}" in doc, f"{owner} uses {name} but its docstring does not list it"
        users = [
            m
            for m, path in MODULES.items()
            if any(
                (isinstance(n, ast.Attribute) and n.attr == name)
                or (isinstance(n, ast.Constant) and n.value == name)
                or (isinstance(n, ast.alias) and n.name == name)
                for n in ast.walk(ast.parse(path.read_text()))
            )
        ]
        assert users == [owner], f"{name} is used in {users}; only {owner} may use it"
    assert check(), (
        f"the private API {', '.join(names)} that {owner} relies on has moved in the installed release: "
        f"see the list in {owner}'s docstring for what it is used for and its fallback"
    )
