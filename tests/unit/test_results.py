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


def test_state_handed_to_accelerate_comes_back_without_rebinding_what_the_cell_bound(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    sched_opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(sched_opt, lambda step: 1 / (step + 1))
    notebook = {"model": model, "sched": sched, "sched_opt": sched_opt}
    ids = {id(v): (k, v) for k, v in notebook.items()}
    trained = torch.nn.Linear(2, 2)
    sched_opt.step()
    sched.step()  # the rank's copy of the scheduler went on (fork keeps the id; here the same object)
    # The cell prepared model and scheduler without binding them, and bound `model` to something of its own.
    rank_ns = {"model": "replaced by the cell"}
    prepared = {id(object()): trained, 1: sched}
    received = roundtrip(rank_ns, ["model"], prepared, {**ids, id(trained): ("model", trained)}, tmp_path)
    sched_state = sched.state_dict()
    sched.load_state_dict({**sched_state, "last_epoch": 0})
    apply, skipped = unpack_results(received, notebook)
    apply()
    assert skipped == []
    assert notebook["model"] == "replaced by the cell"  # the cell's own binding stands
    assert sched.last_epoch == 1 and notebook["sched"] is sched  # the scheduler's state came back in place
    assert torch.equal(model.weight, trained.weight)  # and the unbound model's weights


def test_a_state_dict_that_raises_is_listed_not_fatal(tmp_path) -> None:
    class Broken(torch.nn.Module):
        def state_dict(self, *args, **kwargs):
            raise RuntimeError("hooks went wrong")

    broken = Broken()
    packed = pack_results({"net": broken, "ok": 1}, ["net", "ok"], {}, {id(broken): ("net", broken)}, str(tmp_path))
    assert [item.name for item in packed.items] == ["ok"]
    assert packed.skipped[0].name == "net" and "hooks went wrong" in packed.skipped[0].reason


def test_applying_stops_between_names_and_says_which_were_applied(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    notebook = {"model": model, "a": 0, "b": 0}
    trained = torch.nn.Linear(2, 2)
    received = roundtrip(
        {"a": 1, "model": trained, "b": 2}, ["a", "model", "b"], {}, {id(trained): ("model", trained)}, tmp_path
    )
    apply, skipped = unpack_results(received, notebook)
    asked = []

    def stop() -> bool:
        asked.append(len(asked))
        return len(asked) > 1  # the interrupt comes while the first name is applied

    assert apply(stop) == ["a"] and skipped == []
    assert notebook == {"model": model, "a": 1, "b": 0}
    assert torch.equal(model.weight, before)  # the model's state was left as it was, not half-loaded
    assert apply() == ["a", "model", "b"] and torch.equal(model.weight, trained.weight) and notebook["b"] == 2
