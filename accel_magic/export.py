"""A training cell and the earlier cells it depends on, as a script for `accelerate launch`, `torchrun` and SLURM.

Pure but for `export_from_history`, which reads the shell's input history: the rest takes it as (execution
count, raw source) pairs and turns magics into Python through the `transform` it is given (the shell's
`transform_cell`); it imports nothing of IPython, torch or accelerate, and the script it writes needs only torch
and accelerate.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cell import ipython_call, top_level_names, transform_lines_kept
from .errors import ExportError

__all__ = [
    "DEFAULT_OUTPUT",
    "DEFAULT_PORT",
    "ExportError",
    "Settings",
    "Export",
    "Names",
    "last_training_cell",
    "export_from_history",
    "export_training_cell",
    "needed_names",
    "commands",
    "slurm_script",
    "script_paths",
]

TRAIN_MAGIC = "%%accel_train"
DEFAULT_OUTPUT = "accel_export_output"
DEFAULT_PORT = 29500

# What IPython's shell adds to builtins, which a script does not have (exit and quit come from `site`).
_IPYTHON_BUILTINS = {"get_ipython", "display", "__IPYTHON__", "dreload"}
BUILTINS = frozenset(set(dir(builtins)) - _IPYTHON_BUILTINS) | {"exit", "quit", "__builtins__"}
# IPython's input and output history, which only a kernel has.
_HISTORY_NAMES = re.compile(r"^(In|Out|_|__|___|_i|_ii|_iii|_ih|_oh|_dh|_\d+|_i\d+)$")

# Line magics that change nothing a script needs (display, extensions, timing loops, this package's own).
_DROPPED = {
    "load_ext",
    "reload_ext",
    "unload_ext",
    "matplotlib",
    "config",
    "autoreload",
    "aimport",
    "accel_setup",
    "accel_export",
    "timeit",
    "pinfo",
    "pinfo2",
    "who",
    "whos",
}
# Cell magics whose body runs as the cell would, apart from output.
_BODY_ONLY = {"time", "capture"}


@dataclass(frozen=True)
class Settings:
    """What the script takes from the notebook's plan."""

    num_processes: int = 1
    cpu: bool = True
    mixed_precision: str = "no"
    timeout: float = 900.0
    gpus: bool = False  # the plan trains on CUDA GPUs: the SLURM job asks for them
    threads_per_process: int = 1  # on a CPU plan the SLURM job asks for num_processes * threads CPUs per node
    accelerator_name: str = "accelerator"


@dataclass(frozen=True)
class Export:
    """The script, the SLURM batch file and the commands that run them, with the cells taken and why."""

    script: str
    slurm: str
    commands: tuple[str, ...]
    cells: tuple[tuple[int, str], ...]  # (execution count, why it was taken), in the order they ran
    script_path: str
    slurm_path: str

    def write(self) -> None:
        """Write the script and the SLURM file (an existing file is replaced)."""
        Path(self.script_path).expanduser().write_text(self.script)
        Path(self.slurm_path).expanduser().write_text(self.slurm)

    def summary(self) -> str:
        taken, commands = _listing(self.cells, self.commands)
        return (
            f"Wrote {self.script_path} and {self.slurm_path} from these cells:\n{taken}\n"
            f"Run it with one of:\n{commands}"
        )


def _listing(cells: Iterable[tuple[int, str]], commands: Iterable[str]) -> tuple[str, str]:
    """The cells taken ("  [3] defines model (used by [5])") and the commands, a line each."""
    return "\n".join(f"  [{count}] {why}" for count, why in cells), "\n".join(f"  {c}" for c in commands)


def script_paths(path: str) -> tuple[str, str]:
    """The script's path as given and its SLURM file's; refuses a path that cannot be written."""
    target = Path(path).expanduser()
    if target.suffix != ".py":
        raise ExportError(f"{path!r} is not a .py file: give the script a name ending in .py, such as train.py.")
    if target.is_dir():
        raise ExportError(f"{path!r} is a folder: give the path of the script to write, such as {path}/train.py.")
    if not target.parent.is_dir():
        raise ExportError(f"The folder {str(target.parent)!r} does not exist: create it first, or write elsewhere.")
    slurm = path[: -len(".py")] + ".slurm"
    if Path(slurm).expanduser().is_dir():
        raise ExportError(f"{slurm!r} is a folder: choose another name for the script.")
    return path, slurm


# --- which cell is the training cell ---------------------------------------------------------------------------


def _magic_line(raw: str) -> tuple[int, str] | None:
    """(index of the line, its options) when the cell's first non-blank line starts with %%accel_train."""
    for index, line in enumerate(raw.splitlines()):
        if line.strip():
            stripped = line.strip()
            if stripped == TRAIN_MAGIC or stripped.startswith(TRAIN_MAGIC + " "):
                return index, stripped[len(TRAIN_MAGIC) :].strip()
            return None
    return None


def last_training_cell(history: Sequence[tuple[int, str]]) -> tuple[int, str] | None:
    """(execution count, options) of the last %%accel_train cell in the history, or None."""
    for count, raw in reversed(history):
        found = _magic_line(raw)
        if found is not None:
            return count, found[1]
    return None


