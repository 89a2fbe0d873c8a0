"""launch.shm: gradient buckets averaged in a shared-memory segment by forked ranks of a real gloo group."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from accel_magic.launch import rank, shm


def ranks(n: int, folder: Path, body: Callable[[int, str], Any], timeout: float = 60.0) -> list[Any]:
    """Run body(rank, segment) in n forked ranks of one gloo group; each rank's return value, or the exception it
    raised."""
    segment, pids = str(folder / "segment"), []
    for r in range(n):
        pid = os.fork()
        if pid == 0:  # the rank: never back into pytest
            code = 0
            try:
                import torch
                import torch.distributed as dist

                torch.set_num_threads(1)
                dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=r, world_size=n)
                result: Any = body(r, segment)
            except BaseException as err:
                result = err
            try:
                (folder / f"result-{r}").write_bytes(pickle.dumps(result))
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                for p in pids:
                    os.kill(p, signal.SIGKILL)
                pytest.fail("the ranks did not end")
            time.sleep(0.01)
    files = [folder / f"result-{r}" for r in range(n)]
    return [pickle.loads(f.read_bytes()) if f.exists() else None for f in files]  # None: the rank was killed


def bucket(r: int, numel: int) -> Any:
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(r)) * 3.0 ** (r % 5 - 2)


SMALL, LARGE = 10_001, shm.SPLIT // 4 + 1_001  # float32 elements: a bucket summed whole, and one summed in parts


def average_both_ways(r: int, path: str, numel: int) -> tuple[Any, Any]:
    """Three steps through the segment (the same region reused), and gloo's average of the same buckets."""
    import torch
    import torch.distributed as dist

    segment = shm.Segment(path, r, dist.get_world_size(), timeout=30)
    region = segment.region(numel * 4, torch.float32)
    assert region is not None and region.split == (numel == LARGE)
    ours = []
    for step in range(3):
        mine = bucket(r + 10 * step, numel)
        segment.average(region, mine)
        ours.append(mine)
    theirs = []
    for step in range(3):
        mine = bucket(r + 10 * step, numel).div_(dist.get_world_size())  # what DDP does without a hook
        dist.all_reduce(mine)
        theirs.append(mine)
    return torch.stack(ours), torch.stack(theirs)


@pytest.mark.parametrize("numel", [SMALL, LARGE], ids=["whole", "in-parts"])
def test_two_ranks_average_to_the_very_bits_gloo_gives(tmp_path: Path, numel: int) -> None:
    import torch

    (ours0, gloo0), (ours1, gloo1) = ranks(2, tmp_path, lambda r, path: average_both_ways(r, path, numel))
    assert torch.equal(ours0, ours1) and torch.equal(ours0, gloo0) and torch.equal(gloo0, gloo1)
    expected = torch.stack([bucket(10 * s, numel) / 2 + bucket(1 + 10 * s, numel) / 2 for s in range(3)])
    assert torch.equal(ours0, expected)


@pytest.mark.parametrize("numel", [SMALL, LARGE], ids=["whole", "in-parts"])
def test_three_ranks_agree_bit_for_bit_and_with_gloo_up_to_the_order_of_the_sums(tmp_path: Path, numel: int) -> None:
    import torch

    results = ranks(3, tmp_path, lambda r, path: average_both_ways(r, path, numel))
    ours = [o for o, _ in results]
    assert all(torch.equal(ours[0], o) for o in ours[1:])
    torch.testing.assert_close(ours[0], results[0][1], rtol=1e-6, atol=1e-6)


def test_a_rank_waiting_for_a_peer_that_died_stops_within_a_second_as_collateral(tmp_path: Path) -> None:
    import torch

    def waits(r: int, path: str) -> Any:
        segment = shm.Segment(path, r, 2, timeout=60)
        region = segment.region(64, torch.float32)
        if r == 1:
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            segment.average(region, torch.ones(16))
        except RuntimeError as err:
            return err, time.monotonic() - started
        return None

    first = ranks(2, tmp_path, waits)[0]
    assert isinstance(first, tuple), first
    err, waited = first
    assert "rank 1 " + shm.PEER_ENDED in str(err)
    assert rank.classify(err) == "collateral"
    assert waited < 5  # far from the 60 s timeout: the peer was watched, not waited for


def test_a_rank_waiting_for_a_live_peer_that_never_comes_times_out_as_a_collective_does(tmp_path: Path) -> None:
    import torch

    def body(r: int, path: str) -> Any:
        segment = shm.Segment(path, r, 2, timeout=0.3)
        region = segment.region(64, torch.float32)
        if r == 1:
            time.sleep(3)
            return None
        try:
            segment.average(region, torch.ones(16))
        except RuntimeError as err:
            return err
        return None

    err = ranks(2, tmp_path, body)[0]
    assert isinstance(err, RuntimeError) and "rank 1's gradients" in str(err)
    assert rank.classify(err) == "timeout"


