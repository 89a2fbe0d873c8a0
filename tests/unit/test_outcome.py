"""outcome.collect and launch_error from records alone: what each rank left in the launch's folder, and how its
process was seen to end, become the failures, durations and exit codes of the outcome, and one headline."""

from __future__ import annotations

from accel_magic.errors import error_line
from accel_magic.launch.outcome import LaunchOutcome, NodeOptions, RankFailure, RankRecords, collect
from accel_magic.train import launch_error, launch_interrupted

VALUE_ERROR_TB = "Traceback (most recent call last):\n  Cell line 2, in <module>\n    boom()\nValueError: x\n"


def test_a_rank_with_an_error_record_becomes_a_failure_and_a_rank_that_ended_well_does_not() -> None:
    error = RankFailure(0, 1, "exception", "ValueError: x", VALUE_ERROR_TB, when=10.0)
    outcome = LaunchOutcome(2, exitcodes={0: 1, 1: 0})
    collect(outcome, {0: RankRecords(started=True, error=error), 1: RankRecords(started=True, duration=2.5)})
    assert outcome.failures == [error]
    assert outcome.durations == {1: 2.5}
    assert not outcome.ok


def test_a_rank_that_started_left_no_record_and_was_seen_killed_is_reported_killed_and_is_the_root_cause() -> None:
    # The peer's collateral error was written *before* the kill was seen: the kill still comes first.
    collateral = RankFailure(0, 1, "collateral", "RuntimeError: Connection closed by peer", when=99.0)
    outcome = LaunchOutcome(2, exitcodes={0: 1, 1: -15}, ended={1: (-9, 100.5)})
    collect(outcome, {0: RankRecords(started=True, error=collateral), 1: RankRecords(started=True)})
    assert len(outcome.failures) == 2
    killed = next(f for f in outcome.failures if f.rank == 1)
    assert (killed.kind, killed.exitcode, killed.when) == ("signal", -9, 100.5)
    assert killed.summary == "was killed by SIGKILL (as the out-of-memory killer does)"
    assert outcome.root_cause() == killed
    assert str(launch_error(outcome, 900)) == (
        "rank 1 was killed by SIGKILL (as the out-of-memory killer does); the other ranks were stopped."
    )


def test_a_rank_the_out_of_memory_killer_ended_names_its_peak_the_limit_and_what_to_try() -> None:
    # rank 0 was seen to end first, by the SIGTERM it got once rank 1 was gone, whose large exit took longer
    records = {0: RankRecords(started=True), 1: RankRecords(started=True)}
    ended = {0: (-15, 100.0), 1: (-9, 100.5)}
    for limit, within in [
        ((3 * 2**30, "cgroup v1"), "; the kernel and its ranks may use 3.0 GiB, the cgroup v1 limit"),
        ((16 * 2**30, "machine"), "; the machine has 16.0 GiB"),
        (None, ""),
    ]:
        outcome = LaunchOutcome(2, exitcodes={0: -15, 1: -9}, ended=dict(ended), peaks={0: 2**29, 1: 2**31})
        outcome.oom_killed, outcome.memory_limit = True, limit
        collect(outcome, records)
        assert str(launch_error(outcome, 900)) == (
            f"rank 1 was killed by the out-of-memory killer at 2.0 GiB (its peak{within}): try fewer ranks, a smaller "
            "batch or bf16 mixed precision; the other ranks were stopped."
        )
    outcome = LaunchOutcome(2, exitcodes={0: -15, 1: -9}, ended=dict(ended), peaks={1: 2**31})
    collect(outcome, records)  # no out-of-memory kill counted: rank 0's SIGTERM was the launch stopping it
    assert str(launch_error(outcome, 900)) == (
        "rank 1 was killed by SIGKILL (as the out-of-memory killer does); the other ranks were stopped."
    )
    # neither end seen (the agent reaped both first): rank 0, ended without a code that says why, was stopped
    outcome = LaunchOutcome(2, exitcodes={0: 0, 1: -9})
    collect(outcome, records)
    assert str(launch_error(outcome, 900)).startswith("rank 1 was killed by SIGKILL")
    outcome = LaunchOutcome(2, exitcodes={0: -15, 1: -15}, ended={0: (-15, 100.0), 1: (-15, 100.5)})
    collect(outcome, records)  # every rank ended by SIGTERM: the first end seen is the root
    assert str(launch_error(outcome, 900)) == "rank 0 was killed by SIGTERM; the other ranks were stopped."