# --- names a cell needs, in the order it runs --------------------------------------------------------------------

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

# Calls that show values: what their arguments call only reads (print(x.mean().item()), logger.info(f"{...}")).
_OUTPUT = frozenset(
    {"print", "pprint", "display", "update_display", "clear_output", "HTML", "Markdown", "Latex", "Math", "JSON",
     "SVG", "Image", "Video", "Audio", "Code", "Pretty", "IFrame", "Javascript", "ProgressBar", "display_html",
     "display_markdown", "display_latex", "display_json", "display_png", "display_jpeg", "display_svg",
     "display_pretty", "display_javascript"}
)  # fmt: skip
# logging's calls: logging.info(...) and a logger's, logger.info(...)
_LOGGING = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "fatal", "log"})
# Methods that read their object, wherever they are called; in-place methods (add_, zero_grad, step, to, cpu,
# cuda, train, eval, float, half, load_state_dict, ...) are not among them: on a module they change it. Any
# is_*() is a read too (is_available, is_initialized, is_floating_point).
_READ_ONLY = frozenset(
    {"item", "tolist", "numpy", "mean", "sum", "prod", "numel", "nelement", "element_size", "size", "dim",
     "ndimension", "stride", "norm", "max", "min", "amax", "amin", "argmax", "argmin", "std", "var", "median",
     "abs", "all", "any", "count", "index", "equal", "allclose", "isclose", "eq", "ne", "clone", "detach", "copy",
     "keys", "values", "items", "format", "parameters", "named_parameters", "buffers", "named_buffers",
     "modules", "named_modules", "children", "named_children", "state_dict", "get_parameter", "get_submodule",
     "extra_repr", "device_count", "current_device", "get_device_name", "get_device_properties",
     "get_device_capability", "memory_allocated", "max_memory_allocated", "memory_reserved",
     "max_memory_reserved", "mem_get_info", "get_rank", "get_world_size", "get_num_threads", "get_default_dtype",
     "get_last_lr", "getLogger", "is_built"}
)  # fmt: skip


# Methods that change their object even inside what print or display is given (print(model.load_state_dict(sd)),
# print(opt.step()), print(x.add_(1))), as does any in-place method, named with a trailing underscore.
_CHANGING = frozenset(
    {"load_state_dict", "step", "zero_grad", "backward", "train", "eval", "to", "cpu", "cuda", "float", "half",
     "double", "bfloat16", "apply", "manual_seed", "seed", "append", "extend", "insert", "pop", "popitem",
     "remove", "clear", "update", "setdefault", "add", "discard"}
)  # fmt: skip


def _logger(node: ast.expr) -> bool:
    """`node` is logging, a name that ends in log or logger (log, logger, LOGGER, train_log) or a
    logging.getLogger(...) call."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "getLogger"
    return isinstance(node, ast.Name) and (node.id == "logging" or node.id.lower().endswith(("log", "logger")))


def _output_call(func: ast.expr) -> bool:
    """The call shows what it is given: print, display and IPython.display's helpers (as names or attributes,
    accelerator.print too), and logging's calls."""
    if isinstance(func, ast.Name):
        return func.id in _OUTPUT
    if isinstance(func, ast.Attribute):
        return func.attr in _OUTPUT or (func.attr in _LOGGING and _logger(func.value))
    return False


def _reads(func: ast.Attribute, showing: bool) -> bool:
    """obj.method(...) only reads obj: a read-only method, or, in what a call that shows values is given, any
    method but those that change their object."""
    if showing:
        changing = func.attr in _CHANGING or (func.attr.endswith("_") and not func.attr.startswith("__"))
        return not changing
    return func.attr in _READ_ONLY or func.attr.startswith("is_")


def _arguments(args: ast.arguments) -> set[str]:
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    return {a.arg for a in every if a is not None}


def _function_locals(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> tuple[set[str], set[str]]:
    """(names local to the function, names it declares global and assigns): Python's rule, any assignment in the
    body makes a name local."""
    names, declared, assigned_globals = _arguments(node.args), set(), set()
    stack: list[ast.AST] = list(node.body) if isinstance(node.body, list) else [node.body]
    while stack:
        sub = stack.pop()
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(sub.name)
            continue
        if isinstance(sub, ast.Lambda):
            continue
        if isinstance(sub, _COMPREHENSIONS):
            names.update(n.target.id for n in ast.walk(sub) if isinstance(n, ast.NamedExpr))
            stack.append(sub.generators[0].iter)
            continue
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            names.add(sub.id)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in sub.names if a.name != "*")
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            names.add(sub.name)
        elif isinstance(sub, (ast.MatchAs, ast.MatchStar)) and sub.name:
            names.add(sub.name)
        elif isinstance(sub, ast.MatchMapping) and sub.rest:
            names.add(sub.rest)
        elif isinstance(sub, (ast.Global, ast.Nonlocal)):
            declared.update(sub.names)
        stack.extend(ast.iter_child_nodes(sub))
    for sub in ast.walk(node):
        if isinstance(sub, ast.Global):
            assigned_globals.update(n for n in sub.names if n in names)
    return names - declared, assigned_globals


