"""cell.py: what a cell binds and how it compiles."""

from __future__ import annotations

import ast

import pytest

from accel_magic.cell import CellError, compile_cell, top_level_names

NAMES = [
    ("assignment and tuple unpacking", "a = 1\nb, (c, d) = 2, (3, 4)", ("a", "b", "c", "d")),
    ("augmented and annotated", "e += 1\nf: int = 2", ("e", "f")),
    (
        "for, with and except targets",
        "for g in x: pass\nwith y as h: pass\ntry: pass\nexcept E as i: pass",
        ("g", "h", "i"),
    ),
    ("def and class names, not their bodies", "def j():\n    k = 1\nclass L:\n    m = 2", ("j", "L")),
    ("imports", "import os.path\nimport numpy as np\nfrom math import pi, e as euler", ("os", "np", "pi", "euler")),
    ("comprehension variables stay inside", "n = [o for o in range(3)]", ("n",)),
    ("walrus at top level", "if (p := 3): pass", ("p",)),
    ("inside if and while blocks", "if x:\n    q = 1\nwhile y:\n    r = 2", ("q", "r")),
    ("lambda parameters stay inside", "s = lambda t: t", ("s",)),
    ("underscore and dunders are not results", "_ = 1\n__all__ = []\n_private = 2", ("_private",)),
    ("attribute and item stores bind nothing", "u.v = 1\nw[0] = 2", ()),
]


@pytest.mark.parametrize(("source", "names"), [n[1:] for n in NAMES], ids=[n[0] for n in NAMES])
def test_top_level_names(source: str, names: tuple[str, ...]) -> None:
    assert top_level_names(ast.parse(source)) == names


BAD_CELLS = [
    ("empty", "", "The cell is empty"),
    ("only comments", "# a\n\n   # b\n", "The cell is empty"),
    ("syntax error with its line", "x = 1\ny = = 2", "Syntax error at cell line 2 (y = = 2)"),
    ("top-level await", "await thing()", "Top-level await is not supported"),
    ("a NUL character", "x = 1\x00", "NUL character"),
    ("a lone surrogate", "x = '\ud800'", "lone surrogate"),
]


@pytest.mark.parametrize(("source", "says"), [b[1:] for b in BAD_CELLS], ids=[b[0] for b in BAD_CELLS])
def test_bad_cells_are_one_sentence(source: str, says: str) -> None:
    with pytest.raises(CellError) as info:
        compile_cell(source)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_megabyte_cell_compiles_with_its_names() -> None:
    source = "x = 0\n" + "x += 1\n" * 150_000
    assert len(source) > 1_000_000
    assert compile_cell(source).bound == ("x",)


def test_compiled_cell_shows_its_lines_in_tracebacks() -> None:
    import traceback

    cell = compile_cell("a = 1\nraise ValueError('x')")
    try:
        exec(cell.code, {})
    except ValueError as err:
        frames = traceback.extract_tb(err.__traceback__)
    assert frames[-1].filename == cell.filename and frames[-1].line == "raise ValueError('x')"


def test_blank_lines_that_ipythons_transform_drops_at_the_top_still_count() -> None:
    import traceback

    from IPython.core.inputtransformer2 import TransformerManager

    cell = compile_cell("\n\na = 1\n!true\nraise ValueError('x')", TransformerManager().transform_cell)
    try:
        exec(cell.code, {"get_ipython": lambda: type("Shell", (), {"system": lambda self, cmd: None})()})
    except ValueError as err:
        frames = traceback.extract_tb(err.__traceback__)
    assert frames[-1].lineno == 5 and frames[-1].line == "raise ValueError('x')"
