"""Decide how to train from a described runtime and a request: pure data in, data out."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile
from typing import Any

from .errors import PlanError
from .runtime import Runtime

__all__ = [
    "Request",
    "Plan",
    "Fallback",
    "PlanError",
    "make_plan",
    "parse_endpoint",
    "MIXED_PRECISION",
    "STRATEGIES",
    "ALLREDUCE",
]

MIXED_PRECISION = ("no", "fp16", "bf16", "fp8")
# Long enough for rank 0 to evaluate or save while the others wait at a barrier; short enough that a rank which
# skipped a collective does not hang the notebook for torch's 30 minutes.
DEFAULT_TIMEOUT = 900.0
STRATEGIES = ("ddp", "fsdp", "deepspeed")
# How DDP averages gradients across CPU ranks: in shared memory (all ranks on this machine), or by gloo.
ALLREDUCE = ("shm", "gloo")


@dataclass(frozen=True)
class Request:
    """What the user asked for; None means "decide for me"."""

    num_processes: int | None = None
    cpu: bool = False
    mixed_precision: str | None = None
    strategy: str = "ddp"
    strict: bool = False
    timeout: float | None = None
    num_nodes: int = 1  # machines whose ranks form one group; each runs num_processes ranks
    node_rank: int = 0  # this machine's place among them (node 0 hosts the rendezvous)
    rdzv_endpoint: str = ""  # HOST:PORT of node 0's rendezvous, for several nodes
    background: bool = False  # the cell returns once the ranks have started; they train while other cells run
    allreduce: str | None = None  # "shm" or "gloo": how CPU ranks average gradients
    max_restarts: int = 0  # times the ranks are started again after a failure, as torch elastic does


@dataclass(frozen=True)
class Fallback:
    """A decision that differs from what the request asked for (or, for the device, from what the runtime has)."""

    topic: str  # the decision, as accelerate spells it: "device", "mixed_precision" or "strategy"
    wanted: str  # what was asked for; for the device, what the runtime has ("Tesla T4", "TPU v5e-1")
    using: str  # what the plan uses instead
    note: str  # why, the sentence that is also in Plan.notes
    asked: bool = True  # False: nobody asked for `wanted`, the runtime has it (the device)


@dataclass(frozen=True)
class Plan:
    """Every decision, with a note for each one the user did not ask for."""

    device: str  # "cpu", "cuda", "xla" or "mps"
    backend: str | None  # process-group backend of launched ranks: "gloo", "nccl", "xla" or None
    cpu: bool  # accelerate's `cpu` flag
    num_processes: int
    mixed_precision: str
    strategy: str
    threads_per_process: int
    launch: str  # "kernel": the cell runs in the kernel; "fork": forked ranks
    accelerator: str  # "eager": built now; "lazy": built on first use (keeps the kernel CUDA-free)
    timeout: float = 900.0  # seconds a collective may wait for the other ranks (and the nodes for each other)
    num_nodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""  # HOST:PORT of node 0's rendezvous when num_nodes > 1
    background: bool = False  # forked ranks train while the notebook runs other cells
    notes: tuple[str, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()  # each fallback's note is also in `notes`
    runtime: Runtime = field(default_factory=Runtime, compare=False)
    request: Request = field(default_factory=Request, compare=False)
    # What averages DDP's gradients across the ranks: "shm" (shared memory; gloo for every other collective) or
    # the backend's own all-reduce.
    allreduce: str | None = None
    max_restarts: int = 0  # times every rank is started again after a rank failed

    def __repr__(self) -> str:
        from .panel import plan_text

        return plan_text(self)

    def _repr_html_(self) -> str:
        from .panel import plan_html

        return plan_html(self)

    def _ipython_display_(self) -> None:
        from .panel import show_plan

        show_plan(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "backend": self.backend,
            "cpu": self.cpu,
            "num_processes": self.num_processes,
            "mixed_precision": self.mixed_precision,
            "strategy": self.strategy,
            "threads_per_process": self.threads_per_process,
            "launch": self.launch,
            "accelerator": self.accelerator,
            "timeout": self.timeout,
            "num_nodes": self.num_nodes,
            "node_rank": self.node_rank,
            "rdzv_endpoint": self.rdzv_endpoint,
            "background": self.background,
            "allreduce": self.allreduce,
            "max_restarts": self.max_restarts,
            "notes": list(self.notes),
            "fallbacks": [
                {"topic": f.topic, "wanted": f.wanted, "using": f.using, "asked": f.asked} for f in self.fallbacks
            ],
        }


def _arch_runs(capability: tuple[int, int], archs: tuple[str, ...]) -> bool:
    """A cubin for sm_XY runs on sm_XZ with Z >= Y; PTX for compute_XY JIT-compiles on anything newer."""
    major, minor = capability
    for arch in archs:
        kind, _, num = arch.partition("_")
        digits = "".join(takewhile(str.isdigit, num))  # "sm_90a" -> "90"
        if len(digits) < 2:
            continue
        a_major, a_minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= capability:
            return True
    return False


def _validate(request: Request) -> None:
    n = request.num_processes
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise PlanError(f"num_processes must be a whole number of at least 1, not {n!r}.")
    if request.mixed_precision is not None and request.mixed_precision not in MIXED_PRECISION:
        raise PlanError(
            f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, not {request.mixed_precision!r}."
        )
    if request.timeout is not None and not request.timeout > 0:
        raise PlanError(f"timeout must be a number of seconds above 0, not {request.timeout!r}.")
    if request.strategy not in STRATEGIES:
        raise PlanError(f"strategy must be one of {', '.join(STRATEGIES)}, not {request.strategy!r}.")
    _validate_nodes(request)
    if request.allreduce is not None and request.allreduce not in ALLREDUCE:
        raise PlanError(f"allreduce must be one of {', '.join(ALLREDUCE)}, not {request.allreduce!r}.")
    restarts = request.max_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise PlanError(f"max_restarts must be a whole number of at least 0, not {restarts!r}.")
    if restarts and request.num_nodes > 1:
        raise PlanError(
            "Restarts are for ranks on one machine: leave max_restarts at 0 across machines, or train on one."
        )


def parse_endpoint(text: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 address in brackets: [::1]:29500) as (host, port); PlanError when it is not one."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise PlanError(
            f"rdzv_endpoint must be HOST:PORT, the address of node 0 and a port every node can reach (for "
            f"example 10.0.0.5:29500), not {text!r}."
        )
    return host, int(port)


def _validate_nodes(request: Request) -> None:
    m, r = request.num_nodes, request.node_rank
    for name, value, least in (("num_nodes", m, 1), ("node_rank", r, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise PlanError(f"{name} must be a whole number of at least {least}, not {value!r}.")
    if r >= m:
        raise PlanError(f"node_rank must be below num_nodes ({m}): give each node a rank from 0 to {m - 1}.")
    if m > 1 and not request.rdzv_endpoint:
        raise PlanError(
            f"{m} nodes need a rendezvous endpoint: give every node the same --rdzv-endpoint HOST:PORT, the "
            "address of node 0 and a free port there."
        )
    if request.rdzv_endpoint:
        parse_endpoint(request.rdzv_endpoint)


class _Notes:
    """Collects notes; under --strict a fallback is a refusal instead."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.items: list[str] = []
        self.fallbacks: list[Fallback] = []

    def fallback(self, change: tuple[str, str, str], reason: str, outcome: str, fix: str, asked: bool = True) -> None:
        """Record "<reason>, so <outcome>." and the change (topic, wanted, using) it makes, or, under --strict,
        refuse with "<reason>: <fix> ..."."""
        if self.strict:
            raise PlanError(f"{reason}: {fix}, or drop --strict to accept that {outcome}.")
        note = f"{reason}, so {outcome}."
        self.items.append(note)
        self.fallbacks.append(Fallback(*change, note=note, asked=asked))

    def add(self, sentence: str) -> None:
        self.items.append(sentence)