class _Scope:
    def __init__(self, kind: str, parent: _Scope | None, bound: Iterable[str] = ()):
        self.kind, self.parent, self.bound = kind, parent, set(bound)


class _Uses(ast.NodeVisitor):
    """An ordered walk of a cell: the names it loads before binding them (`needed`, with the first line), the
    names its functions use (`deferred`: a function looks them up when called), and the needed names whose objects
    its top-level code changes (`mutated`)."""

    def __init__(self) -> None:
        self.module = _Scope("module", None)
        self.scope = self.module
        self.needed: dict[str, int] = {}
        self.deferred: dict[str, int] = {}
        self.mutated: set[str] = set()  # names from other cells whose objects its top-level code changes
        self.global_bindings: set[str] = set()  # assigned by functions through `global`
        self.showing = 0  # inside the arguments of a call that shows them (print, display, logging)
        self.star = False

    # names

    def load(self, name: str, line: int) -> None:
        scope, in_function = self.scope, False
        while scope is not self.module:
            assert scope is not None
            if name in scope.bound and not (in_function and scope.kind == "class"):
                return
            in_function = in_function or scope.kind == "function"
            scope = scope.parent
        if in_function:
            self.deferred.setdefault(name, line)
        elif name not in self.module.bound:
            self.needed.setdefault(name, line)

    def store(self, name: str) -> None:
        scope = self.scope
        if scope.kind != "function":
            scope.bound.add(name)

    def mutate(self, node: ast.expr) -> None:
        """`node` (n.a.f's `n.a`, or an assignment target n.a / n[k]) changes the object its root name holds."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        if not isinstance(node, ast.Name):
            return
        scope = self.scope
        while scope is not self.module:
            if scope.kind == "function" or node.id in scope.bound:
                return
            scope = scope.parent
        if node.id not in self.module.bound:
            self.mutated.add(node.id)

    def visit_Call(self, node: ast.Call) -> None:
        output = _output_call(node.func)
        if isinstance(node.func, ast.Attribute) and not (output or _reads(node.func, self.showing > 0)):
            self.mutate(node.func.value)
        if not output:
            self.generic_visit(node)
            return
        self.visit(node.func)
        self.showing += 1  # what a call that shows values is given only reads, but for the changing methods
        try:
            for arg in [*node.args, *node.keywords]:
                self.visit(arg)
        finally:
            self.showing -= 1

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.store(node.id)
        else:
            self.load(node.id, node.lineno)

    def _target(self, node: ast.AST) -> None:
        """An assignment target: subscripts and attributes load their objects and change them; names bind."""
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                self.mutate(sub)
        self.visit(node)

    # statements, in the order Python evaluates them

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._target(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.load(node.target.id, node.lineno)
        self.visit(node.value)
        self._target(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        if self.scope.kind != "function":
            self.visit(node.annotation)
        self._target(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        scope = self.scope
        while scope.kind == "comprehension" and scope.parent is not None:
            scope = scope.parent  # the walrus binds in the scope that holds the comprehension
        if scope.kind != "function":
            scope.bound.add(node.target.id)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self._target(node.target)
        self._block(node.body)
        self._block(node.orelse)

    visit_AsyncFor = visit_For  # type: ignore[assignment]

    def visit_While(self, node: ast.While) -> None:
        self.visit(node.test)
        self._block(node.body)
        self._block(node.orelse)

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self._branches([node.body, node.orelse])

    def visit_Try(self, node: ast.Try) -> None:
        self._block(node.body)
        before = set(self.scope.bound)
        after = set(before)
        for handler in node.handlers:
            self.scope.bound = set(before)
            self.visit(handler)
            after |= self.scope.bound
        self.scope.bound = after
        self._block(node.orelse)
        self._block(node.finalbody)

    visit_TryStar = visit_Try  # type: ignore[assignment]

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.store(node.name)
        self._block(node.body)

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self._target(item.optional_vars)
        self._block(node.body)

    visit_AsyncWith = visit_With  # type: ignore[assignment]

    def visit_Match(self, node: ast.Match) -> None:
        self.visit(node.subject)
        before = set(self.scope.bound)
        after = set(before)
        for case in node.cases:
            self.scope.bound = set(before)
            self.visit(case.pattern)
            if case.guard is not None:
                self.visit(case.guard)
            self._block(case.body)
            after |= self.scope.bound
        self.scope.bound = after

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        if node.pattern is not None:
            self.visit(node.pattern)
        if node.name:
            self.store(node.name)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name:
            self.store(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        self.generic_visit(node)
        if node.rest:
            self.store(node.rest)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.store((alias.asname or alias.name).split(".")[0])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name == "*":
                self.star = True
            else:
                self.store(alias.asname or alias.name)

    def _block(self, body: list[ast.stmt]) -> None:
        for stmt in body:
            self.visit(stmt)

    def _branches(self, bodies: list[list[ast.stmt]]) -> None:
        before = set(self.scope.bound)
        after = set(before)
        for body in bodies:
            self.scope.bound = set(before)
            self._block(body)
            after |= self.scope.bound
        self.scope.bound = after

    # scopes

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        if not isinstance(node, ast.Lambda):
            for deco in node.decorator_list:
                self.visit(deco)
            every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs, node.args.vararg, node.args.kwarg]
            for annotation in [a.annotation for a in every if a is not None] + [node.returns]:
                if annotation is not None:
                    self.visit(annotation)
        local, assigned_globals = _function_locals(node)
        self.global_bindings |= assigned_globals
        outer, self.scope = self.scope, _Scope("function", self.scope, local)
        try:
            self._block(node.body) if isinstance(node.body, list) else self.visit(node.body)
        finally:
            self.scope = outer
        if not isinstance(node, ast.Lambda):
            self.store(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        outer, self.scope = self.scope, _Scope("class", self.scope)
        try:
            self._block(node.body)
        finally:
            self.scope = outer
        self.store(node.name)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) -> None:
        first, *rest = node.generators
        self.visit(first.iter)  # evaluated in the enclosing scope
        outer, self.scope = self.scope, _Scope("comprehension", self.scope)
        try:
            for number, gen in enumerate(node.generators):
                if number:
                    self.visit(gen.iter)
                self._target(gen.target)
                for cond in gen.ifs:
                    self.visit(cond)
            if isinstance(node, ast.DictComp):
                self.visit(node.key)
                self.visit(node.value)
            else:
                self.visit(node.elt)
        finally:
            self.scope = outer

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # type: ignore[assignment]


@dataclass(frozen=True)
class Names:
    """What a cell needs from the cells before it, and what it binds."""

    needed: dict[str, int]  # loaded before the cell binds them, with the line of the first such load
    deferred: dict[str, int]  # used inside its functions and bound nowhere in them, with the first line
    bound: frozenset[str]  # everything the cell binds at top level, anywhere in it
    star: bool  # the cell has `from ... import *`
    # needed names whose objects it changes: n.f(...) (not a read-only method such as n.mean(), nor in what print,
    # display or a logging call is given unless f changes n, as load_state_dict does), n.a = v, n[k] = v, del n.a
    mutated: frozenset[str] = frozenset()


def needed_names(tree: ast.Module) -> Names:
    """The names a cell needs from other cells: loaded at top level where the cell has not bound them yet
    (`needed`), or used by its functions (`deferred`, looked up when a function is called, so in any cell that ran
    before the training cell)."""
    uses = _Uses()
    for stmt in tree.body:
        uses.visit(stmt)
    bound = frozenset(uses.module.bound | uses.global_bindings)
    return Names(uses.needed, uses.deferred, bound, uses.star, frozenset(uses.mutated))


# --- magics and ! lines as plain Python -----------------------------------------------------------------------


def _offsets(source: str) -> list[int]:
    starts, total = [0], 0
    for line in source.splitlines(True):
        total += len(line)
        starts.append(total)
    return starts


def _char_col(source_lines: list[str], lineno: int, byte_col: int) -> int:
    return len(source_lines[lineno - 1].encode("utf-8")[:byte_col].decode("utf-8", "replace"))


_EXPANSION = re.compile(r"\{[^{}]*\}")


@dataclass
class _Translator:
    count: int
    transform: Callable[[str], str]
    python_names: frozenset[str]  # names the kernel's cells bind: `$name` in a command would expand them
    needs: set[str] = field(default_factory=set)  # modules the translations use: os, subprocess, sys
    refused: list[tuple[int, ExportError]] = field(default_factory=list)  # (line, why) of what has no translation

    def refuse(self, line: int, what: str, fix: str) -> ExportError:
        return ExportError(f"Cell [{self.count}] line {line} uses {what}, which has no plain-Python equivalent: {fix}.")

    def check_expansion(self, text: str, line: int, what: str) -> None:
        dollars = {m.group(1) for m in re.finditer(r"(?<!\$)\$([A-Za-z_]\w*)", text)}
        if _EXPANSION.search(text) or dollars & self.python_names:
            raise self.refuse(
                line,
                f"{what} with a Python expansion ({{...}} or $name)",
                "write the command with the value spelled out, or run it with subprocess.run in the cell, "
                "then export again",
            )

    def source(self, source: str, first_line: int, tree: ast.Module | None = None) -> str:
        """The transformed cell (its first line numbered `first_line`, `tree` its parse if already made) with every
        magic and ! line as Python."""
        tree = tree if tree is not None else ast.parse(source)
        lines = source.splitlines(True)
        starts = _offsets(source)
        parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
        edits: list[tuple[int, int, str]] = []
        for node in ast.walk(tree):
            call = ipython_call(node)
            if call is None or call[0] not in ("run_line_magic", "run_cell_magic", "system", "getoutput"):
                continue
            assert isinstance(node, ast.Call) and node.end_lineno is not None and node.end_col_offset is not None
            statement = isinstance(parents.get(node), ast.Expr)
            line = first_line + node.lineno - 1
            try:
                text = self.translate(*call, statement=statement, line=line, indent=node.col_offset)
            except ExportError as err:  # kept for when the cell is needed; its other lines still bind names
                self.refused.append((line, err))
                text = "pass" if statement else "None"
            start = starts[node.lineno - 1] + _char_col(lines, node.lineno, node.col_offset)
            end = starts[node.end_lineno - 1] + _char_col(lines, node.end_lineno, node.end_col_offset)
            edits.append((start, end, text))
        for start, end, text in sorted(edits, reverse=True):
            source = source[:start] + text + source[end:]
        return source

    def translate(self, method: str, args: list[str], *, statement: bool, line: int, indent: int) -> str:
        if method in ("system", "getoutput"):
            command = args[0]
            self.check_expansion(command, line, f"`!{command}`")
            self.needs.add("subprocess")
            # As in IPython: a failing command does not stop the cell, and `x = !cmd` holds stdout and stderr.
            if method == "system":
                return f"subprocess.run({command!r}, shell=True)"
            captured = "stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True"
            return f"subprocess.run({command!r}, shell=True, {captured}).stdout.splitlines()"
        if method == "run_cell_magic":
            name, options, body = (args + ["", "", ""])[:3]
            if name not in _BODY_ONLY:
                raise self.refuse(
                    line, f"%%{name}", "rewrite the cell in Python, or leave it out of what the training cell uses"
                )
            inner = self.source(self.transform(body), line + 1)
            return _indent(inner.rstrip("\n"), indent) if inner.strip() else "pass"
        name, text = (args + ["", ""])[:2]
        return self.line_magic(name, text.strip(), statement=statement, line=line)

    def line_magic(self, name: str, text: str, *, statement: bool, line: int) -> str:
        shown = f"%{name} {text}".strip().replace("\n", " ")
        if name in _DROPPED:
            return f"pass  # {shown} (not needed in a script)" if statement else "None"
        if name == "time" and text:
            return text if statement else f"({text})"
        if name in ("cd", "env", "pip"):
            self.check_expansion(text, line, f"`{shown}`")
            try:
                words = shlex.split(text)
            except ValueError:
                words = []
            if name == "cd" and len(words) == 1 and not words[0].startswith("-"):
                self.needs.add("os")
                return f"os.chdir(os.path.expanduser({words[0]!r}))"
            if name == "env":
                # IPython's own split: at the first "=" if there is one, else at the first space; the value as is.
                key, *value = [part.strip() for part in text.split("=" if "=" in text else " ", 1)]
                if key and not any(c.isspace() for c in key):
                    self.needs.add("os")
                    if not value:  # a read
                        return f"os.environ[{key!r}]"
                    set_key = f"os.environ[{key!r}] = {value[0]!r}"
                    return set_key if statement else f"os.environ.__setitem__({key!r}, {value[0]!r})"
            if name == "pip" and words:
                self.needs.update(("subprocess", "sys"))
                return f'subprocess.run([sys.executable, "-m", "pip", *{words!r}], check=True)'
        raise self.refuse(
            line, f"%{name}", "rewrite that line in Python, or move it to a cell the training cell does not use"
        )


def _indent(text: str, columns: int) -> str:
    """Every line but the first indented by `columns` (the first takes the place of the call)."""
    first, *rest = text.split("\n")
    return "\n".join([first] + [(" " * columns + line) if line.strip() else line for line in rest])


# --- the cells of a kernel, and which of them the training cell depends on -------------------------------------


@dataclass
class _Cell:
    count: int
    source: str  # as Python, the magics translated (or only transformed where that failed)
    first_line: int  # the cell line of the source's line 1
    training: bool
    names: Names
    error: ExportError | None  # why the cell cannot go into a script, should it be needed
    needs: frozenset[str] = frozenset()  # modules its translated magics use: os, subprocess, sys


def _body(raw: str) -> tuple[str, int, bool]:
    """The cell's code (an %%accel_train cell's without its magic line), the cell line of its first line, and
    whether it is an %%accel_train cell. An %%accel_train cell's lines are numbered as a launch's tracebacks
    number them ("Cell line 1"): from the line below the magic."""
    found = _magic_line(raw)
    if found is None:
        return raw, 1, False
    return "\n".join(raw.splitlines()[found[0] + 1 :]), 1, True


def _read_cells(history: Sequence[tuple[int, str]], transform: Callable[[str], str]) -> list[_Cell]:
    """The cells as Python, what each binds and needs, each transformed and parsed once; a magic without a
    translation becomes `pass` (so the rest of the cell still counts) and the cell's error, raised only if the
    training cell depends on it."""
    read = []
    for count, raw in history:
        body, first_line, training = _body(raw)
        source = transform_lines_kept(body, transform)
        try:
            tree: ast.Module | None = ast.parse(source)
        except SyntaxError:
            tree = None
        read.append((count, source, tree, first_line, training))
    # `$name` in a command expands a Python name that any cell binds
    python_names = frozenset(name for _, _, tree, _, _ in read if tree is not None for name in top_level_names(tree))
    cells = []
    for count, source, tree, first_line, training in read:
        translator, error = _Translator(count, transform, python_names), None
        try:
            if tree is None:
                raise SyntaxError
            source = translator.source(source, first_line, tree)
            tree = ast.parse(source)
        except SyntaxError:
            error = ExportError(f"Cell [{count}] is not valid Python: fix it, run it again, and export again.")
            tree = ast.Module(body=[], type_ignores=[])
        if translator.refused:
            error = min(translator.refused, key=lambda refused: refused[0])[1]
        names = needed_names(tree)
        cells.append(_Cell(count, source, first_line, training, names, error, frozenset(translator.needs)))
    return cells


_Users = dict[str, set[int]]  # name -> the cells that use it


def _plural(names: list[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _resolve(cells: list[_Cell], training: _Cell, accelerator_name: str) -> tuple[dict[int, dict[str, _Users]], bool]:
    """Which cells before the training cell it depends on, followed transitively: for each name a cell needs at
    top level, the latest cell before it that binds it; for each name its functions use, the latest cell before the
    training cell that binds it (a function looks its names up when called); and every cell between that one and the
    use (the cell, or for a function's name the training cell) that changes the object the name holds (a seed,
    loaded weights): a change matters only to what runs after it. Returns {cell: {"defines" or "changes": {name:
    the cells that use it}}} and whether `display` is used without a cell that defines it."""
    used: dict[int, dict[str, _Users]] = {training.count: {}}
    queue, display, seen = [training], False, {training.count}

    def take(taken: _Cell, verb: str, name: str, user: _Cell) -> None:
        used.setdefault(taken.count, {}).setdefault(verb, {}).setdefault(name, set()).add(user.count)
        if taken.count not in seen:
            seen.add(taken.count)
            queue.append(taken)

    while queue:
        cell = queue.pop(0)
        if cell.error is not None:
            raise cell.error
        missing, history = [], []
        earlier = [c for c in cells if c.count < cell.count]
        wanted = [(name, line, earlier) for name, line in cell.names.needed.items()]
        # a function's names: the training cell's own if it binds them, else as the training cell starts
        own = cell.names.bound if cell is training else frozenset()
        wanted += [(name, line, cells) for name, line in cell.names.deferred.items() if name not in own]
        for name, line, before in wanted:
            if name in BUILTINS or name == accelerator_name or name in cell.needs:
                continue
            definer = next((c for c in reversed(before) if name in c.names.bound), None)
            if definer is None and name in cell.names.bound:
                continue  # bound later in the cell itself (a loop, a branch): its own
            if definer is None:
                definer = next((c for c in reversed(before) if c.names.star), None)
            if definer is None:
                if name == "display":
                    display = True
                elif name == "get_ipython":
                    raise ExportError(
                        f"Cell [{cell.count}] line {cell.first_line + line - 1} calls get_ipython(), which a script "
                        "does not have: do that in a cell the training cell does not use, and export again."
                    )
                elif _HISTORY_NAMES.match(name):
                    history.append(name)
                else:
                    missing.append(name)
                continue
            if definer is not cell:  # else a function of the cell uses what the cell itself binds
                take(definer, "defines", name, cell)
            for changer in before:  # a change matters to the cells that run after it
                if definer.count < changer.count and changer is not cell and name in changer.names.mutated:
                    take(changer, "changes", name, cell)
        if history:
            raise ExportError(
                f"Cell [{cell.count}] uses {_plural(history)}, IPython's input and output history, which a script "
                "does not have: assign the value to a name in the cell that makes it, run that cell, and export again."
            )
        if missing:
            them = "it" if len(missing) == 1 else "them"
            raise ExportError(
                f"Cell [{cell.count}] uses {_plural(missing)}, which no earlier cell of this kernel defines: define "
                f"{them} in a cell above it, run both cells again, and export again."
            )
    return used, display


def _why(cell: _Cell, uses: dict[str, _Users], training: int) -> str:
    """ "defines model, opt (used by [7]); X (used by [5], [7]); changes torch (used by [7])": names grouped by
    the cells that use them."""
    if cell.count == training:
        return "the %%accel_train cell"
    parts = ["an earlier %%accel_train cell"] if cell.training else []
    for verb in ("defines", "changes"):
        groups: dict[tuple[int, ...], list[str]] = {}
        for name, users in sorted(uses.get(verb, {}).items()):
            groups.setdefault(tuple(sorted(users)), []).append(name)
        named = [f"{', '.join(names)} (used by {', '.join(f'[{c}]' for c in by)})" for by, names in groups.items()]
        if named:
            parts.append(f"{verb} {'; '.join(named)}")
    return "; ".join(parts)


# --- the script, the SLURM file and the commands ----------------------------------------------------------------


def commands(script: str, slurm: str, settings: Settings, output: str = DEFAULT_OUTPUT) -> tuple[str, ...]:
    """accelerate launch, torchrun, plain python (one process), and sbatch, as a user types them."""
    n, path = settings.num_processes, shlex.quote(script)
    # accelerate's --cpu starts one process unless given an MPI hostfile; --multi_gpu is its torchrun launcher,
    # and the script's Accelerator(cpu=True) keeps those processes on the CPU.
    mode = "--multi_gpu " if n > 1 else ("--cpu " if settings.cpu else "")
    precision = f" --mixed_precision {settings.mixed_precision}" if settings.mixed_precision != "no" else ""
    out = f"--output-dir {shlex.quote(output)}"
    return (
        f"accelerate launch {mode}--num_processes {n}{precision} {path} {out}",
        f"torchrun --nproc-per-node {n} {path} {out}",
        f"python {path} {out}",
        f"sbatch {shlex.quote(slurm)}",
    )


def slurm_script(script: str, settings: Settings, port: int, job: str, output: str = DEFAULT_OUTPUT) -> str:
    n = settings.num_processes
    cpus_for_srun = ""
    if settings.gpus:
        resources = f"#SBATCH --gpus-per-node={n}"
    else:
        cpus = max(n, n * settings.threads_per_process)
        resources = (
            f"#SBATCH --cpus-per-task={cpus}\n# {n} process(es) x {settings.threads_per_process} thread(s) per node, "
            "as the notebook's plan has it: adjust\n# --cpus-per-task to the cores a node gives this job, at least "
            "one per process."
        )
        cpus_for_srun = 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"  # srun does not pass it on by itself\n'

    return f"""#!/bin/bash
