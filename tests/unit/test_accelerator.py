"""accelerator.py: the environment guards and the lazy accelerator, without a GPU."""

from __future__ import annotations

import sys
import types

import pytest

from accel_magic.accelerator import (
    SetupError,
    build_accelerator,
    prepare_environment,
    rank_environment,
)
from accel_magic.plan import Request, make_plan
from accel_magic.runtime import GPU, Runtime

CPU = Runtime(cpu_budget=4)
FAKE_TWO_A100 = Runtime(
    gpus=(GPU(0, "NVIDIA A100", 40960, (8, 0)), GPU(1, "NVIDIA A100", 40960, (8, 0))),
    torch_cuda_archs=("sm_80",),
    cpu_budget=8,
)


def test_stale_strategy_flags_are_removed_and_xla_is_kept_off() -> None:
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_FSDP": "true"}
    notes = prepare_environment(make_plan(CPU), env)
    assert env == {"USE_TORCH_XLA": "0"}
    assert notes == [
        "Removed ACCELERATE_USE_DEEPSPEED and ACCELERATE_USE_FSDP left in the environment by an earlier attempt."
    ]


def test_accelerate_imported_with_xla_on_a_tpu_runtime_asks_for_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake: accelerate's import-time flag says it found torch_xla (as on a Colab TPU runtime)."""
    fake_imports = types.SimpleNamespace(_torch_xla_available=True)
    monkeypatch.setitem(sys.modules, "accelerate.utils.imports", fake_imports)
    plan = make_plan(Runtime(tpu="v5e-1", torch_xla=True), Request(cpu=True))
    with pytest.raises(SetupError, match="restart the kernel and run %accel_setup before importing accelerate"):
        prepare_environment(plan, {})


def test_several_fake_gpus_give_a_lazy_accelerator_that_builds_nothing_yet() -> None:
    from accelerate.state import PartialState

    PartialState._reset_state()
    acc = build_accelerator(make_plan(FAKE_TWO_A100))
    assert type(acc).__name__ == "LazyAccelerator" and not acc.built
    assert repr(acc) == "<Accelerator on cuda, built on first use>"
    assert PartialState._shared_state == {}


def test_rank_environment_turns_on_cpu_mode_and_sets_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = rank_environment(make_plan(CPU, Request(num_processes=2, mixed_precision="bf16")))
    assert env["ACCELERATE_USE_CPU"] == "true" and env["OMP_NUM_THREADS"] == "2"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and env["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in rank_environment(make_plan(CPU, Request(num_processes=2)))


def test_rank_environment_tells_the_ranks_to_average_in_shared_memory_only_when_the_plan_does() -> None:
    from accel_magic.launch.shm import ENV

    shared = Runtime(cpu_budget=4, shared_memory=True)
    assert rank_environment(make_plan(shared, Request(num_processes=2)))[ENV] == "shm"
    assert ENV not in rank_environment(make_plan(shared, Request(num_processes=2, allreduce="gloo")))
    assert ENV not in rank_environment(make_plan(CPU, Request(num_processes=2)))


def test_the_lazy_accelerator_is_an_accelerator_to_isinstance_dir_and_help_and_none_of_them_builds_it() -> None:
    import pydoc

    from accelerate import Accelerator
    from accelerate.state import PartialState

    PartialState._reset_state()
    acc = build_accelerator(make_plan(CPU))
    assert isinstance(acc, Accelerator)
    assert {"prepare", "backward", "device", "num_processes"} <= set(dir(acc))
    assert Accelerator.__doc__.strip().splitlines()[0] in pydoc.render_doc(acc)
    assert not hasattr(acc, "_repr_html_") and not acc.built  # a front end's display probe builds nothing
    prepare = acc.prepare  # looked up, as completion does: still not built
    assert not acc.built and PartialState._shared_state == {}
    model = prepare(torch_linear())
    assert acc.built and acc.device.type == "cpu" and model in acc._models
    PartialState._reset_state()


def torch_linear():
    import torch

    return torch.nn.Linear(2, 1)
