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
