"""A cell's source as code: compiling it with its own line numbers, the names it binds, and packing its
results in a rank so the notebook can take them back."""

from __future__ import annotations

import ast
import contextlib
import importlib
import itertools
import linecache
import os
import pickle
import time
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import CodeType
from typing import Any

__all__ = [
    "CellError",
    "CellCode",
    "compile_cell",
    "top_level_names",
    "Packed",
    "pack_results",
    "Received",
    "receive_results",
    "unpack_results",
    "RankBody",
]

_counter = itertools.count(1)


class CellError(ValueError):
    """The cell cannot run; the message is one sentence saying what to do."""


@dataclass(frozen=True)
class CellCode:
    source: str
    filename: str
    code: CodeType
    bound: tuple[str, ...]
    magics: tuple[tuple[str, str], ...] = ()  # ("line" or "cell", name) of the magics the cell calls


def magics_called(tree: ast.Module) -> tuple[tuple[str, str], ...]:
    """The magics that IPython's transformed source calls (get_ipython().run_line_magic('name', ...))."""
    found: dict[tuple[str, str], None] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("run_line_magic", "run_cell_magic")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.setdefault(("line" if node.func.attr == "run_line_magic" else "cell", node.args[0].value), None)
    return tuple(found)


class _Bindings(ast.NodeVisitor):
    """Names bound at the cell's top level (not inside functions, classes, lambdas or comprehensions)."""

    def __init__(self) -> None:
        self.names: dict[str, None] = {}

    def add(self, name: str) -> None:
        if not (name == "_" or (name.startswith("__") and name.endswith("__"))):
            self.names.setdefault(name, None)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.add(node.id)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.add(node.name)
        for deco in node.decorator_list:
            self.visit(deco)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.add(node.name)
        for deco in node.decorator_list:
            self.visit(deco)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass

    def _comprehension(self, node: ast.AST) -> None:
        for gen in getattr(node, "generators", []):
            self.visit(gen.iter)  # only the walrus in the outermost iterable can bind at top level

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # type: ignore[assignment]

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.asname or alias.name.split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":
                self.add(alias.asname or alias.name)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.add(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node: Any) -> None:
        if node.name:
            self.add(node.name)
        self.generic_visit(node)

    def visit_MatchStar(self, node: Any) -> None:
        if node.name:
            self.add(node.name)


def top_level_names(tree: ast.Module) -> tuple[str, ...]:
    """Names the cell binds at top level, in order of first binding. Dynamic bindings (exec, globals()[...])
    are not seen."""
    visitor = _Bindings()
    for stmt in tree.body:
        visitor.visit(stmt)
    return tuple(visitor.names)


def _is_blank(source: str) -> bool:
    return all(not line.strip() or line.lstrip().startswith("#") for line in source.splitlines())


def compile_cell(raw: str, transform: Callable[[str], str] = lambda s: s) -> CellCode:
    """Transform (magics, ! lines) and compile the cell body, with its source in linecache so tracebacks
    show the cell's lines. Raises CellError before anything runs."""
    if "\x00" in raw:
        raise CellError("The cell contains a NUL character: remove it and run the cell again.")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:
        raise CellError("The cell contains text that is not valid Unicode (a lone surrogate): retype it.") from None
    if _is_blank(raw):
        raise CellError("The cell is empty: put the training code below the %%accel_train line.")
    source = transform(raw)
    filename = f"<accel_train cell {next(_counter)}>"
    try:
        tree = ast.parse(source, filename)
        code = compile(tree, filename, "exec")
    except SyntaxError as err:
        if "await" in (err.msg or ""):
            raise CellError(
                "Top-level await is not supported in %%accel_train: put the code in a function and call it."
            ) from None
        where = f"cell line {err.lineno}" if err.lineno else "the cell"
        text = f" ({err.text.strip()})" if err.text and err.text.strip() else ""
        raise CellError(f"Syntax error at {where}{text}: {err.msg}; nothing was launched.") from None
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return CellCode(source, filename, code, top_level_names(tree), magics_called(tree))


# --- results -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packed:
    """What rank 0 sends back: per name an action and the file holding its value, plus what could not come."""

    items: tuple[tuple[str, str, str | None, str], ...]  # (name, action, notebook name, file in the folder or "")
    sizes: tuple[tuple[str, int], ...] = ()  # (name, bytes) of what was written
    skipped: tuple[tuple[str, str], ...] = ()  # (name, reason)
    seconds: float = 0.0  # time rank 0 spent writing them


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
) -> Packed:
    """Write rank 0's results into `folder`, one file per name (torch.save: tensors travel as plain bytes,
    never as file-descriptor-shared storage), and return the manifest.

    ``prepared`` maps id(what accelerator.prepare returned) to what it was given; ``notebook`` maps
    id(object) to (its name in the notebook before the launch, the object): fork keeps identities, and holding
    the objects keeps their ids from being reused in the rank. Models and optimizers that came from the
    notebook go back as state to load into the notebook's own objects; its dataloaders and schedulers stay as
    they were; everything else is moved to the CPU. Raises ResultsTooLarge past `max_bytes`.
    """

    started = time.perf_counter()
    names = [n for n in names if n in ns]
    items: list[tuple[str, str, str | None, str]] = []
    sizes: list[tuple[str, int]] = []
    skipped: list[tuple[str, str]] = []
    for index, name in enumerate(names):
        value = ns[name]
        if type(value).__name__ in ("Accelerator", "LazyAccelerator"):
            continue
        if isinstance(value, types.ModuleType):
            items.append((name, "import", value.__name__, ""))
            continue
        original = prepared.get(id(value), value)
        name_and_object = notebook.get(id(original))
        home = name_and_object[0] if name_and_object is not None and name_and_object[1] is original else None
        if home is not None and original is not value and not isinstance(original, _stateful_types()):
            items.append((name, "keep", home, ""))  # the notebook's own dataloader or scheduler
            continue
        stateful = home is not None and isinstance(original, _stateful_types())
        path = os.path.join(folder, f"item-{index}")
        try:
            _save(_to_cpu(original.state_dict() if stateful else original), path)
        except MemoryError:
            raise  # not a property of one value: the sending itself failed
        except Exception as err:
            with contextlib.suppress(OSError):
                os.remove(path)
            skipped.append((name, _reason(err)))
            continue
        items.append((name, "load_state" if stateful else "value", home if stateful else None, os.path.basename(path)))
        sizes.append((name, os.path.getsize(path)))
        if sum(size for _, size in sizes) > max_bytes:
            raise _too_large(sizes, max_bytes, len(names) - index - 1)
    return Packed(tuple(items), tuple(sizes), tuple(skipped), time.perf_counter() - started)


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

    return (torch.nn.Module, torch.optim.Optimizer)


