"""make_plan as a decision table: one row per case, each id a sentence."""

from __future__ import annotations

import re
from dataclasses import FrozenInstanceError

import pytest

from accel_magic.plan import PlanError, Request, make_plan
from accel_magic.runtime import GPU, Runtime

CPU2 = Runtime(platform="jupyter", cpu_budget=2, cpu_count=2)
CPU1 = Runtime(platform="binder", cpu_budget=1, cpu_count=64)
T4 = GPU(0, "Tesla T4", 15360, (7, 5))
A100 = GPU(0, "NVIDIA A100-SXM4-40GB", 40960, (8, 0))
P100 = GPU(0, "Tesla P100-PCIE-16GB", 16384, (6, 0))
CU128 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
CU124 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ONE_T4 = Runtime(platform="colab", gpus=(T4,), torch_cuda_archs=CU124, cpu_budget=2)
TWO_T4 = Runtime(
    platform="kaggle", gpus=(T4, GPU(1, T4.name, T4.memory_mib, T4.capability)), torch_cuda_archs=CU124, cpu_budget=4
)
A100_RT = Runtime(platform="jupyter", gpus=(A100,), torch_cuda_archs=CU128, cpu_budget=12)
P100_CU128 = Runtime(platform="kaggle", gpus=(P100,), torch_cuda_archs=CU128, cpu_budget=4)
GPU_CPU_TORCH = Runtime(platform="jupyter", gpus=(T4,), torch_cuda_archs=(), cpu_budget=4)
TPU_XLA = Runtime(platform="colab", tpu="v5e-1", torch_xla=True, cpu_budget=8)
TPU_NO_XLA = Runtime(platform="colab", tpu="v5e-1", torch_xla=False, cpu_budget=8)
MPS = Runtime(platform="jupyter", mps=True, cpu_budget=8)
CPU2_SHM = Runtime(platform="jupyter", cpu_budget=2, cpu_count=2, shared_memory=True)
TWO_T4_SHM = Runtime(
    platform="kaggle", gpus=TWO_T4.gpus, torch_cuda_archs=CU124, cpu_budget=4, cpu_count=4, shared_memory=True
)
ACROSS = dict(num_processes=2, num_nodes=2, node_rank=0, rdzv_endpoint="10.0.0.5:29500")

FALLBACK = re.compile(r", so (training|mixed precision|the ranks)")