def test_a_rank_seen_without_a_watch_is_named_by_the_agents_exit_code_and_its_time_is_unknown() -> None:
    outcome = LaunchOutcome(2, exitcodes={0: 0, 1: 3})
    collect(outcome, {0: RankRecords(started=True, duration=1.0), 1: RankRecords(started=True)})
    assert outcome.failures == [
        RankFailure(1, 3, "signal", "ended with exit code 3 without raising an exception", when=None)
    ]


def test_a_rank_that_never_started_and_left_no_record_is_not_blamed() -> None:
    error = RankFailure(0, 1, "exception", "ValueError: x", when=5.0)
    outcome = LaunchOutcome(2, exitcodes={0: 1, 1: -15}, ended={0: (1, 5.1), 1: (-15, 5.2)})
    collect(outcome, {0: RankRecords(started=True, error=error), 1: RankRecords()})
    assert outcome.failures == [error]
    assert outcome.exitcodes == {0: 1, 1: -15}


def test_durations_come_from_the_ranks_records() -> None:
    outcome = LaunchOutcome(3, exitcodes={0: 0, 1: 0, 2: 0})
    records = {
        0: RankRecords(started=True, duration=1.25),
        1: RankRecords(started=True, duration=2.5),
        2: RankRecords(started=True, duration=0.75),
    }
    collect(outcome, records)
    assert outcome.durations == {0: 1.25, 1: 2.5, 2: 0.75}
    assert outcome.failures == [] and outcome.ok


def test_when_nothing_failed_a_rank_without_a_status_record_is_not_made_a_failure() -> None:
    outcome = LaunchOutcome(2, exitcodes={0: 0, 1: 0}, ended={0: (0, 1.0), 1: (0, 1.1)})
    collect(outcome, {0: RankRecords(started=True, duration=0.9), 1: RankRecords(started=True)})
    assert outcome.failures == []
    assert outcome.ok
    assert outcome.durations == {0: 0.9}


def test_exit_codes_seen_when_the_processes_ended_override_the_agents() -> None:
    # The agent reports the SIGTERM it sent while tearing down; the watch saw the process end by SIGKILL first.
    # A rank the agent did not report at all still gets the code the watch saw.
    outcome = LaunchOutcome(3, exitcodes={0: 1, 1: -15}, ended={1: (-9, 7.0), 2: (-15, 7.2)})
    error = RankFailure(0, 1, "collateral", "Connection reset by peer", when=7.1)
    records = {0: RankRecords(started=True, error=error), 1: RankRecords(started=True), 2: RankRecords()}
    collect(outcome, records)
    assert outcome.exitcodes == {0: 1, 1: -9, 2: -15}
    assert [f.exitcode for f in outcome.failures if f.rank == 1] == [-9]


def test_the_headline_names_the_rank_whose_error_was_recorded_first() -> None:
    records = {
        0: RankRecords(started=True, error=RankFailure(0, 1, "exception", "KeyError: 'a'", when=30.0)),
        1: RankRecords(started=True, error=RankFailure(1, 1, "collateral", "Connection closed by peer", when=10.0)),
        2: RankRecords(started=True, error=RankFailure(2, 1, "exception", "ValueError: b", when=20.0)),
        3: RankRecords(started=True, duration=4.0),
    }
    outcome = LaunchOutcome(4, exitcodes={0: 1, 1: 1, 2: 1, 3: 0})
    collect(outcome, records)
    err = launch_error(outcome, 900)
    assert err.headline == "rank 2 raised ValueError: b; the other ranks were stopped."
    assert err.outcome is outcome


