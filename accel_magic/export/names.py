"""The names a cell needs from other cells, and the objects of other cells its top-level code changes."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ..scope import Scopes, Uses, scopes

__all__ = ["Names", "needed_names"]

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


class _Changes(Uses):
    """The walk of a cell that also finds the needed names whose objects its top-level code changes (`mutated`)."""

    def __init__(self, tables: Scopes) -> None:
        super().__init__(tables)
        self.mutated: set[str] = set()  # names from other cells whose objects its top-level code changes
        self.showing = 0  # inside the arguments of a call that shows them (print, display, logging)

    def change(self, node: ast.expr) -> None:
        """`node` (n.a.f's `n.a`, or an assignment target n.a / n[k]) changes the object its root name holds."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        if isinstance(node, ast.Name) and not self.in_function and self.from_module(node.id):
            if node.id not in self.module.bound:  # else the cell's own object
                self.mutated.add(node.id)

    def visit_Call(self, node: ast.Call) -> None:
        output = _output_call(node.func)
        if isinstance(node.func, ast.Attribute) and not (output or _reads(node.func, self.showing > 0)):
            self.change(node.func.value)
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
    before the training cell). Raises SyntaxError for code that parses but does not compile (`nonlocal` at top
    level)."""
    uses = _Changes(scopes(tree))
    uses.walk(tree)
    bound = frozenset(uses.module.bound) | uses.scopes.assigned_globals
    return Names(uses.needed, uses.deferred, bound, uses.star, frozenset(uses.mutated))