def _choose_device(rt: Runtime, req: Request, notes: _Notes) -> str:
    if req.cpu:
        return "cpu"
    if rt.tpu:
        if rt.torch_xla:
            return "xla"
        notes.fallback(
            ("device", f"TPU {rt.tpu}", "cpu"),
            f"This is a TPU runtime ({rt.tpu}) but torch_xla is not installed",
            "training runs on the CPU",
            "install torch_xla",
            asked=False,
        )
        return "cpu"
    if rt.gpus:
        gpu = rt.gpus[0]
        if rt.torch_cuda_archs == ():
            notes.fallback(
                ("device", gpu.name, "cpu"),
                f"The installed torch is a CPU build and cannot use the GPU ({gpu.name})",
                "training runs on the CPU",
                "install a CUDA build of torch or add --cpu",
                asked=False,
            )
            return "cpu"
        if rt.torch_cuda_archs and gpu.capability and not _arch_runs(gpu.capability, rt.torch_cuda_archs):
            major, minor = gpu.capability
            notes.fallback(
                ("device", gpu.name, "cpu"),
                f"The installed torch cannot run the {gpu.name} (sm_{major}{minor}; it is built for "
                f"{' '.join(rt.torch_cuda_archs)})",
                "training runs on the CPU",
                "install a torch build that supports this GPU or add --cpu",
                asked=False,
            )
            return "cpu"
        return "cuda"
    if rt.mps:
        return "mps"
    return "cpu"


