"""Workdir: the launch's private folder, and the records the ranks write into it and the kernel reads back."""

from __future__ import annotations

import os
import pickle
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from accel_magic.launch.outcome import RankFailure, RankRecords
from accel_magic.launch.workdir import Workdir

FAILURE = RankFailure(1, 1, "exception", "ValueError: x", "Traceback ...\nValueError: x\n", 12.5, "python 3.12")


@pytest.fixture
def workdir() -> Iterator[Workdir]:
    made = Workdir()
    yield made
    made.remove()


def test_an_error_record_reads_back_equal_to_the_failure_written(workdir: Workdir) -> None:
    workdir.write("error", 1, FAILURE)
    assert workdir.read("error", 1) == FAILURE
    assert workdir.records(1) == RankRecords(started=False, duration=None, error=FAILURE)


def test_a_status_record_gives_the_ranks_duration_and_a_started_record_says_it_started(workdir: Workdir) -> None:
    workdir.write("started", 0, 4321)
    workdir.write("status", 0, {"duration": 2.5})
    assert workdir.read("started", 0) == 4321
    assert workdir.records(0) == RankRecords(started=True, duration=2.5, error=None)


def test_records_are_kept_apart_by_rank(workdir: Workdir) -> None:
    workdir.write("started", 0, 100)
    workdir.write("started", 1, 101)
    workdir.write("error", 1, FAILURE)
    assert workdir.read("started", 0) == 100 and workdir.read("started", 1) == 101
    assert workdir.records(0).error is None and workdir.records(1).error == FAILURE


def test_a_rank_that_wrote_nothing_has_empty_records(workdir: Workdir) -> None:
    records = workdir.records(3)
    assert records.started is False
    assert records.duration is None
    assert records.error is None
    assert records == RankRecords()
    assert workdir.read("error", 3) is None and workdir.read_bytes("results", 3) is None


def test_a_results_record_keeps_its_bytes_as_written(workdir: Workdir) -> None:
    payload = bytes(range(256)) * 3
    workdir.write_bytes("results", 0, payload)
    assert workdir.read_bytes("results", 0) == payload


WHOLE = pickle.dumps(FAILURE, protocol=pickle.HIGHEST_PROTOCOL)


def test_a_truncated_record_reads_as_none_wherever_it_was_cut(workdir: Workdir) -> None:
    misread = {}
    for cut in range(len(WHOLE)):
        workdir.write_bytes("error", 2, WHOLE[:cut])
        try:
            found = workdir.read("error", 2)
        except Exception as err:
            found = err
        if found is not None:
            misread[cut] = found
    assert misread == {}
    assert workdir.records(2).error is None


def test_a_record_appears_whole_or_not_at_all_and_leaves_no_temporary_file(
    workdir: Workdir, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen_before_rename = []
    real_replace = os.replace

    def watching_replace(src, dst, *args, **kwargs):
        # Just before the record takes its name, a reader finds none, and the data waits whole under another name.
        seen_before_rename.append((workdir.read("error", 1), Path(src).read_bytes(), Path(src).name))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", watching_replace)
    workdir.write("error", 1, FAILURE)
    monkeypatch.undo()
    assert seen_before_rename == [(None, WHOLE, "error-1.tmp")]
    assert workdir.read("error", 1) == FAILURE
    assert not [name for name in os.listdir(workdir.path) if name.endswith(".tmp")]


def test_the_folder_is_private_and_remove_deletes_it() -> None:
    made = Workdir()
    made.write("started", 0, 1)
    made.write_bytes("results", 0, b"x")
    Path(made.results, "weights.bin").write_bytes(b"w")
    assert stat.S_IMODE(os.stat(made.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(made.results).st_mode) & 0o077 == 0
    assert os.path.basename(made.path).startswith("accel_magic-")
    made.remove()
    assert not os.path.exists(made.path)
    made.remove()  # a second removal is harmless


def test_with_tmpdir_set_the_folder_is_made_under_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    # tempfile reads TMPDIR once per process and caches the answer: forget it, as a process started with this
    # TMPDIR would never have known another.
    monkeypatch.setattr(tempfile, "tempdir", None)
    made = Workdir(max_bytes=0)
    try:
        assert Path(made.path).parent == tmp_path
    finally:
        made.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_result_limit_larger_than_any_memory_folder_puts_the_folder_outside_dev_shm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TMPDIR", raising=False)
    made = Workdir(max_bytes=1 << 62)
    try:
        assert not made.path.startswith("/dev/shm/")
    finally:
        made.remove()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="this machine has no writable /dev/shm")
def test_without_tmpdir_a_small_result_limit_puts_the_folder_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TMPDIR", raising=False)
    made = Workdir(max_bytes=1)
    try:
        assert os.path.dirname(made.path) == "/dev/shm"
    finally:
        made.remove()


def test_the_shared_memory_segment_is_named_after_the_folder_and_goes_with_it() -> None:
    made = Workdir()
    assert os.path.basename(made.segment) == os.path.basename(made.path) + ".grads"
    assert os.path.dirname(made.segment) == ("/dev/shm" if os.access("/dev/shm", os.W_OK) else made.path)
    with open(made.segment, "wb") as f:  # as a rank makes it
        f.write(b"\0" * 4096)
    made.remove()
    assert not os.path.exists(made.segment) and not os.path.exists(made.path)
    made.remove()  # twice, or never made by any rank: nothing to do
