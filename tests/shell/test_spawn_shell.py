"""torch's spawn in IPython's own shell, where this machine lacks what a kernel may have (a GPU)."""

from __future__ import annotations

import pytest


def test_fake_gpu_kernel_that_touched_cuda_refuses_to_fork_spawns_processes(
    ip, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No GPU here: a fake 2xT4 runtime is probed, and the fork check is faked to report a poisoned kernel."""
    from accel_magic import launcher
    from accel_magic.errors import TrainError
    from accel_magic.launch import forks as guard
    from accel_magic.runtime import GPU, Runtime

    fake_two_t4 = Runtime(
        platform="kaggle",
        gpus=(GPU(0, "Tesla T4", 15360, (7, 5)), GPU(1, "Tesla T4", 15360, (7, 5))),
        torch_cuda_archs=("sm_75",),
        cpu_budget=4,
    )
    monkeypatch.setattr(launcher, "probe", lambda shell=None: fake_two_t4)
    monkeypatch.setattr(guard, "cuda_fork_blocker", lambda: "CUDA is already initialized in this kernel (fake)")
    result = ip.run_cell(
        "import torch.multiprocessing as mp\nran = []\ndef demo(i):\n    ran.append(i)\nmp.spawn(demo, nprocs=2)",
        store_history=False,
    )
    err = result.error_in_exec
    assert isinstance(err, TrainError), err
    assert str(err) == (
        "CUDA is already initialized in this kernel (fake), so the processes of spawn cannot be forked: restart the "
        "kernel and keep CUDA work inside the function."
    )
    assert ip.user_ns["ran"] == []
