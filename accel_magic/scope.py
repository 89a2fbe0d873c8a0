"""What a cell's code binds and uses, from the compiler's symbol tables.

symtable says which names each function, lambda, class and comprehension has of its own, and which it takes from
an enclosing function: the rest come from the module. It keeps no order, which top-level code needs (`x = x + 1`
needs x, `y = 1; y` does not), and counts `del x` as a binding: what the top level binds, and when, comes from one
walk of the syntax tree in the order Python runs it (`Walk`).
"""

from __future__ import annotations

import ast
import symtable
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["Scope", "Scopes", "scopes", "Walk", "Uses", "bindings"]

_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, *_COMPREHENSIONS)
_MARKER = "_accel_scope_"


@dataclass(frozen=True)
class Scope:
    """What symtable says of one function, lambda, class or comprehension (names as the compiler spells them: a
    class's private names mangled)."""

    local: frozenset[str]  # its own: parameters, what it binds (not what it declares global or nonlocal)
    free: frozenset[str]  # taken from an enclosing function or comprehension


@dataclass(frozen=True)
class Scopes:
    """symtable's facts for every scope of a cell, by its node in the cell's tree."""

    of: dict[ast.AST, Scope]
    assigned_globals: frozenset[str]  # declared global where bound: `global x; x = 1` in a function, a walrus in
    # a top-level comprehension


def _marked(tree: ast.Module) -> tuple[ast.Module, list[ast.AST]]:
    """The copy of a cell that symtable reads, and the cell's scope nodes by marker number. Each scope loads a marker
    name of its own, so that its table is found whatever the lines and the order symtable gives them; each
    comprehension is a generator expression, which has the same scope but keeps its table (3.12 folds the others'
    into the enclosing one, PEP 709). Built in a loop: copy.deepcopy runs out of stack long before ast.unparse."""
    twins: dict[int, ast.AST] = {}
    marked: list[ast.AST] = []

    def twin(value: object) -> object:
        if isinstance(value, list):
            return [twin(v) for v in value]
        return twins[id(value)] if isinstance(value, ast.AST) else value

    for node in reversed(list(ast.walk(tree))):  # a node after those inside it
        fields = {name: twin(value) for name, value in ast.iter_fields(node)}
        kind = type(node)
        if isinstance(node, _SCOPES):
            marker = ast.Name(f"{_MARKER}{len(marked)}", ast.Load())
            marked.append(node)
            if isinstance(node, ast.Lambda):
                fields["body"] = ast.Tuple([marker, fields["body"]], ast.Load())
            elif isinstance(node, _COMPREHENSIONS):
                parts = [fields.pop("key"), fields.pop("value")] if isinstance(node, ast.DictComp) else [fields["elt"]]
                kind, fields["elt"] = ast.GeneratorExp, ast.Tuple([marker, *parts], ast.Load())
            else:
                fields["body"] = [ast.Expr(marker), *fields["body"]]
        twins[id(node)] = ast.copy_location(kind(**fields), node)  # ast.unparse reads a statement's line
    return twins[id(tree)], marked  # type: ignore[return-value]


def scopes(tree: ast.Module) -> Scopes:
    """symtable's facts for the scopes of `tree`. Raises SyntaxError for code that parses but does not compile, as
    `nonlocal x` at top level or a name used before its `global` declaration."""
    twin, marked = _marked(tree)
    top = symtable.symtable(ast.unparse(twin), "<cell>", "exec")
    found: dict[ast.AST, Scope] = {}
    assigned_globals: set[str] = set()
    tables = list(top.get_children())  # 3.12's type-parameter and type-alias scopes among them, with no marker
    while tables:  # a table before those inside it
        table = tables.pop()
        tables.extend(table.get_children())
        symbols = table.get_symbols()
        scope = Scope(
            frozenset(s.get_name() for s in symbols if s.is_local()),
            frozenset(s.get_name() for s in symbols if s.is_free()),
        )
        for symbol in symbols:
            name = symbol.get_name()
            if name.startswith(_MARKER):
                found[marked[int(name[len(_MARKER) :])]] = scope
            if symbol.is_declared_global() and (symbol.is_assigned() or symbol.is_imported()):
                assigned_globals.add(name)
    return Scopes(found, frozenset(assigned_globals))


def _mangle(name: str, class_name: str) -> str:
    """`name` as the compiler spells it inside class `class_name`: a private name (__x) as _Class__x."""
    owner = class_name.lstrip("_")
    if not owner or not name.startswith("__") or name.endswith("__") or "." in name:
        return name
    return f"_{owner}{name}"


@dataclass
class _Frame:
    kind: str  # "module", "class", "function" (a def or a lambda) or "comprehension"
    scope: Scope | None = None  # symtable's facts, for all but the module
    name: str = ""  # a class's, for the private names it mangles
    bound: dict[str, None] = field(default_factory=dict)  # in the module and a class: what its code bound so far


