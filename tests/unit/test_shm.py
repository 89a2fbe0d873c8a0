"""launch.shm without a process group: how a bucket is cut in parts, when a waiting rank spins or hands its
averaging to a thread, and who is alive."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from accel_magic.launch import shm


def test_the_parts_of_a_large_bucket_cover_it_once_in_cache_lines() -> None:
    import torch

    for world in (2, 3, 4, 7):
        for numel in (shm.SPLIT // 4, shm.SPLIT // 4 + 1, shm.SPLIT // 4 + 15, shm.SPLIT // 4 * 3 + 5):
            fd = os.memfd_create("parts")
            try:
                size = shm.Region.size(world, numel * 4)
                os.ftruncate(fd, size)
                region = shm.Region(fd, 0, world, numel * 4, torch.float32)
            finally:
                os.close(fd)
            covered = torch.zeros(numel, dtype=torch.int32)
            for part in region.parts:
                covered[part] += 1
                assert part.start % 16 == 0  # 64 bytes: two ranks never write one cache line
            assert torch.equal(covered, torch.ones_like(covered)), (world, numel)


def test_a_waiting_rank_spins_long_only_when_every_rank_has_cpus_of_its_own() -> None:
    assert shm.spin(world=2, threads=1, cpus=2) == shm.SPIN_OWN_CPUS
    assert shm.spin(world=2, threads=2, cpus=8) == shm.SPIN_OWN_CPUS
    assert shm.spin(world=4, threads=1, cpus=2) == shm.SPIN < shm.SPIN_OWN_CPUS  # -n 4 on 2 cores: sleep soon
    assert shm.spin(world=2, threads=2, cpus=2) == shm.SPIN  # OMP_NUM_THREADS=2 of the user's


def test_a_zombie_is_not_alive_and_a_running_process_is() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while shm.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not shm.alive(pid)  # ended, not yet reaped
    finally:
        os.waitpid(pid, 0)
    assert shm.alive(os.getpid())
    assert not shm.alive(pid)  # reaped: gone


def test_the_runnable_threads_of_a_busy_process_are_counted_and_a_sleeping_ones_are_not() -> None:
    busy, asleep = os.fork(), 0
    if busy == 0:
        while True:
            pass
    try:
        asleep = os.fork()
        if asleep == 0:
            time.sleep(60)
            os._exit(0)
        time.sleep(0.2)
        assert max(shm.runnable_threads([busy]) for _ in range(50)) == 1
        assert max(shm.runnable_threads([asleep]) for _ in range(50)) == 0
        assert shm.runnable_threads([0]) == 0  # a rank that has not written its pid yet
    finally:
        for pid in (busy, asleep):
            if pid:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def test_a_rank_hands_its_averaging_off_while_another_program_is_busy_at_two_looks_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load = {"runnable": 0, "ours": 0}  # fake machine load: what /proc would say
    monkeypatch.setattr(shm, "runnable", lambda: load["runnable"])
    monkeypatch.setattr(shm, "runnable_threads", lambda pids: load["ours"])
    monkeypatch.setattr(shm, "LOOK_EVERY", 0.0)
    monkeypatch.setattr(shm, "BUSY_FOR", 0.2)
    segment = shm.Segment(str(tmp_path / "segment"), 0, 2, timeout=30, cpus=2)

    def looks(runnable: int, ours: int) -> bool:
        load.update(runnable=runnable, ours=ours)
        return segment.hand_off()

    assert not looks(2, 2)  # quiet: the two ranks
    assert not looks(3, 2)  # a passing thread: one look
    assert not looks(2, 2)
    assert not looks(4, 4) and not looks(4, 4)  # -n 4 on 2 CPUs: only the ranks' own threads
    assert not looks(3, 2) and looks(4, 2)  # another program, at two looks in a row
    assert looks(2, 2)  # and for BUSY_FOR seconds after
    time.sleep(0.25)
    assert not looks(2, 2)
    monkeypatch.setattr(shm, "HAND_OFF", "always")
    assert looks(2, 2)
    monkeypatch.setattr(shm, "HAND_OFF", "never")
    assert not looks(4, 2) and not looks(4, 2)
