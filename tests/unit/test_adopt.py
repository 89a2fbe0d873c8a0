"""Which arguments of a rank's own init_process_group agree with the launch's group; the groups a rank's
destroy_process_group ends stay referenced until the rank ends."""

from __future__ import annotations

import os

import pytest

from accel_magic.launch.adopt import disagreement

GROUP = "this launch's process group has 2 ranks on gloo and this process is rank 1"


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"backend": None, "world_size": -1, "rank": -1},
        {"backend": "gloo", "world_size": 2, "rank": 1, "init_method": "env://"},
        {"backend": "GLOO"},
        {"backend": "cpu:gloo,cuda:nccl"},
        {"init_method": "tcp://localhost:12355", "timeout": 30},
    ],
)
def test_arguments_that_agree_or_are_left_out_adopt_the_group(args) -> None:
    assert disagreement(args, "gloo", 2, 1) is None


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (
            {"backend": "nccl"},
            f"init_process_group(backend='nccl') does not match: {GROUP}; leave backend out or pass 'gloo'",
        ),
        ({"backend": "cuda:nccl"}, "init_process_group(backend='cuda:nccl') does not match"),
        (
            {"world_size": 4},
            f"init_process_group(world_size=4) does not match: {GROUP}; leave world_size out or pass 2",
        ),
        (
            {"rank": 0},
            f"init_process_group(rank=0) does not match: {GROUP}; leave rank out or pass int(os.environ['RANK'])",
        ),
    ],
)
def test_arguments_that_disagree_name_the_launchs_values(args, sentence) -> None:
    problem = disagreement(args, "gloo", 2, 1)
    assert problem is not None and problem.startswith(sentence)


def test_the_groups_a_rank_destroys_stay_referenced_until_it_ends() -> None:
    """In a forked process, as in a rank: a subgroup and the default group, each destroyed while a DDP model still
    holds it, are kept (so the model's reducer never frees one with the GIL held); torch's function is wrapped
    wherever it is bound, and a group made afterwards works."""
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            import torch
            import torch.distributed as dist
            from torch.distributed import distributed_c10d
            from torch.nn.parallel import DistributedDataParallel

            from accel_magic.launch import adopt

            original = distributed_c10d.destroy_process_group
            adopt.keep_destroyed_groups()
            wrapped = dist.destroy_process_group.__wrapped__ is original  # type: ignore[attr-defined]
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
            world, sub = dist.group.WORLD, dist.new_group([0])
            model = DistributedDataParallel(torch.nn.Linear(2, 2), process_group=sub)
            distributed_c10d.destroy_process_group(sub)
            dist.destroy_process_group()
            kept = adopt.KEPT == [sub, world] and not dist.is_initialized()
            del model
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
            dist.all_reduce(torch.ones(1))
            dist.destroy_process_group()
            code = 0 if wrapped and kept else 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
