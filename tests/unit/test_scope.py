"""scope.py: what a cell's code binds and uses, from the compiler's symbol tables and one walk in the order it runs."""

from __future__ import annotations

import ast

import pytest

from accel_magic.scope import Uses, bindings, scopes


def uses(source: str) -> Uses:
    tree = ast.parse(source)
    walk = Uses(scopes(tree))
    walk.walk(tree)
    return walk


@pytest.mark.parametrize(
    ("source", "deferred"),
    [
        ("def f():\n    model = build()\n    return model", {"build"}),
        ("def f(model):\n    return model, helper", {"helper"}),
        ("def f():\n    print(model)\n    model = 1", {"print"}),  # assigned anywhere in it: its own
        ("def setup():\n    global made\n    made = 1\n    return made", {"made"}),
        ("class C:\n    size = 2\n    def m(self):\n        return size", {"size"}),
        ("def outer():\n    scale = 2\n    def inner(x):\n        return x * scale\n    return inner", set()),
        ("def f():\n    squares = [v * v for v in values]\n    return v", {"values", "v"}),
        ("def f():\n    [hit := v for v in values]\n    return hit", {"values"}),
        ("def f():\n    ret = 1\n    class C:\n        ret = ret", {"ret"}),  # a class body's own, once bound
        ("class C:\n    def m(self):\n        __cache = {}\n        return __cache, __class__", set()),
        ("g = lambda x: [x * k for _ in range(n)]", {"k", "range", "n"}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_function_takes_from_the_module_what_it_does_not_bind(source: str, deferred: set[str]) -> None:
    assert set(uses(source).deferred) == deferred


@pytest.mark.parametrize(
    ("source", "needed"),
    [
        ("x = x + 1", {"x"}),
        ("y = 1\ny", set()),
        ("total = sum(v * w for v in values)", {"sum", "values", "w"}),
        ("[last := v for v in values]\nprint(last)", {"values", "print"}),
        ("[v for v in values]\nv", {"values", "v"}),
        ("class C:\n    n = size\n    size = 2\n    m = size", {"size"}),
        ("class C:\n    size = 2\n    twice = [size for _ in range(2)]", {"size", "range"}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_top_level_code_needs_what_it_loads_before_binding_it(source: str, needed: set[str]) -> None:
    assert set(uses(source).needed) == needed


def test_global_declarations_that_assign_bind_at_module_level() -> None:
    found = scopes(ast.parse("def setup():\n    global made, np, seen\n    made = 1\n    import numpy as np\n    seen"))
    assert found.assigned_globals == {"made", "np"}
    assert scopes(ast.parse("[t := v for v in values]")).assigned_globals == {"t"}


def test_each_scope_gets_its_own_table_whatever_its_line() -> None:
    tree = ast.parse("f, g = (lambda: a), (lambda b: b * c)\nn = [a for a in [b for b in c]]")
    lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
    comprehensions = [n for n in ast.walk(tree) if isinstance(n, ast.ListComp)]
    found = scopes(tree).of
    assert [(found[n].local, found[n].free) for n in lambdas] == [(set(), set()), ({"b"}, set())]
    assert [found[n].local - {".0"} for n in comprehensions] == [{"a"}, {"b"}]


def test_code_that_parses_but_does_not_compile_raises_syntax_error() -> None:
    with pytest.raises(SyntaxError):
        scopes(ast.parse("x = 1\nnonlocal x"))


@pytest.mark.parametrize(
    ("source", "names"),
    [
        ("a = b\nc = 1\nb = 2", ("a", "c", "b")),
        ("del gone", ()),
        ("n = [o for o in range(3)]\n[p := o for o in n]", ("n", "p")),
        ("if x:\n    q = 1\nelse:\n    r = 2\ndef f():\n    s = 1", ("q", "r", "f")),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bindings_are_the_top_level_names_in_the_order_first_bound(source: str, names: tuple[str, ...]) -> None:
    assert bindings(ast.parse(source)) == names
