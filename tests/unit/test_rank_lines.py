"""display.RankLines: bytes from each rank's fds become whole, marked lines."""

from __future__ import annotations

from accel_magic.display import RankLines


def test_other_ranks_are_marked_and_held_until_the_line_ends() -> None:
    lines = RankLines()
    assert lines.feed(1, "stdout", b"hal") == ""
    assert lines.feed(1, "stdout", b"f\nnext") == "[rank 1] half\n"
    assert lines.flush() == [(1, "stdout", "[rank 1] next\n")]


def test_rank0_passes_carriage_returns_through() -> None:
    lines = RankLines()
    assert lines.feed(0, "stderr", b"\r 10%\r 20%") == "\r 10%\r"
    assert lines.feed(0, "stderr", b"\r100%\n") == " 20%\r100%\n"


def test_other_ranks_keep_the_last_carriage_return_segment_and_crlf_is_one_line_end() -> None:
    lines = RankLines()
    assert lines.feed(2, "stderr", b"\r 10%\r100%\r\nok\r\n") == "[rank 2] 100%\n[rank 2] ok\n"


def test_utf8_split_across_reads_is_kept_whole() -> None:
    lines = RankLines()
    data = "é\n".encode()
    assert lines.feed(1, "stdout", data[:1]) == ""
    assert lines.feed(1, "stdout", data[1:]) == "[rank 1] é\n"
