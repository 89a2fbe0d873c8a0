"""Which arguments of a rank's own init_process_group agree with the launch's group."""

from __future__ import annotations

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
