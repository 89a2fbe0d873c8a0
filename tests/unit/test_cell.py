"""cell.py: what a cell binds, how it compiles, and how rank 0's results are packed and applied."""

from __future__ import annotations

import ast
import pickle

import pytest
import torch

from accel_magic.cell import CellError, compile_cell, pack_results, receive_results, top_level_names, unpack_results

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


def roundtrip(rank_ns, names, prepared, notebook, folder, max_bytes=2**62):
    """What travels: the manifest is pickled; the values go through files in the launch's folder."""
    packed = pickle.loads(pickle.dumps(pack_results(rank_ns, names, prepared, notebook, str(folder), max_bytes)))
    return receive_results(packed, str(folder))


def test_results_map_back_to_the_notebook_objects_all_at_once(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = [1, 2]
    notebook = {"model": model, "opt": opt, "dl": loader, "keep": "old"}
    # What a rank sees after `model, opt, dl = accelerator.prepare(model, opt, dl)` (fake wrappers).
    wrapped_model, wrapped_opt, wrapped_dl = object(), object(), object()
    trained = torch.nn.Linear(2, 2)
    rank_ns = {"model": wrapped_model, "opt": wrapped_opt, "dl": wrapped_dl, "keep": "new", "new_tensor": torch.ones(2)}
    prepared = {id(wrapped_model): trained, id(wrapped_opt): opt, id(wrapped_dl): loader}
    ids = {
        id(model): ("model", model),
        id(opt): ("opt", opt),
        id(loader): ("dl", loader),
        id(trained): ("model", trained),
    }
    apply, skipped = unpack_results(roundtrip(rank_ns, list(rank_ns), prepared, ids, tmp_path), notebook)
    assert notebook["keep"] == "old" and skipped == []  # nothing changes before apply()
    apply()
    assert notebook["model"] is model and torch.equal(model.weight, trained.weight)
    assert notebook["opt"] is opt and notebook["dl"] is loader
    assert notebook["keep"] == "new" and torch.equal(notebook["new_tensor"], torch.ones(2))


def test_a_state_that_does_not_fit_is_skipped_before_anything_changes(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    notebook = {"model": model, "other": 1}
    bigger = torch.nn.Linear(3, 2)
    received = roundtrip(
        {"model": bigger, "other": 2}, ["model", "other"], {}, {id(bigger): ("model", bigger)}, tmp_path
    )
    apply, skipped = unpack_results(received, notebook)
    assert [name for name, _ in skipped] == ["model"] and "changed shape" in skipped[0][1]
    apply()
    assert notebook["model"] is model and notebook["other"] == 2


def test_unpicklable_values_are_listed_not_fatal(tmp_path) -> None:
    import threading

    packed = pack_results({"lock": threading.Lock(), "ok": 1}, ["lock", "ok"], {}, {}, str(tmp_path))
    assert [n for n, *_ in packed.items] == ["ok"]
    assert packed.skipped[0][0] == "lock" and "pickle" in packed.skipped[0][1]


def test_an_object_made_in_the_rank_is_never_taken_for_a_notebook_object_with_the_same_id(tmp_path) -> None:
    """Ids of freed objects are reused: a new object at a notebook object's old address is a new value."""
    notebook_model = torch.nn.Linear(2, 2)
    made_in_rank = torch.nn.Linear(3, 3)
    stale = {id(made_in_rank): ("accelerator", notebook_model)}  # same id, another object
    packed = pack_results({"layer": made_in_rank}, ["layer"], {}, stale, str(tmp_path))
    assert [(name, action) for name, action, *_ in packed.items] == [("layer", "value")]


def test_results_past_the_limit_stop_with_the_biggest_named(tmp_path) -> None:
    from accel_magic.cell import ResultsTooLarge

    ns = {"small": torch.zeros(10), "big": torch.zeros(1_000_000), "later": torch.zeros(5)}
    with pytest.raises(
        ResultsTooLarge, match=r"over the 1 MB limit \(biggest: big 3.8 MB, small 0.0 MB, and 1 more not measured\)"
    ):
        pack_results(ns, ["small", "big", "later"], {}, {}, str(tmp_path), max_bytes=2**20)