def _num_processes(rt: Runtime, req: Request, device: str, notes: _Notes) -> int:
    n = req.num_processes
    if device == "cuda":
        if n is None:
            return rt.gpu_count
        if n > rt.gpu_count:
            raise PlanError(
                f"{n} processes need {n} GPUs but this runtime has {rt.gpu_count} (NCCL ranks cannot share a GPU): "
                f"use -n {rt.gpu_count}, or add --cpu to run {n} processes on the CPU."
            )
        return n
    if device == "mps" and n is not None and n > 1:
        raise PlanError("MPS runs a single process: use -n 1, or add --cpu to run several processes on the CPU.")
    n = n or 1
    if device == "cpu" and n > rt.cpu_budget:
        cpus = f"{rt.cpu_budget} CPU" + ("s" if rt.cpu_budget != 1 else "")
        notes.add(f"{n} processes share a budget of {cpus}: this is for learning distributed training, not for speed.")
    return n


def _mixed_precision(rt: Runtime, req: Request, device: str, notes: _Notes) -> str:
    mp = req.mixed_precision or "no"
    if device == "cpu" and mp in ("fp16", "fp8"):
        notes.fallback(
            ("mixed_precision", mp, "no"),
            f"{mp} has no effect on the CPU (accelerate would silently ignore it)",
            "training runs in full precision (--mixed-precision bf16 gives bf16 autocast on the CPU)",
            "use --mixed-precision bf16 or no",
        )
        return "no"
    if device == "xla" and mp == "fp16":
        notes.fallback(
            ("mixed_precision", mp, "bf16"),
            "TPUs compute in bf16, not fp16",
            "mixed precision is bf16",
            "use --mixed-precision bf16",
        )
        return "bf16"
    if device == "cuda" and mp in ("bf16", "fp8"):
        caps = [g.capability for g in rt.gpus if g.capability]
        lowest = min(caps) if caps else None
        if mp == "fp8" and lowest is not None and lowest < (8, 9):
            fallback = "bf16" if lowest >= (8, 0) else "fp16"
            notes.fallback(
                ("mixed_precision", mp, fallback),
                f"fp8 needs a GPU of compute capability 8.9 or newer (this one is {lowest[0]}.{lowest[1]})",
                f"mixed precision is {fallback}",
                f"use --mixed-precision {fallback}",
            )
            return fallback
        if mp == "bf16" and lowest is not None and lowest < (8, 0):
            notes.fallback(
                ("mixed_precision", mp, "fp16"),
                f"bf16 needs a GPU of compute capability 8.0 or newer (this one is {lowest[0]}.{lowest[1]})",
                "mixed precision is fp16",
                "use --mixed-precision fp16",
            )
            return "fp16"
    if device == "mps" and mp == "fp8":
        notes.fallback(
            ("mixed_precision", mp, "no"),
            "fp8 does not run on MPS",
            "training runs in full precision",
            "use --mixed-precision no",
        )
        return "no"
    return mp


def _strategy(rt: Runtime, req: Request, device: str, notes: _Notes) -> str:
    wanted = req.strategy
    if wanted == "ddp":
        return wanted
    name = {"fsdp": "FSDP", "deepspeed": "DeepSpeed"}[wanted]
    if device != "cuda":
        where = "the CPU" if device == "cpu" else device.upper()
        notes.fallback(
            ("strategy", wanted, "ddp"),
            f"{name} needs CUDA GPUs and this plan runs on {where} (accelerate would silently build a plain setup)",
            "the ranks use DDP",
            "use --strategy ddp",
        )
        return "ddp"
    if wanted == "deepspeed" and not rt.deepspeed:
        notes.fallback(
            ("strategy", wanted, "ddp"), "DeepSpeed is not installed", "the ranks use DDP", "pip install deepspeed"
        )
        return "ddp"
    return wanted