#SBATCH --job-name={shlex.quote(job)}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
{resources}
# Written by accel_magic's %accel_export with {script}: each node runs one torchrun, which starts {n} process(es)
# there; the nodes meet through torch's c10d rendezvous on the job's first node, port {port}. Submit it from the
# folder you exported from: sbatch <this file>. Change --nodes above to use more machines.
set -euo pipefail
{cpus_for_srun}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

srun torchrun \\
    --nnodes "$SLURM_NNODES" \\
    --nproc-per-node {n} \\
    --rdzv-id "$SLURM_JOB_ID" \\
    --rdzv-backend c10d \\
    --rdzv-endpoint "$head_node:{port}" \\
    {shlex.quote(script)} --output-dir {shlex.quote(output)}
"""


_HELPERS = '''
def _accel_environment(num_processes):
    """Refuse a launch that asked for several processes but started one; keep gloo on loopback on one machine."""
    import os
    import sys

    env = os.environ
    sizes = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if not any(key in env for key in sizes) and "ACCELERATE_DYNAMO_BACKEND" in env and "MASTER_PORT" in env:
        sys.exit(
            "accelerate launch started one process, not several: its --cpu needs an MPI hostfile for more, so run "
            f"`accelerate launch --multi_gpu --num_processes {num_processes} ...` (this script stays on the CPU)."
        )
    if sys.platform == "linux" and "WORLD_SIZE" in env and env.get("LOCAL_WORLD_SIZE") == env["WORLD_SIZE"]:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: the hostname's interface is flaky in containers


def _accel_record(accelerator):
    """accelerator.prepare, its prepare_model/_optimizer/_scheduler and register_for_checkpointing, remembering what
    they were given and returned (prepare calls the others: a pair may be recorded twice)."""
    prepared, registered = [], []

    def recorded(prepare):
        def wrapper(*objects, **kwargs):
            result = prepare(*objects, **kwargs)
            prepared.extend(zip(objects, result if isinstance(result, tuple) else (result,)))
            return result

        return wrapper

    for method in ("prepare", "prepare_model", "prepare_optimizer", "prepare_scheduler"):
        setattr(accelerator, method, recorded(getattr(accelerator, method)))
    register = accelerator.register_for_checkpointing

    def recorded_register(*objects):
        registered.extend(objects)
        return register(*objects)

    accelerator.register_for_checkpointing = recorded_register
    return prepared, registered


def _accel_as_in_notebook(namespace, prepared):
    """After an earlier %%accel_train cell the notebook held its own objects again, with the trained state."""
    for name, value in list(namespace.items()):
        for given, returned in prepared:
            if value is returned and not name.startswith("_"):
                namespace[name] = given


def _accel_save(accelerator, namespace, prepared, registered, output_dir):
    """Write the state of every named model, optimizer, scheduler and registered object, as the notebook got it
    back: models through accelerator.get_state_dict on every process (a collective under FSDP and DeepSpeed),
    the files from the main process; then end the process group."""
    import os
    import sys

    import torch
    from torch.utils.data import DataLoader

    accelerator.wait_for_everyone()
    states, seen = {}, set()
    pairs = list(prepared) + [(obj, obj) for obj in registered]
    for name, value in list(namespace.items()):
        for given, returned in pairs:
            if name.startswith("_") or id(given) in seen or (value is not given and value is not returned):
                continue
            if isinstance(given, DataLoader) or isinstance(returned, DataLoader) or not hasattr(returned, "state_dict"):
                continue
            seen.add(id(given))
            if isinstance(given, torch.nn.Module):
                states[name] = accelerator.get_state_dict(returned)
            else:
                states[name] = returned.state_dict()
    if accelerator.is_main_process and not states:
        print(
            "warning: no model, optimizer or scheduler that went through the accelerator's prepare is bound to a name "
            "at the end of the script, so nothing was saved: keep what prepare returns in a name, such as "
            "`model = accelerator.prepare(model)`.",
            file=sys.stderr,
        )
    elif accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        for name, state in states.items():
            path = os.path.join(output_dir, f"{name}.pt")
            torch.save(state, path)
            print(f"wrote {path}")
    accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # gloo's threads, left to the exit, can abort the process
'''


def _docstring_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def _script(cells: list[_Cell], reasons: dict[int, str], settings: Settings, runs: tuple[str, ...], source: str,
            display: bool, training: int, needs: set[str]) -> str:  # fmt: skip
    name = settings.accelerator_name
    taken, run_lines = _listing(((c.count, reasons[c.count]) for c in cells), runs)
    header = f'''"""Training script exported by accel_magic's %accel_export from {_docstring_text(source)}.