@dataclass(frozen=True)
class Received:
    """Rank 0's results read back into the kernel, not yet applied."""

    items: tuple[tuple[str, str, str | None, Any], ...]  # (name, action, notebook name, loaded value)
    skipped: tuple[tuple[str, str], ...]
    seconds: dict[str, float]  # "send" (in rank 0) and "receive" (in the kernel)


def receive_results(packed: Packed, folder: str) -> Received:
    """Load every item the rank wrote (before the folder is removed); what cannot load is listed."""
    import torch

    started = time.perf_counter()
    items: list[tuple[str, str, str | None, Any]] = []
    skipped = list(packed.skipped)
    for name, action, home, filename in packed.items:
        try:
            # mmap: a state is then copied once, straight from the file into the notebook's parameters
            path = os.path.join(folder, filename)
            value = torch.load(path, map_location="cpu", weights_only=False, mmap=True) if filename else None
        except Exception as err:
            skipped.append((name, _reason(err)))
            continue
        items.append((name, action, home, value))
    return Received(tuple(items), tuple(skipped), {"send": packed.seconds, "receive": time.perf_counter() - started})


def unpack_results(received: Received, ns: Mapping[str, Any]) -> tuple[Callable[[], None], list[tuple[str, str]]]:
    """Decide everything the notebook will take, without changing it. Returns (apply, skipped): apply()
    makes every change at once."""
    updates: dict[str, Any] = {}
    loads: list[tuple[Any, Any]] = []
    skipped = list(received.skipped)
    for name, action, home, value in received.items:
        try:
            if action == "keep":
                updates[name] = ns[home]
            elif action == "import":
                updates[name] = importlib.import_module(home)
            elif action == "load_state":
                target = ns[home]
                _check_state(target, value)
                loads.append((target, value))
                updates[name] = target
            else:
                updates[name] = value
        except Exception as err:
            skipped.append((name, _reason(err)))

    def apply() -> None:
        for target, state in loads:
            target.load_state_dict(state)
        for key, value in updates.items():
            ns[key] = value  # type: ignore[index]

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
        if len(target.param_groups) != len(state.get("param_groups", ())):
            raise ValueError("the optimizer's parameter groups changed in the cell")


class ResultsTooLarge(Exception):
    """Rank 0's results exceed the limit; the message names the biggest."""

    no_traceback = True


def _track_prepare(prepared: dict[int, Any]) -> None:
    """Remember what each accelerator.prepare call was given, by the id of what it returned (rank only)."""
    from accelerate import Accelerator

    original = Accelerator.prepare
    if getattr(original, "_accel_magic", False):
        original = original.__wrapped__

    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        outputs = result if isinstance(result, tuple) else (result,)
        for given, returned in zip(args, outputs, strict=False):
            prepared[id(returned)] = given
            prepared.setdefault(id(given), given)
            _keep.append((given, returned))  # ids stay valid while the rank lives
        return result

    prepare.__wrapped__ = original  # type: ignore[attr-defined]
    prepare._accel_magic = True  # type: ignore[attr-defined]
    Accelerator.prepare = prepare  # type: ignore[method-assign]


_keep: list[Any] = []


class RankBody:
    """What each rank runs, in three steps the launcher tells apart: `setup` (a fresh accelerator, before the
    cell), `run` (the cell in the rank's copy of the namespace) and `results` (on rank 0, the results written
    into the launch's private folder; the manifest is returned)."""

    def __init__(self, cell: CellCode, ns: dict[str, Any], *, make_accelerator: Callable[[], Any], name: str,
                 returns: tuple[str, ...], notebook: Mapping[int, tuple[str, Any]], max_bytes: int):  # fmt: skip
        self.cell, self.ns, self.make_accelerator, self.name = cell, ns, make_accelerator, name
        self.returns, self.notebook, self.max_bytes = returns, notebook, max_bytes
        self.prepared: dict[int, Any] = {}

    def setup(self, rank: int) -> None:
        _track_prepare(self.prepared)
        self.ns[self.name] = self.make_accelerator()

    def run(self) -> None:
        exec(self.cell.code, self.ns)

    def results(self, rank: int, folder: str) -> bytes | None:
        if rank != 0 or not self.returns:
            return None
        packed = pack_results(self.ns, self.returns, self.prepared, self.notebook, folder, self.max_bytes)
        return pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