class Walk(ast.NodeVisitor):
    """A cell's code in the order Python runs it: the names its top level binds, in order (bound in one branch of
    an if, a try or a match counts as bound after it), with a hook for each name it loads (`use`) and for each
    object an assignment or a `del` changes through an attribute or an item (`change`)."""

    def __init__(self, tables: Scopes | None = None) -> None:
        self.scopes = tables if tables is not None else Scopes({}, frozenset())
        self.module = _Frame("module")
        self.frames = [self.module]
        self.star = False  # the cell has `from ... import *`

    def walk(self, tree: ast.Module) -> None:
        for stmt in tree.body:
            self.visit(stmt)

    def use(self, name: str, line: int) -> None:
        """`name` is loaded (or deleted) at `line`, where the walk is."""

    def change(self, node: ast.Attribute | ast.Subscript) -> None:
        """An assignment or a `del` changes the object `node`'s value holds."""

    # names

    @property
    def frame(self) -> _Frame:
        return self.frames[-1]

    def store(self, name: str) -> None:
        if self.frame.kind != "function":
            self.frame.bound.setdefault(name, None)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.store(node.id)
        else:
            self.use(node.id, node.lineno)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._target(target)

    def _target(self, node: ast.AST) -> None:
        """An assignment target: subscripts and attributes load their objects and change them; names bind."""
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                self.change(sub)
        self.visit(node)

    # statements, in the order Python evaluates them

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._target(target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self.use(node.target.id, node.lineno)
        self.visit(node.value)
        self._target(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        if self.frame.kind != "function":  # a function does not evaluate its annotations of names
            self.visit(node.annotation)
        self._target(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        frame = next(f for f in reversed(self.frames) if f.kind != "comprehension")
        if frame.kind != "function":  # the walrus binds in the scope that holds the comprehension
            frame.bound.setdefault(node.target.id, None)

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
        before = dict(self.frame.bound)
        after = dict(before)
        for handler in node.handlers:
            self.frame.bound = dict(before)
            self.visit(handler)
            after.update(self.frame.bound)
        self.frame.bound = after
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
        before = dict(self.frame.bound)
        after = dict(before)
        for case in node.cases:
            self.frame.bound = dict(before)
            self.visit(case.pattern)
            if case.guard is not None:
                self.visit(case.guard)
            self._block(case.body)
            after.update(self.frame.bound)
        self.frame.bound = after

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
        before = dict(self.frame.bound)
        after = dict(before)
        for body in bodies:
            self.frame.bound = dict(before)
            self._block(body)
            after.update(self.frame.bound)
        self.frame.bound = after

    # scopes: what the enclosing scope evaluates first (defaults, decorators, bases), then the scope's own code

    @contextmanager
    def _inside(self, node: ast.AST, kind: str, name: str = "") -> Iterator[None]:
        self.frames.append(_Frame(kind, self.scopes.of.get(node), name))
        try:
            yield
        finally:
            self.frames.pop()

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.visit(default)
        if isinstance(node, ast.Lambda):
            with self._inside(node, "function"):
                self.visit(node.body)
            return
        for deco in node.decorator_list:
            self.visit(deco)
        args = node.args
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        for annotation in [a.annotation for a in every if a is not None] + [node.returns]:
            if annotation is not None:
                self.visit(annotation)
        with self._inside(node, "function"):
            self._block(node.body)
        self.store(node.name)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        with self._inside(node, "class", node.name):
            self._block(node.body)
        self.store(node.name)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp) -> None:
        self.visit(node.generators[0].iter)  # evaluated in the enclosing scope
        with self._inside(node, "comprehension"):
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

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension  # type: ignore[assignment]


class Uses(Walk):
    """The walk with symtable's facts: the names the cell takes from other cells, `needed` (loaded at top level
    before the cell binds them, with the line of the first such load) and `deferred` (loaded by its functions,
    which look them up when called, with the first line)."""

    def __init__(self, tables: Scopes) -> None:
        super().__init__(tables)
        self.needed: dict[str, int] = {}
        self.deferred: dict[str, int] = {}

    @property
    def in_function(self) -> bool:
        return any(frame.kind == "function" for frame in self.frames)

    def from_module(self, name: str) -> bool:
        """Loaded where the walk is, `name` is looked up in the module: symtable's fact, but for a class body, whose
        names are its own only once its code has bound them (before, Python looks in the module)."""
        frame = self.frame
        if frame is self.module or frame.scope is None:
            return True
        owner = next((f.name for f in reversed(self.frames) if f.kind == "class"), "")
        spelled = _mangle(name, owner)
        if spelled in frame.scope.free:
            return False
        if frame.kind == "class":
            return name not in frame.bound
        return spelled not in frame.scope.local

    def use(self, name: str, line: int) -> None:
        if not self.from_module(name):
            return
        if self.in_function:
            self.deferred.setdefault(name, line)
        elif name not in self.module.bound:
            self.needed.setdefault(name, line)


def bindings(tree: ast.Module) -> tuple[str, ...]:
    """The names the cell binds at top level, in the order it first binds them. Dynamic bindings (exec,
    globals()[...]) are not seen."""
    walk = Walk()
    walk.walk(tree)
    return tuple(walk.module.bound)
