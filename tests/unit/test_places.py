"""launch.places without ranks: where a thread is (from frames whose files are named as torch's and a cell's are),
the slots the kernel shares with the ranks, and the judgement of when ranks can never meet, in words."""

from __future__ import annotations

import sys
import threading
import time
from types import FrameType

from accel_magic.launch import places
from accel_magic.launch.outcome import LaunchOutcome, RankFailure
from accel_magic.launch.places import Place, Places, Sampler, place_words, stuck, where
from accel_magic.train import launch_error, launch_interrupted

CELL = "/tmp/ipykernel_1/123.py"
C10D = f"{sys.prefix}/lib/python3/site-packages/torch/distributed/distributed_c10d.py"
LOGGER = f"{sys.prefix}/lib/python3/site-packages/torch/distributed/c10d_logger.py"
AUTOGRAD = f"{sys.prefix}/lib/python3/site-packages/torch/autograd/graph.py"
ACCELERATE = f"{sys.prefix}/lib/python3/site-packages/accelerate/accelerator.py"


def frame_of(files: list[tuple[str, str]], line_in_cell: int = 3) -> FrameType:
    """The innermost frame of a chain of calls, outermost first: (file, function) each; the cell's call sits at
    `line_in_cell` of its cell."""
    ns: dict[str, object] = {"sys": sys}
    inner = "return sys._getframe()"
    for index, (filename, name) in enumerate(reversed(files)):
        callee = f"f{index - 1}" if index else ""
        body = f"    return {callee}()\n" if callee else f"    {inner}\n"
        if filename == CELL:
            body = "    pass\n" * (line_in_cell - 2) + body
        exec(compile(f"def {name}():\n{body}", filename, "exec"), ns)
        ns[f"f{index}"] = ns[name]
    return ns[f"f{len(files) - 1}"]()  # type: ignore[operator,no-any-return]


def test_a_collective_is_named_by_torchs_outermost_function_and_the_cell_by_its_line_and_call() -> None:
    frame = frame_of([(CELL, "cell"), (ACCELERATE, "gather"), (LOGGER, "wrapper"), (C10D, "all_gather_object"),
                      (C10D, "all_gather"), (C10D, "_object_to_tensor")])  # fmt: skip
    assert where(frame, CELL) == (3, "all_gather_object", "gather", False)
    direct = frame_of([(CELL, "cell"), (LOGGER, "wrapper"), (C10D, "barrier")], line_in_cell=5)
    assert where(direct, CELL) == (5, "barrier", "", False)


def test_a_backward_counts_as_ddps_all_reduce_only_while_it_computes_nothing() -> None:
    frame = frame_of([(CELL, "cell"), (ACCELERATE, "backward"), (AUTOGRAD, "_engine_run_backward")])
    assert where(frame, CELL) == (3, places.DDP_AVERAGE, "backward", True)


def test_frames_outside_the_cell_and_torch_name_no_collective_and_an_unknown_cell_no_line() -> None:
    assert where(frame_of([(CELL, "cell"), ("/home/u/lib.py", "step")], line_in_cell=7), CELL) == (7, "", "step", False)
    assert where(frame_of([(CELL, "cell"), (C10D, "barrier")]), "") == (0, "barrier", "", False)
    assert where(None, CELL) == (0, "", "", False)
    ending = frame_of([(CELL, "cell"), (C10D, "destroy_process_group")])
    assert where(ending, CELL) == (3, "", "destroy_process_group", False)  # the group's end meets nobody


def test_the_slots_give_back_what_each_rank_wrote_and_nothing_for_a_rank_that_wrote_none() -> None:
    shared = Places(3)
    shared.write(0, Place("waits", 3, "all_gather", "gather", 7, 12.5))
    shared.write(2, Place("cell", 9))
    shared.write(2, Place("done"))
    assert shared.all(first_rank=4) == {4: Place("waits", 3, "all_gather", "gather", 7, 12.5), 6: Place("done")}
    shared.close()


def test_a_sampler_writes_where_its_thread_is_and_done_when_the_cell_finished() -> None:
    shared = Places(1)
    sampler = Sampler(shared, 0, __file__)  # this file stands for the cell
    place = sampler.sample()
    assert (place.state, place.op) == ("cell", "")
    assert place.line == sys._getframe().f_lineno - 2
    sampler.finish()
    assert shared.read(0) == Place("done")
    sampler.thread.join(1)
    assert not sampler.thread.is_alive()


def test_a_sampler_keeps_the_last_cell_line_once_its_thread_left_the_cell(monkeypatch) -> None:
    # Between an exception leaving the cell's frame and Sampler.stop, a sample sees neither a cell line nor a
    # collective: the slot keeps where the cell was, for the words of an interrupt or a stop.
    monkeypatch.setattr(places, "EVERY", 60)  # only the samples taken here
    shared = Places(1)
    sampler = Sampler(shared, 0, CELL)
    ns = {"sampler": sampler}
    exec(compile("def cell():\n    return sampler.sample()\n", CELL, "exec"), ns)
    assert ns["cell"]().line == 2
    assert sampler.sample().line == 0  # this frame is not the cell's
    kept = shared.read(0)
    assert kept is not None and (kept.state, kept.line, kept.called) == ("cell", 2, "sample")
    sampler.stop()
    sampler.thread.join(1)