def test_a_region_one_rank_cannot_make_room_for_is_none_in_every_rank_and_rank_0_says_so(tmp_path: Path) -> None:
    def body(r: int, path: str) -> Any:
        import io
        import sys

        import torch

        sys.stderr = told = io.StringIO()
        segment = shm.Segment(path, r, 2, timeout=30)
        if r == 1:  # a /dev/shm too small for this rank

            def full(fd: int, offset: int, length: int) -> None:
                raise OSError(28, "No space left on device")

            shm.os.posix_fallocate = full  # type: ignore[attr-defined]
        first = segment.region(1024, torch.float32)
        second = segment.region(1024, torch.float32)
        return first is None, second is None, segment.end, told.getvalue()

    (none0, again0, end0, told0), (none1, again1, end1, told1) = ranks(2, tmp_path, body)
    assert none0 and none1 and again0 and again1 and end0 == end1
    assert (
        told0
        == "accel_magic: some gradients are averaged by gloo, not in shared memory: /dev/shm has no room for them.\n"
    )
    assert told1 == ""


def train(r: int, path: str, own_hook: str, cap: float = 25, width: int = 64, **ddp: Any) -> Any:
    """A few DDP steps with shm installed; own_hook: "", "before" or "after" the first forward; buckets of at most
    `cap` MB; `ddp`: more arguments of DistributedDataParallel."""
    import torch
    import torch.distributed as dist

    shm.install(path, timeout=30)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Linear(width, 3)), bucket_cap_mb=cap, **ddp
    )
    calls: list[int] = []

    def own(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations as types
        calls.append(bucket.index())
        return dist.all_reduce(bucket.buffer().div_(2), async_op=True).get_future().then(lambda f: f.value()[0])

    if own_hook == "before":
        model.register_comm_hook(None, own)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(r))
    for step in range(4):
        model(data[step]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if own_hook == "after" and step == 1:
            model.register_comm_hook(None, own)
    hook = model._get_ddp_logging_data().get("comm_hook")
    return [p.detach().clone() for p in model.parameters()], hook, len(calls)


@pytest.mark.parametrize("own_hook", ["", "before", "after"], ids=["none", "before", "after"])
def test_a_ddp_model_gets_the_hook_at_its_first_forward_unless_the_cell_registers_its_own(
    tmp_path: Path, own_hook: str
) -> None:
    import torch

    results = ranks(2, tmp_path, lambda r, path: train(r, path, own_hook))
    for result in results:
        assert not isinstance(result, BaseException), result
    (params0, hook0, calls0), (params1, _, calls1) = results
    assert all(torch.equal(a, b) for a, b in zip(params0, params1, strict=True))
    if own_hook == "":
        assert hook0 == "Averager.hook.<locals>.shared_memory_average" and calls0 == 0
    elif own_hook == "before":
        assert hook0 == "train.<locals>.own" and calls0 >= 4  # ours never registered
    else:
        assert hook0 == "Averager.hook.<locals>.shared_memory_average" and calls0 >= 2  # ours gave way to it
    assert os.path.getsize(tmp_path / "segment") > shm.PAGE or own_hook == "before"


@pytest.mark.parametrize(
    "shape",
    [
        {"cap": 0.0001},  # a bucket per parameter: posted one by one, averaged after the last
        {"width": 30_000},  # 1.4 MB in one bucket: summed in parts
        {"width": 30_000, "gradient_as_bucket_view": True},  # the gradients are views of DDP's bucket
    ],
    ids=["many-small-buckets", "one-bucket-in-parts", "gradients-as-bucket-views"],
)
@pytest.mark.parametrize("hand_off", ["never", "always"], ids=["training-thread", "averaging-thread"])
def test_a_model_trains_to_the_bits_of_gloos_average(tmp_path: Path, shape: dict[str, Any], hand_off: str) -> None:
    import torch

    def body(r: int, path: str) -> Any:
        shm.HAND_OFF = hand_off  # in the forked rank only
        ours = train(r, path, "", **shape)
        theirs = train(r, path, "before", **shape)  # the cell's own hook: gloo's all-reduce of buffer / 2
        return ours, theirs

    (ours0, theirs0), (ours1, _) = ranks(2, tmp_path, body)
    assert ours0[1] == "Averager.hook.<locals>.shared_memory_average"
    assert theirs0[2] > 4 or "cap" not in shape  # many small buckets: several a step
    assert all(torch.equal(a, b) for a, b in zip(ours0[0], ours1[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ours0[0], theirs0[0], strict=True))


def test_an_averaging_thread_that_meets_a_dead_peer_fails_the_backward_as_collateral_and_every_later_one(
    tmp_path: Path,
) -> None:
    def body(r: int, path: str) -> Any:
        import threading

        import torch

        shm.HAND_OFF = "always"
        shm.install(path, timeout=60)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 64))
        for _ in range(2):  # steps together: DDP rebuilds its buckets in the second, through gloo
            model(torch.randn(4, 8)).sum().backward()
        if r == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        errors, waited = [], []
        for _ in range(2):
            started = time.monotonic()
            try:
                model(torch.randn(4, 8)).sum().backward()
            except RuntimeError as err:
                errors.append(err)
            waited.append(time.monotonic() - started)
        return errors, waited, [t.name for t in threading.enumerate()]

    first = ranks(2, tmp_path, body)[0]
    assert isinstance(first, tuple), first
    errors, waited, threads = first
    assert "accel_magic-averaging" in threads
    assert len(errors) == 2
    for err in errors:
        assert rank.classify(err) == "collateral"
        assert rank.first_line(err).startswith("rank 1 " + shm.PEER_ENDED), rank.first_line(err)
    assert waited[0] < 5 and waited[1] < 1  # the peer was watched; the next step failed at once
