"""results.py: how rank 0's results are packed, read back and applied to the notebook's own objects."""

from __future__ import annotations

import pickle

import pytest
import torch

from accel_magic.results import pack_results, receive_results, unpack_results


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
    from accel_magic.results import ResultsTooLarge

    ns = {"small": torch.zeros(10), "big": torch.zeros(1_000_000), "later": torch.zeros(5)}
    with pytest.raises(
        ResultsTooLarge, match=r"over the 1 MB limit \(biggest: big 3.8 MB, small 0.0 MB, and 1 more not measured\)"
    ):
        pack_results(ns, ["small", "big", "later"], {}, {}, str(tmp_path), max_bytes=2**20)