def test_a_thread_blocked_in_a_collective_waits_there_since_it_entered_and_a_busy_backward_does_not() -> None:
    shared = Places(1)
    entered, release = threading.Event(), threading.Event()
    ns: dict[str, object] = {"entered": entered, "release": release, "Sampler": Sampler, "shared": shared}
    exec(compile("def barrier():\n    entered.set()\n    release.wait(10)\n", C10D, "exec"), ns)
    exec(compile("def backward():\n    entered.set()\n    while not release.is_set(): pass\n", AUTOGRAD, "exec"), ns)
    for name, state in (("barrier", "waits"), ("backward", "cell")):
        samplers: list[Sampler] = []
        ns["samplers"] = samplers
        entered.clear()
        release.clear()
        exec(
            compile(f"def cell():\n    samplers.append(Sampler(shared, 0, {CELL!r}))\n    {name}()\n", CELL, "exec"), ns
        )
        worker = threading.Thread(target=ns["cell"], daemon=True)  # type: ignore[arg-type]
        worker.start()
        assert entered.wait(5)
        first = samplers[0].sample()
        time.sleep(0.3)
        second = samplers[0].sample()
        release.set()
        worker.join(5)
        samplers[0].stop()
        assert (second.state, second.line) == (state, 3)
        if state == "waits":
            assert (second.op, second.since) == ("barrier", first.since)
        else:
            assert second.op == places.DDP_AVERAGE  # where it is, but computing: not waiting


def waits(op: str, line: int, seq: int, since: float = 0.0, called: str = "") -> Place:
    return Place("waits", line, op, called, seq, since)


def test_ranks_in_different_collectives_or_counts_can_never_meet_and_the_words_name_each_place() -> None:
    now = 10.0
    mismatch = {0: waits("all_gather_into_tensor", 3, 4, called="gather"), 1: waits("barrier", 5, 4)}
    assert stuck(mismatch, {0, 1}, now) == (
        "rank 0 waits in gather (all_gather_into_tensor) at cell line 3, rank 1 in barrier at cell line 5"
    )
    counts = {0: waits("all_reduce", 4, 6), 1: waits("all_reduce", 4, 5)}
    assert stuck(counts, {0, 1}, now) == (
        "rank 0 waits in all_reduce (collective 6) at cell line 4, rank 1 in all_reduce (collective 5) at cell line 4"
    )
    finished = {0: waits("barrier", 7, 3), 1: Place("done"), 2: Place("done")}
    assert (
        stuck(finished, {0, 1, 2}, now)
        == "rank 0 waits in barrier at cell line 7, and ranks 1 and 2 had finished the cell"
    )


def test_waits_that_will_end_are_left_alone() -> None:
    now = 10.0
    same = {0: waits("all_reduce", 4, 6), 1: waits("all_reduce", 4, 6)}
    assert stuck(same, {0, 1}, now) == ""  # the same collective: slow, not stuck
    evaluating = {0: Place("cell", 9), 1: waits("barrier", 12, 3)}
    assert stuck(evaluating, {0, 1}, now) == ""  # rank 0 computes: it may still come
    just_now = {0: waits("all_gather", 3, 4), 1: waits("barrier", 5, 4, since=now - places.STEADY / 2)}
    assert stuck(just_now, {0, 1}, now) == ""  # not long enough: it may be passing through
    assert stuck({0: waits("barrier", 5, 4)}, {0, 1}, now) == ""  # rank 1 has not said where it is yet
    assert stuck({0: Place("done"), 1: Place("done")}, {0, 1}, now) == ""


def test_a_stuck_launch_says_so_in_one_sentence_and_a_timeout_and_an_interrupt_name_each_ranks_place() -> None:
    outcome = LaunchOutcome(2, exitcodes={0: -15, 1: -15})
    outcome.stuck = "rank 0 waits in all_gather at cell line 3, rank 1 in barrier at cell line 5"
    outcome.failures = [RankFailure(r, -15, "signal", "was killed by SIGTERM") for r in (0, 1)]
    assert not outcome.ok
    assert launch_error(outcome, 900).headline == (
        "rank 0 waits in all_gather at cell line 3, rank 1 in barrier at cell line 5: every rank must reach the "
        "same collectives in the same order; nothing was brought back."
    )
    timed_out = LaunchOutcome(2)
    timed_out.failures = [RankFailure(1, 1, "timeout", "RuntimeError: Timed out waiting 20000ms", when=5.0)]
    timed_out.places = {0: Place("cell", 9), 1: waits("barrier", 5, 4)}
    assert launch_error(timed_out, 20).headline == (
        "rank 1: a collective waited more than 20 s (--timeout) for the other ranks; every rank must reach the same "
        "collectives (RuntimeError: Timed out waiting 20000ms; rank 0 was at cell line 9, rank 1 in barrier at "
        "cell line 5); the other ranks were stopped."
    )
    tb = "Traceback (most recent call last):\n  Cell line 5, in <module>\n    dist.barrier()\nKeyboardInterrupt\n"
    stopped = LaunchOutcome(2, interrupted=True, started=(0, 1))
    stopped.failures = [RankFailure(1, 1, "exception", "KeyboardInterrupt", tb, when=1.0)]
    stopped.places = {0: Place("cell", 9), 1: waits("barrier", 5, 4)}
    assert str(launch_interrupted(stopped)) == (
        "the 2 ranks were stopped (rank 0 was at cell line 9, rank 1 in barrier at cell line 5)"
    )
    assert str(launch_interrupted(stopped, "train's cell")) == (
        "the 2 ranks were stopped (rank 0 was at line 9 of train's cell, rank 1 in barrier at line 5 of train's cell)"
    )
    assert place_words({0: Place("done"), 1: waits("barrier", 5, 4)}) == (
        "rank 1 was in barrier at cell line 5, rank 0 had finished the cell"
    )