def test_a_failure_inside_accel_magic_says_so_and_ends_its_details_with_the_versions() -> None:
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in setup\nImportError: no accelerate\n'
    internal = RankFailure(
        0,
        70,
        "internal",
        "before the cell ran: ImportError: no accelerate",
        tb,
        when=3.0,
        versions="python 3.12.1, torch 2.5.1, accelerate -",
    )
    outcome = LaunchOutcome(2, exitcodes={0: 70, 1: -15})
    collect(outcome, {0: RankRecords(started=True, error=internal), 1: RankRecords(started=True)})
    err = launch_error(outcome, 900)
    assert err.headline.startswith(
        "accel_magic failed inside rank 0 before the cell ran: ImportError: no accelerate; the other ranks were "
        "stopped. This is a bug in accel_magic, not in your cell"
    )
    details = err.details.split("\n")
    assert details[-1] == "versions: python 3.12.1, torch 2.5.1, accelerate -"
    assert details[-2] == "ImportError: no accelerate"


def test_across_machines_a_node_whose_ranks_were_stopped_for_another_node_says_where_it_started() -> None:
    outcome = LaunchOutcome(2, first_rank=2, num_nodes=2, endpoint="10.0.0.5:29500")
    outcome.remote_failure = "rank 1: ValueError: bad batch"
    outcome.exitcodes = {2: -15, 3: -15}
    collect(outcome, {2: RankRecords(started=True), 3: RankRecords(started=True)})
    assert outcome.root_cause().kind == "signal"
    err = launch_error(outcome, 900)
    assert err.headline == (
        "the launch failed on another node (rank 1: ValueError: bad batch), so this node's ranks were stopped; "
        "that node's cell names the rank and the line."
    )


def test_across_machines_ranks_that_lost_their_peers_point_to_the_other_node() -> None:
    outcome = LaunchOutcome(1, first_rank=0, num_nodes=2, endpoint="10.0.0.5:29500", exitcodes={0: 1})
    lost = RankFailure(0, 1, "collateral", "RuntimeError: Connection closed by peer [10.0.0.6]:4242", when=1.0)
    collect(outcome, {0: RankRecords(started=True, error=lost)})
    headline = launch_error(outcome, 900).headline
    assert headline.startswith("rank 0 lost the ranks of another node (RuntimeError: Connection closed by peer")
    assert "the failure started on another node, whose cell names the rank and the line" in headline


def test_across_machines_a_rendezvous_that_never_formed_says_how_to_start_the_nodes() -> None:
    outcome = LaunchOutcome(1, num_nodes=3, endpoint="10.0.0.5:29500", agent_error="node 0 did not answer within 60 s")
    headline = launch_error(outcome, 60).headline
    assert headline == (
        "this node could not form one group with the other 2 nodes at 10.0.0.5:29500 (node 0 did not answer within "
        "60 s): start the cell on every node within 60 s (--timeout), each with its own --node-rank and the same "
        "--nodes and --rdzv-endpoint; nothing was trained."
    )


def test_across_machines_node_0_says_how_many_nodes_joined_within_the_rendezvous_timeout_in_one_sentence() -> None:
    outcome = LaunchOutcome(1, num_nodes=3, endpoint="10.0.0.5:29500", rdzv_timeout=5, nodes_joined=2)
    outcome.agent_error = "DistStoreError: Timed out after 6 seconds waiting for clients. 2/3 clients joined."
    headline = launch_error(outcome, 900).headline
    assert headline == (
        "this node could not form one group with the other 2 nodes at 10.0.0.5:29500 (2 of the 3 nodes joined "
        "within 5 s): start the cell on every node within 5 s (--timeout), each with its own --node-rank and the "
        "same --nodes and --rdzv-endpoint; nothing was trained."
    )


def test_across_machines_the_drop_in_names_its_own_arguments_when_the_nodes_did_not_meet() -> None:
    outcome = LaunchOutcome(1, num_nodes=2, endpoint="10.0.0.5:29500", rdzv_timeout=30)
    outcome.agent_error = "node 0 did not answer within 30 s"
    options = NodeOptions("call notebook_launcher", "rdzv_conf's 'timeout'", "node_rank", "num_nodes and rdzv_id")
    assert launch_error(outcome, 900, options).headline == (
        "this node could not form one group with the other 1 node at 10.0.0.5:29500 (node 0 did not answer within "
        "30 s): call notebook_launcher on every node within 30 s (rdzv_conf's 'timeout'), each with its own "
        "node_rank and the same num_nodes and rdzv_id; nothing was trained."
    )


