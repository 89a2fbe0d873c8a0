"""The names a cell needs from other cells, and the objects of other cells its top-level code changes."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Names", "needed_names"]

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
