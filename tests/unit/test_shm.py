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


def test_a_process_that_shares_its_cpu_with_a_busy_one_waits_for_it() -> None:
    def measured() -> float:
        """run_queue_wait's growth over 0.3 s of computing, in a process pinned to one CPU beside a busy one."""
        read, write = os.pipe()
        busy = os.fork()
        if busy == 0:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            while True:
                pass
        child = os.fork()
        if child == 0:
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            before, until = shm.run_queue_wait(), time.monotonic() + 0.3
            while time.monotonic() < until:
                pass
            os.write(write, repr(shm.run_queue_wait() - before).encode())
            os._exit(0)
        try:
            os.waitpid(child, 0)
            return float(os.read(read, 100))
        finally:
            os.kill(busy, signal.SIGKILL)
            os.waitpid(busy, 0)
            os.close(read)
            os.close(write)

    assert measured() > 0.05  # about half of 0.3 s, more on a busier machine


def test_a_rank_hands_its_averaging_off_while_another_program_is_busy_at_two_looks_in_a_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waited = [0.0]  # fake: how long the training thread waited for a CPU, as /proc would say

    def looks(segment: shm.Segment, wait: float) -> bool:
        waited[0] += wait
        return segment.hand_off()

    monkeypatch.setattr(shm, "run_queue_wait", lambda: waited[0])
    monkeypatch.setattr(shm, "LOOK_EVERY", 0.0)
    monkeypatch.setattr(shm, "BUSY_FOR", 0.2)
    segment = shm.Segment(str(tmp_path / "segment"), 0, 2, timeout=30, cpus=2)
    assert not looks(segment, 0) and not looks(segment, 0)  # quiet
    assert not looks(segment, 1)  # a passing thread: one look
    assert not looks(segment, 0)
    assert not looks(segment, 1) and looks(segment, 1)  # another program, at two looks in a row
    assert looks(segment, 0)  # and for BUSY_FOR seconds after
    time.sleep(0.25)
    assert not looks(segment, 0)
    crowded = shm.Segment(str(tmp_path / "segment"), 0, 4, timeout=30, cpus=2)  # -n 4 on 2 CPUs: waits are ours
    assert not looks(crowded, 1) and not looks(crowded, 1)
    monkeypatch.setattr(shm, "HAND_OFF", "always")
    assert looks(segment, 0)
    monkeypatch.setattr(shm, "HAND_OFF", "never")
    assert not looks(segment, 1) and not looks(segment, 1)