# (id, runtime, request, expected fields, substring of a note or None)
ROWS = [
    ("no GPU gives gloo in CPU mode", CPU2, Request(), dict(device="cpu", backend="gloo", cpu=True), None),
    ("GPUs give nccl", TWO_T4, Request(), dict(device="cuda", backend="nccl", cpu=False, num_processes=2), None),
    (
        "CPU ranks on a machine with shared memory average gradients there",
        CPU2_SHM,
        Request(num_processes=2),
        dict(backend="gloo", allreduce="shm", launch="fork"),
        None,
    ),
    (
        "--allreduce gloo turns shared memory off",
        CPU2_SHM,
        Request(num_processes=2, allreduce="gloo"),
        dict(backend="gloo", allreduce="gloo"),
        None,
    ),
    (
        "CPU ranks without shared memory average through gloo",
        CPU2,
        Request(num_processes=2),
        dict(allreduce="gloo"),
        None,
    ),
    ("GPU ranks average through nccl", TWO_T4_SHM, Request(), dict(allreduce="nccl"), None),
    (
        "--cpu on GPUs averages in shared memory",
        TWO_T4_SHM,
        Request(cpu=True, num_processes=2),
        dict(device="cpu", allreduce="shm"),
        None,
    ),
    ("ranks across machines average through gloo", CPU2_SHM, Request(**ACROSS), dict(allreduce="gloo"), None),
    (
        "one rank has nothing to average",
        CPU2_SHM,
        Request(num_processes=1, background=True),
        dict(allreduce="gloo"),
        None,
    ),  # fmt: skip
    (
        "--cpu on a GPU machine gives gloo in CPU mode",
        TWO_T4,
        Request(cpu=True),
        dict(device="cpu", backend="gloo", cpu=True),
        None,
    ),
    (
        "one process runs in the kernel",
        CPU2,
        Request(),
        dict(num_processes=1, launch="kernel", threads_per_process=2),
        None,
    ),
    (
        "two CPU ranks split the CPU budget",
        CPU2,
        Request(num_processes=2),
        dict(launch="fork", threads_per_process=1),
        None,
    ),
    (
        "two ranks on a 1-CPU budget are allowed for learning",
        CPU1,
        Request(num_processes=2),
        dict(num_processes=2, threads_per_process=1),
        "for learning distributed training, not for speed",
    ),
    (
        "fp16 on CPU becomes full precision with a note",
        CPU2,
        Request(mixed_precision="fp16"),
        dict(mixed_precision="no"),
        "fp16 has no effect on the CPU",
    ),
    (
        "fp8 on CPU becomes full precision with a note",
        CPU2,
        Request(mixed_precision="fp8"),
        dict(mixed_precision="no"),
        "fp8 has no effect on the CPU",
    ),
    ("bf16 on CPU is kept", CPU2, Request(mixed_precision="bf16"), dict(mixed_precision="bf16"), None),
    (
        "FSDP without CUDA falls back to DDP",
        CPU2,
        Request(strategy="fsdp", num_processes=2),
        dict(strategy="ddp"),
        "FSDP needs CUDA GPUs",
    ),
    (
        "DeepSpeed without CUDA falls back to DDP",
        CPU2,
        Request(strategy="deepspeed"),
        dict(strategy="ddp"),
        "DeepSpeed needs CUDA GPUs",
    ),
    ("FSDP on GPUs is kept", TWO_T4, Request(strategy="fsdp"), dict(strategy="fsdp"), None),
    (
        "DeepSpeed on GPUs without the package falls back to DDP",
        TWO_T4,
        Request(strategy="deepspeed"),
        dict(strategy="ddp"),
        "DeepSpeed is not installed",
    ),
    ("TPU with torch_xla uses xla", TPU_XLA, Request(), dict(device="xla", backend="xla", cpu=False), None),
    (
        "TPU without torch_xla runs on CPU",
        TPU_NO_XLA,
        Request(),
        dict(device="cpu", backend="gloo"),
        "torch_xla is not installed",
    ),
    (
        "fp16 on TPU becomes bf16",
        TPU_XLA,
        Request(mixed_precision="fp16"),
        dict(mixed_precision="bf16"),
        "TPUs compute in bf16",
    ),
    (
        "P100 with a cu128 torch runs on CPU",
        P100_CU128,
        Request(),
        dict(device="cpu", backend="gloo", cpu=True),
        "cannot run the Tesla P100",
    ),
    ("a GPU with a CPU build of torch runs on CPU", GPU_CPU_TORCH, Request(), dict(device="cpu"), "CPU build"),
    (
        "one GPU builds the accelerator now and says fork launches need a restart",
        ONE_T4,
        Request(),
        dict(accelerator="eager", launch="kernel"),
        "kernel restart",
    ),
    (
        "several GPUs build the accelerator on first use",
        TWO_T4,
        Request(),
        dict(accelerator="lazy", launch="fork"),
        "built on first use",
    ),
    (
        "bf16 on a T4 becomes fp16",
        ONE_T4,
        Request(mixed_precision="bf16"),
        dict(mixed_precision="fp16"),
        "bf16 needs a GPU of compute capability 8.0",
    ),
    ("bf16 on an A100 is kept", A100_RT, Request(mixed_precision="bf16"), dict(mixed_precision="bf16"), None),
    (
        "fp8 on an A100 becomes bf16",
        A100_RT,
        Request(mixed_precision="fp8"),
        dict(mixed_precision="bf16"),
        "fp8 needs a GPU",
    ),
    ("MPS runs one process", MPS, Request(), dict(device="mps", backend=None, num_processes=1), None),
    (
        "OMP_NUM_THREADS set by the user wins",
        Runtime(cpu_budget=8, omp_num_threads=3),
        Request(num_processes=2),
        dict(threads_per_process=3),
        None,
    ),
]


