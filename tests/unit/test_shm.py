"""launch.shm without a process group: how a bucket is cut in parts, when a waiting rank spins, and who is alive."""

from __future__ import annotations

import os
import time

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