The cells it runs, in the order they ran in the notebook:
{_docstring_text(taken)}

The Accelerator is built as the notebook's plan said: {settings.num_processes} process(es), cpu={settings.cpu},
mixed_precision={settings.mixed_precision!r}, a collective may wait {settings.timeout:g} s for the other processes.

Run it with one of (the last one submits the SLURM batch file written next to it):
{_docstring_text(run_lines)}

The main process writes the trained state of every model, optimizer and scheduler that went through
{name}.prepare (or prepare_model, prepare_optimizer, prepare_scheduler) to <output-dir>/<name>.pt; read it with
torch.load(path, map_location="cpu").
"""
'''
    imports = "import argparse\n" + "".join(f"import {module}\n" for module in sorted(needs))
    parts = [
        header,
        f"\n{imports}from datetime import timedelta\n\nfrom accelerate import Accelerator\n"
        "from accelerate.utils import InitProcessGroupKwargs\n\n",
        _HELPERS,
        f"""

_accel_parser = argparse.ArgumentParser(description="Run the notebook's training cell.")
_accel_parser.add_argument("--output-dir", default="{DEFAULT_OUTPUT}", help="folder for the trained state")
_accel_args = _accel_parser.parse_args()
_accel_environment({settings.num_processes})

{name} = Accelerator(
    cpu={settings.cpu!r},
    mixed_precision="{settings.mixed_precision}",
    kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds={settings.timeout:g}))],
)
_accel_prepared, _accel_registered = _accel_record({name})
""",
    ]
    if display:
        parts.append(
            "\ntry:\n    from IPython.display import display\nexcept ImportError:  # outside IPython: print it\n"
            "    display = print\n"
        )
    for cell in cells:
        label = "the %%accel_train cell" if cell.count == training else reasons[cell.count].split(";")[0]
        parts.append(f"\n# --- cell [{cell.count}]: {label} ---\n{cell.source.rstrip()}\n")
        if cell.training and cell.count != training:
            parts.append("_accel_as_in_notebook(globals(), _accel_prepared)\n")
    parts.append(
        "\n# --- the trained state, as the notebook got it back ---\n"
        f"_accel_save({name}, globals(), _accel_prepared, _accel_registered, _accel_args.output_dir)\n"
    )
    return "".join(parts)


def export_from_history(shell: Any, path: str, port: int, plan: Any, accelerator_name: str) -> Export:
    """The export of the last %%accel_train cell in `shell`'s input history (ExportError when there is none),
    under the plan its options make (`plan(options)`), written to `path`."""
    raw = shell.history_manager.input_hist_raw
    history = [(count, raw[count]) for count in range(1, min(len(raw), shell.execution_count))]
    found = last_training_cell(history)
    if found is None:
        raise ExportError(
            "No %%accel_train cell has run in this kernel: run the training cell first, then %accel_export."
        )
    count, options = found
    made = plan(options)
    settings = Settings(
        num_processes=made.num_processes,
        cpu=made.device == "cpu" or made.cpu,
        mixed_precision=made.mixed_precision,
        timeout=made.timeout,
        gpus=made.device == "cuda",
        threads_per_process=made.threads_per_process,
        accelerator_name=accelerator_name,
    )
    source = shell.user_ns.get("__vsc_ipynb_file__") or os.environ.get("JPY_SESSION_NAME") or "a notebook"
    return export_training_cell(history, shell.transform_cell, count, settings, script=path, port=port,
                                source=str(source))  # fmt: skip


def export_training_cell(
    history: Sequence[tuple[int, str]],
    transform: Callable[[str], str],
    training: int,
    settings: Settings,
    *,
    script: str,
    port: int = DEFAULT_PORT,
    source: str = "an IPython kernel",
) -> Export:
    """The training cell `training` (an execution count in `history`) and the earlier cells it depends on, as a
    script at `script` and a SLURM batch file next to it. Raises ExportError, one sentence saying what to do."""
    script, slurm = script_paths(script)
    cells = _read_cells([(count, raw) for count, raw in history if count <= training], transform)
    last = next(c for c in cells if c.count == training)
    used, display = _resolve([c for c in cells if c.count < training], last, settings.accelerator_name)
    taken = [c for c in cells if c.count in used]
    reasons = {c.count: _why(c, used[c.count], training) for c in taken}
    runs = commands(script, slurm, settings)
    needs = set().union(*(c.needs for c in taken))
    text = _script(taken, reasons, settings, runs, source, display, training, needs)
    try:
        compile(text, script, "exec")
    except SyntaxError as err:  # a translation that IPython's transform made unusual: say where, do not write
        raise ExportError(
            f"The exported script does not compile at its line {err.lineno} ({err.msg}): rewrite the magics of the "
            "cells it takes in Python, and export again."
        ) from None
    job = Path(script).stem or "train"
    return Export(
        script=text,
        slurm=slurm_script(script, settings, port, job),
        commands=runs,
        cells=tuple((c.count, reasons[c.count]) for c in taken),
        script_path=script,
        slurm_path=slurm,
    )