def interrupted(rank: int, *cell_lines: int, first_rank: int = 0, num_processes: int = 2) -> LaunchOutcome:
    """An interrupted outcome whose `rank` recorded a KeyboardInterrupt at these cell lines, outermost first."""
    frames = "".join(f"  Cell line {n}, in <module>\n    step()\n" for n in cell_lines)
    tb = f"Traceback (most recent call last):\n{frames}KeyboardInterrupt\n"
    outcome = LaunchOutcome(num_processes, first_rank, interrupted=True)
    outcome.started = tuple(range(first_rank, first_rank + num_processes))
    outcome.failures.append(RankFailure(rank, 1, "exception", "KeyboardInterrupt", tb, when=1.0))
    return outcome


def test_an_interrupt_names_the_cell_line_where_rank_0_was_in_one_line() -> None:
    err = launch_interrupted(interrupted(0, 4))
    assert isinstance(err, KeyboardInterrupt) and type(err).__name__ == "KeyboardInterrupt"
    assert str(err) == "the 2 ranks were stopped (rank 0 was at cell line 4)"
    assert err._render_traceback_() == [error_line("KeyboardInterrupt", str(err))]


def test_an_interrupt_inside_a_function_of_the_cell_names_the_innermost_cell_line() -> None:
    assert str(launch_interrupted(interrupted(0, 12, 3))) == "the 2 ranks were stopped (rank 0 was at cell line 3)"


def test_an_interrupt_names_only_the_ranks_that_reached_the_cell() -> None:
    assert str(launch_interrupted(interrupted(1, 4))) == "the 2 ranks were stopped (rank 1 was at cell line 4)"
    assert str(launch_interrupted(LaunchOutcome(3, interrupted=True, started=(0, 1, 2)))) == "the 3 ranks were stopped"
    assert str(launch_interrupted(interrupted(0, num_processes=1))) == "the rank was stopped"


def test_an_interrupt_names_this_nodes_first_rank_and_a_functions_file_instead_of_a_cell() -> None:
    outcome = interrupted(2, 7, first_rank=2)
    assert str(launch_interrupted(outcome)) == "the 2 ranks were stopped (rank 2 was at cell line 7)"
    named = launch_interrupted(interrupted(0, 9), "train.py")
    assert str(named) == "the 2 ranks were stopped (rank 0 was at line 9 of train.py)"
    in_cell = launch_interrupted(interrupted(0, 6), "forever's cell")
    assert str(in_cell) == "the 2 ranks were stopped (rank 0 was at line 6 of forever's cell)"
    assert named.outcome is not None and repr(named.outcome).startswith("<accel_train interrupted: 2 processes")


def test_an_interrupt_before_any_rank_started_or_after_every_rank_ended_says_so() -> None:
    before = LaunchOutcome(2, interrupted=True)
    assert str(launch_interrupted(before)) == "the launch was stopped before its ranks started"
    assert repr(before) == "<accel_train interrupted: 2 processes, wall time 0.00 s>"
    after = LaunchOutcome(2, interrupted=True, started=(0, 1), durations={0: 1.0, 1: 1.0})
    assert str(launch_interrupted(after)) == (
        "the 2 ranks had ended, but the interrupt came before anything came back from them: nothing in the notebook "
        "changed"
    )
    one_ended = LaunchOutcome(2, interrupted=True, started=(0, 1), durations={1: 1.0})
    assert str(launch_interrupted(one_ended)) == "the 2 ranks were stopped"


def test_collect_tells_which_ranks_started() -> None:
    outcome = LaunchOutcome(3, interrupted=True)
    collect(outcome, {0: RankRecords(started=True), 1: RankRecords(), 2: RankRecords(started=True, duration=0.5)})
    assert outcome.started == (0, 2)