def _allreduce(rt: Runtime, req: Request, device: str, backend: str | None, n: int, notes: _Notes) -> str | None:
    """Shared memory when every CPU rank runs on this machine and it has some, unless gloo was asked for; the
    backend's own all-reduce everywhere else."""
    wanted = req.allreduce
    if device != "cpu":
        if wanted and n * req.num_nodes > 1:
            notes.fallback(
                ("allreduce", wanted, str(backend)),
                f"--allreduce chooses how CPU ranks average gradients, and these ranks run on {device.upper()}",
                f"the ranks average gradients through {backend}",
                "leave --allreduce out",
            )
        return backend
    if n * req.num_nodes == 1:  # one rank: nothing to average
        return backend
    if req.num_nodes > 1 or not rt.shared_memory:
        if wanted == "shm":
            notes.fallback(
                ("allreduce", "shm", "gloo"),
                "Ranks on several machines cannot share memory"
                if req.num_nodes > 1
                else "This machine has no shared memory for the ranks (that needs Linux on x86-64 and a writable "
                "/dev/shm)",
                "the ranks average gradients through gloo",
                "use --allreduce gloo",
            )
        return "gloo"
    return wanted or "shm"


def make_plan(runtime: Runtime, request: Request | None = None) -> Plan:
    """Decide device, backend, processes, precision, threads and launch mode.

    Raises PlanError (one sentence) when the request cannot work here, or when --strict
    forbids a fallback.
    """
    req = request or Request()
    _validate(req)
    notes = _Notes(req.strict)
    device = _choose_device(runtime, req, notes)
    n = _num_processes(runtime, req, device, notes)
    mp = _mixed_precision(runtime, req, device, notes)
    strategy = _strategy(runtime, req, device, notes)
    backend = {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}.get(device)
    if runtime.omp_num_threads:
        threads = runtime.omp_num_threads
    else:
        threads = max(1, runtime.cpu_budget // n)
    if req.num_nodes > 1 and device in ("xla", "mps"):
        raise PlanError(
            f"Training across machines runs on CPUs or CUDA GPUs, not on {device.upper()}: add --cpu, or train on "
            "one machine."
        )
    # A background cell always forks, even one process: the kernel must stay free for the notebook's other cells;
    # so does a launch that restarts: a failed rank starts again in a fresh process.
    alone = n == 1 and req.num_nodes == 1 and not req.background and not req.max_restarts
    launch = "kernel" if alone else "fork"
    allreduce = _allreduce(runtime, req, device, backend, n, notes)
    # Built on first use on CPU too: an Accelerator the notebook never used then leaves accelerate's shared state
    # empty, which accelerate's own notebook_launcher requires.
    accelerator = "lazy" if device == "cpu" or (device == "cuda" and runtime.gpu_count > 1) else "eager"
    if device == "cuda" and accelerator == "eager":
        notes.add(
            "The notebook's accelerator uses the GPU in the kernel: launches of CPU ranks still work, "
            "but a forked GPU launch will then need a kernel restart."
        )
    if accelerator == "lazy" and device == "cuda":
        notes.add(
            "The notebook's accelerator is built on first use, so the kernel stays CUDA-free and "
            "%%accel_train can fork GPU ranks."
        )
    return Plan(
        device=device,
        backend=backend,
        cpu=device == "cpu",
        num_processes=n,
        mixed_precision=mp,
        strategy=strategy,
        threads_per_process=threads,
        launch=launch,
        accelerator=accelerator,
        timeout=req.timeout or DEFAULT_TIMEOUT,
        num_nodes=req.num_nodes,
        node_rank=req.node_rank,
        rdzv_endpoint=req.rdzv_endpoint.strip() if req.num_nodes > 1 else "",
        background=req.background,
        notes=tuple(notes.items),
        fallbacks=tuple(notes.fallbacks),
        runtime=runtime,
        request=req,
        allreduce=allreduce,
        max_restarts=req.max_restarts,
    )
