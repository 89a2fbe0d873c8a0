"""display.py: what a launch prints into the cell."""

from __future__ import annotations

from accel_magic.display import write_rank_text

GLOO = "[Gloo] Rank {r} is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"


def test_gloos_connection_chatter_never_reaches_the_cell_and_the_users_lines_do(capsys) -> None:
    write_rank_text(0, "stdout", GLOO.format(r=0) + "epoch 1\r" + "loss 0.5\n")
    write_rank_text(1, "stdout", "[rank 1] " + GLOO.format(r=1))
    write_rank_text(1, "stderr", "[rank 1] [Gloo] is what my own message says\n")
    captured = capsys.readouterr()
    assert captured.out == "epoch 1\rloss 0.5\n"
    assert captured.err == "[rank 1] [Gloo] is what my own message says\n"


def test_the_banner_of_a_node_names_its_place_and_ranks_in_the_whole_group() -> None:
    from accel_magic.display import launch_banner
    from accel_magic.plan import Request, make_plan
    from accel_magic.runtime import Runtime

    cpu = Runtime(platform="jupyter", cpu_budget=2, cpu_count=2)
    plan = make_plan(cpu, Request(num_processes=2, num_nodes=3, node_rank=1, rdzv_endpoint="10.0.0.5:29500"))
    assert launch_banner(plan).startswith(
        "accel_train: node 1 of 3 (ranks 2-3 of 6, rendezvous at 10.0.0.5:29500): 2 processes on cpu (gloo), "
        "1 thread each"
    )
    one = make_plan(cpu, Request(num_processes=1, num_nodes=2, node_rank=1, rdzv_endpoint="h:1"))
    assert "node 1 of 2 (rank 1 of 2, rendezvous at h:1): 1 process on cpu" in launch_banner(one)


def test_the_banner_of_a_background_launch_says_so() -> None:
    from accel_magic.display import launch_banner
    from accel_magic.plan import Request, make_plan
    from accel_magic.runtime import Runtime

    cpu = Runtime(platform="jupyter", cpu_budget=2, cpu_count=2)
    plan = make_plan(cpu, Request(num_processes=1, background=True))
    assert launch_banner(plan).startswith("accel_train: 1 process on cpu (gloo), 2 threads each, in the background;")
    assert "background" not in launch_banner(make_plan(cpu, Request(num_processes=2)))
