"""relay.RankLines: bytes from each rank's fds become whole, marked lines."""

from __future__ import annotations

import pytest

from accel_magic.launch.relay import RankLines


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


def test_a_line_split_across_many_feeds_comes_out_once_whole() -> None:
    lines = RankLines()
    assert [lines.feed(1, "stdout", chunk) for chunk in (b"hel", b"lo wo", b"rld\nsec", b"ond\n")] == [
        "",
        "",
        "[rank 1] hello world\n",
        "[rank 1] second\n",
    ]
    assert lines.feed(0, "stdout", b"hel") == ""
    assert lines.feed(0, "stdout", b"lo\nwor") == "hello\n"
    assert lines.feed(0, "stdout", b"ld\n") == "world\n"
    assert lines.flush() == []


def test_interleaved_ranks_never_mix_mid_line() -> None:
    lines = RankLines()
    out = [
        lines.feed(0, "stdout", b"rank zero starts "),
        lines.feed(1, "stdout", b"rank one starts "),
        lines.feed(1, "stdout", b"and ends\n"),
        lines.feed(0, "stdout", b"and ends\n"),
    ]
    assert out == ["", "", "[rank 1] rank one starts and ends\n", "rank zero starts and ends\n"]


def test_stdout_and_stderr_of_one_rank_never_mix_mid_line() -> None:
    lines = RankLines()
    out = [
        lines.feed(1, "stdout", b"loss="),
        lines.feed(1, "stderr", b"warning: "),
        lines.feed(1, "stderr", b"slow\n"),
        lines.feed(1, "stdout", b"0.5\n"),
    ]
    assert out == ["", "", "[rank 1] warning: slow\n", "[rank 1] loss=0.5\n"]


@pytest.mark.parametrize("rank", [0, 1])
def test_multibyte_characters_split_anywhere_across_two_feeds_decode_whole(rank: int) -> None:
    text = "é € 🙂 ok\n"
    data = text.encode()
    expected = text if rank == 0 else f"[rank {rank}] {text}"
    for cut in range(len(data) + 1):
        lines = RankLines()
        assert lines.feed(rank, "stdout", data[:cut]) + lines.feed(rank, "stdout", data[cut:]) == expected, cut
        assert lines.flush() == []


def test_crlf_line_ends_become_plain_newlines() -> None:
    lines = RankLines()
    assert lines.feed(0, "stdout", b"a\r\nb\r\n") == "a\nb\n"
    assert lines.feed(1, "stdout", b"c\r") == ""
    assert lines.feed(1, "stdout", b"\nd\r\n") == "[rank 1] c\n[rank 1] d\n"


def test_carriage_return_progress_on_rank_1_keeps_only_the_last_segment_across_feeds() -> None:
    lines = RankLines()
    assert lines.feed(1, "stderr", b"\r 10%|#   |") == ""
    assert lines.feed(1, "stderr", b"\r 50%|##  |") == ""
    assert lines.feed(1, "stderr", b"\r100%|####|\n") == "[rank 1] 100%|####|\n"


def test_flush_returns_what_is_left_without_a_line_end_marked_for_rank_1() -> None:
    lines = RankLines()
    assert lines.feed(0, "stdout", b"done\nrank zero tail") == "done\n"
    assert lines.feed(1, "stderr", b"\r 10%\r 20%") == ""
    assert lines.feed(1, "stdout", b"rank one tail") == ""
    assert sorted(lines.flush()) == [
        (0, "stdout", "rank zero tail\n"),
        (1, "stderr", "[rank 1]  20%\n"),
        (1, "stdout", "[rank 1] rank one tail\n"),
    ]
    assert lines.flush() == []