@pytest.mark.parametrize(("runtime", "request_", "expected", "note"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_decision(runtime: Runtime, request_: Request, expected: dict, note: str | None) -> None:
    plan = make_plan(runtime, request_)
    assert {k: getattr(plan, k) for k in expected} == expected
    if note is None:
        assert not [n for n in plan.notes if FALLBACK.search(n)], plan.notes
    else:
        assert any(note in n for n in plan.notes), plan.notes


def test_requests_without_fallback_leave_no_notes() -> None:
    assert make_plan(CPU2, Request(num_processes=2, mixed_precision="bf16")).notes == ()


REFUSALS = [
    ("more processes than GPUs suggests --cpu", ONE_T4, Request(num_processes=2), "add --cpu"),
    ("FSDP on CPU under --strict", CPU2, Request(strategy="fsdp", strict=True), "use --strategy ddp"),
    ("fp16 on CPU under --strict", CPU2, Request(mixed_precision="fp16", strict=True), "use --mixed-precision bf16"),
    ("TPU without torch_xla under --strict", TPU_NO_XLA, Request(strict=True), "install torch_xla"),
    ("unsupported GPU under --strict", P100_CU128, Request(strict=True), "add --cpu"),
    ("several MPS processes", MPS, Request(num_processes=2), "add --cpu"),
    ("zero processes", CPU2, Request(num_processes=0), "at least 1"),
    ("unknown mixed precision", CPU2, Request(mixed_precision="fp17"), "must be one of"),
    ("unknown strategy", CPU2, Request(strategy="zero3"), "must be one of"),
    ("unknown allreduce", CPU2_SHM, Request(allreduce="nccl"), "must be one of shm, gloo"),
    (
        "shm without shared memory under --strict",
        CPU2,
        Request(num_processes=2, allreduce="shm", strict=True),
        "use --allreduce gloo",
    ),
]


@pytest.mark.parametrize(("runtime", "request_", "says"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusal_is_one_sentence_saying_what_to_do(runtime: Runtime, request_: Request, says: str) -> None:
    with pytest.raises(PlanError) as info:
        make_plan(runtime, request_)
    message = str(info.value)
    assert says in message
    assert "\n" not in message and message.endswith(".")


def test_plans_of_the_same_decisions_are_equal_yet_each_keeps_the_runtime_and_request_it_was_made_from() -> None:
    colab = Runtime(platform="colab", shell="colab", cpu_budget=2, cpu_count=8, ram_bytes=12 * 2**30)
    asked = Request(num_processes=1, mixed_precision="no")
    here, there = make_plan(CPU2), make_plan(colab, asked)
    # Equality (and the hash) is about the decisions only: the same plan, whichever runtime or request led to it.
    assert here == there and hash(here) == hash(there)
    assert len({here, there}) == 1
    # Yet each plan still carries its own runtime and request, which the panel and the next launch read.
    assert here.runtime is CPU2 and there.runtime is colab
    assert here.request == Request() and there.request is asked
    assert "Jupyter" in repr(here) and "Colab" not in repr(here)
    assert "Colab" in repr(there) and "12.0 GiB" in repr(there)
    # One decision apart is another plan.
    assert make_plan(CPU2, Request(num_processes=2)) != here
    assert make_plan(CPU2, Request(timeout=30)) != here


def test_a_plan_cannot_be_changed_in_place() -> None:
    plan = make_plan(CPU2)
    for name, value in [("num_processes", 4), ("device", "cuda"), ("runtime", CPU1), ("notes", ("x",))]:
        with pytest.raises(FrozenInstanceError):
            setattr(plan, name, value)
    assert (plan.num_processes, plan.device, plan.runtime, plan.notes) == (1, "cpu", CPU2, ())


def test_plan_text_names_every_decision() -> None:
    text = repr(make_plan(CPU1, Request(num_processes=2, mixed_precision="fp16")))
    for word in ("Binder", "gloo", "num_processes", "2, as forked ranks", "1 usable of 64", "asked fp16 → using no"):
        assert word in text
    assert "note: 2 processes share a budget of 1 CPU" in text


# (id, runtime, request, the fallbacks as (topic, wanted, using, asked))
FALLBACKS = [
    ("a plan as asked has none", CPU2, Request(num_processes=2, mixed_precision="bf16"), []),
    (
        "fp16 and FSDP on CPU are two",
        CPU2,
        Request(num_processes=2, mixed_precision="fp16", strategy="fsdp"),
        [("mixed_precision", "fp16", "no", True), ("strategy", "fsdp", "ddp", True)],
    ),
    ("fp16 on TPU", TPU_XLA, Request(mixed_precision="fp16"), [("mixed_precision", "fp16", "bf16", True)]),
    ("bf16 on a T4", ONE_T4, Request(mixed_precision="bf16"), [("mixed_precision", "bf16", "fp16", True)]),
    ("fp8 on an A100", A100_RT, Request(mixed_precision="fp8"), [("mixed_precision", "fp8", "bf16", True)]),
    ("fp8 on MPS", MPS, Request(mixed_precision="fp8"), [("mixed_precision", "fp8", "no", True)]),
    ("DeepSpeed not installed", TWO_T4, Request(strategy="deepspeed"), [("strategy", "deepspeed", "ddp", True)]),
    ("a TPU without torch_xla was found, not asked", TPU_NO_XLA, Request(), [("device", "TPU v5e-1", "cpu", False)]),
    ("a GPU torch cannot run", P100_CU128, Request(), [("device", "Tesla P100-PCIE-16GB", "cpu", False)]),
    ("a GPU with a CPU build of torch", GPU_CPU_TORCH, Request(), [("device", "Tesla T4", "cpu", False)]),
    ("--cpu on GPUs is what was asked", TWO_T4, Request(cpu=True), []),
    (
        "shm without shared memory",
        CPU2,
        Request(num_processes=2, allreduce="shm"),
        [("allreduce", "shm", "gloo", True)],
    ),
    ("shm across machines", CPU2_SHM, Request(**ACROSS, allreduce="shm"), [("allreduce", "shm", "gloo", True)]),
    ("gloo on GPUs", TWO_T4_SHM, Request(allreduce="gloo"), [("allreduce", "gloo", "nccl", True)]),
    ("shm asked and given", CPU2_SHM, Request(num_processes=2, allreduce="shm"), []),
]


@pytest.mark.parametrize(("runtime", "request_", "expected"), [r[1:] for r in FALLBACKS], ids=[r[0] for r in FALLBACKS])
def test_each_fallback_says_what_was_asked_what_is_used_and_why(
    runtime: Runtime, request_: Request, expected: list
) -> None:
    plan = make_plan(runtime, request_)
    assert [(f.topic, f.wanted, f.using, f.asked) for f in plan.fallbacks] == expected
    for fallback in plan.fallbacks:
        assert fallback.note in plan.notes and FALLBACK.search(fallback.note)
        assert getattr(plan, fallback.topic) == fallback.using
    assert plan.to_dict()["fallbacks"] == [dict(topic=t, wanted=w, using=u, asked=a) for t, w, u, a in expected]


def test_several_nodes_always_fork_even_one_rank_each_and_keep_their_place() -> None:
    plan = make_plan(CPU2, Request(num_processes=1, num_nodes=2, node_rank=1, rdzv_endpoint=" 10.0.0.5:29500 "))
    assert (plan.launch, plan.num_nodes, plan.node_rank, plan.rdzv_endpoint) == ("fork", 2, 1, "10.0.0.5:29500")
    assert plan.to_dict()["num_nodes"] == 2
    assert make_plan(CPU2, Request(num_processes=1)).launch == "kernel"


def test_a_background_launch_forks_even_one_rank_with_the_whole_budget() -> None:
    plan = make_plan(CPU2, Request(num_processes=1, background=True))
    assert (plan.launch, plan.background, plan.threads_per_process) == ("fork", True, 2)
    assert plan.to_dict()["background"] is True
    two = make_plan(CPU2, Request(num_processes=2, background=True))
    assert (two.launch, two.threads_per_process, two.backend) == ("fork", 1, "gloo")


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (Request(num_nodes=2), r"2 nodes need a rendezvous endpoint: give every node the same --rdzv-endpoint"),
        (Request(num_nodes=2, node_rank=2, rdzv_endpoint="h:1"), r"node_rank must be below num_nodes \(2\)"),
        (Request(num_nodes=0), r"num_nodes must be a whole number of at least 1, not 0\."),
        (Request(num_nodes=2, node_rank=-1, rdzv_endpoint="h:1"), r"node_rank must be a whole number of at least 0"),
        (Request(num_nodes=2, rdzv_endpoint="10.0.0.5"), r"rdzv_endpoint must be HOST:PORT"),
        (Request(num_nodes=2, rdzv_endpoint="10.0.0.5:0"), r"rdzv_endpoint must be HOST:PORT"),
    ],
)
def test_a_request_across_machines_that_cannot_work_is_one_sentence(request_: Request, says: str) -> None:
    with pytest.raises(PlanError, match=says) as info:
        make_plan(CPU2, request_)
    assert str(info.value).count(". ") == 0 and str(info.value).endswith(".")


def test_training_across_machines_on_a_tpu_or_mps_is_refused_with_what_to_do() -> None:
    for runtime in (TPU_XLA, MPS):
        with pytest.raises(PlanError, match=r"Training across machines runs on CPUs or CUDA GPUs.*add --cpu"):
            make_plan(runtime, Request(num_nodes=2, rdzv_endpoint="h:29500"))


def test_endpoints_parse_with_ipv6_brackets_and_host_names() -> None:
    from accel_magic.plan import parse_endpoint

    assert parse_endpoint("[::1]:29500") == ("::1", 29500)
    assert parse_endpoint("node-0.cluster:1234") == ("node-0.cluster", 1234)
    for bad in ("29500", "host:", "host:http", ":29500", "host:70000"):
        with pytest.raises(PlanError):
            parse_endpoint(bad)
