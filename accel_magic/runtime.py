"""Probe the runtime a notebook runs in, reading only: never initializes CUDA or poisons fork."""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import platform as _platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["GPU", "Runtime", "probe", "cpu_budget", "memory", "versions"]

VERSIONED = ("torch", "accelerate", "ipython", "ipykernel", "ipywidgets")


@dataclass(frozen=True)
class GPU:
    """One CUDA GPU as NVML or nvidia-smi describe it."""

    index: int
    name: str
    memory_mib: int | None = None
    capability: tuple[int, int] | None = None

    def describe(self) -> str:
        parts = [self.name]
        if self.memory_mib:
            parts.append(f"{self.memory_mib / 1024:.0f} GiB")
        if self.capability:
            parts.append(f"sm_{self.capability[0]}{self.capability[1]}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Runtime:
    """What `probe()` found. Every field is plain data, so plans can be made from described runtimes."""

    platform: str = "python"
    shell: str = "none"
    gpus: tuple[GPU, ...] = ()
    gpu_source: str = "none"  # "nvml", "nvidia-smi" or "none" (no GPU, or none could be seen)
    torch_cuda_archs: tuple[str, ...] | None = None  # None: not asked (no GPU) or unknown
    tpu: str | None = None
    torch_xla: bool = False
    mps: bool = False
    deepspeed: bool = False
    cpu_budget: int = 1
    cpu_count: int = 1
    ram_bytes: int | None = None  # the memory limit that applies to the kernel: its cgroup's, else the machine's
    ram_available: int | None = None  # what is free under that limit now
    ram_limit: str = "machine"  # where ram_bytes comes from: "cgroup v2", "cgroup v1" or "machine"
    cuda_initialized: bool = False
    omp_num_threads: int | None = None
    shared_memory: bool = False  # ranks can average gradients in /dev/shm: Linux, x86-64, /dev/shm writable
    versions: tuple[tuple[str, str | None], ...] = field(default_factory=tuple)

    @property
    def version(self) -> dict[str, str | None]:
        return dict(self.versions)

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


# --- platform -------------------------------------------------------------------------------


def shell_kind(shell: Any) -> str:
    """Name the IPython shell by its class path, never by importing google.colab."""
    if shell is None:
        return "none"
    names = [f"{c.__module__}.{c.__qualname__}" for c in type(shell).__mro__]
    if any(n.startswith("google.colab") for n in names):
        return "colab"
    for n in names:
        if n.endswith("ZMQInteractiveShell"):
            return "zmq"
        if n.endswith("TerminalInteractiveShell"):
            return "terminal"
    return "interactive"


def detect_platform(env: Mapping[str, str], shell: Any, user_ns: Mapping[str, Any] | None) -> str:
    """Kaggle first (its images carry Colab's variables and package), then Colab, Binder, VS Code."""
    kind = shell_kind(shell)
    if env.get("KAGGLE_KERNEL_RUN_TYPE") or env.get("KAGGLE_URL_BASE"):
        return "kaggle"
    if kind == "colab" or env.get("COLAB_RELEASE_TAG"):
        return "colab"
    if any(env.get(k) for k in ("BINDER_REQUEST", "BINDER_LAUNCH_HOST", "BINDER_REPO_URL")):
        return "binder"
    if (user_ns is not None and "__vsc_ipynb_file__" in user_ns) or env.get("VSCODE_PID"):
        if kind in ("zmq", "colab"):
            return "vscode"
    if kind == "zmq":
        return "jupyter"
    if kind in ("terminal", "interactive"):
        return "terminal"
    return "python"


# --- CPU and memory -------------------------------------------------------------------------


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_cpus(root: Path) -> float | None:
    v2 = _read(root / "sys/fs/cgroup/cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max":
            try:
                return int(quota) / int(period or 100000)
            except ValueError:
                return None
        return None
    for d in ("sys/fs/cgroup/cpu", "sys/fs/cgroup/cpu,cpuacct"):
        quota = _read(root / d / "cpu.cfs_quota_us")
        period = _read(root / d / "cpu.cfs_period_us")
        if quota and period:
            try:
                q, p = int(quota), int(period)
            except ValueError:
                return None
            return q / p if q > 0 and p > 0 else None
    return None


def cpu_budget(env: Mapping[str, str], root: Path, affinity: int) -> int:
    """The CPUs this process may use: min of affinity, cgroup quota and CPU_LIMIT, rounded down, >= 1."""
    limits: list[float] = [affinity]
    quota = _cgroup_cpus(root)
    if quota:
        limits.append(quota)
    try:
        if env.get("CPU_LIMIT"):
            limits.append(float(env["CPU_LIMIT"]))
    except ValueError:
        pass
    return max(1, math.floor(min(x for x in limits if x > 0)))


# Each cgroup version: where its tree is mounted, and its files of a cgroup's limit, usage, and statistics (whose
# inactive_file is page cache the cgroup can drop, counted in its usage but not taken).
CGROUP_MEMORY = {
    "cgroup v2": ("sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
    "cgroup v1": ("sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def _number(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text and text.isdigit() else None  # v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    """One number of a cgroup's memory.stat ("key value" lines); 0 where it is not there."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.isdigit():
            return int(value)
    return 0


def _own_cgroups(root: Path) -> dict[str, str]:
    """This process's cgroup in each version's tree (/proc/self/cgroup); the tree's root where that is unreadable."""
    text = _read(root / "proc/self/cgroup")
    if text is None:
        return dict.fromkeys(CGROUP_MEMORY, "/")
    own = {}
    for line in text.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            own["cgroup v2"] = path
        elif "memory" in controllers.split(","):
            own["cgroup v1"] = path
    return own


def memory(root: Path) -> tuple[int | None, int | None, str]:
    """The memory limit that applies to this process, what is available under it now, and where the limit comes
    from: the tightest of its cgroup's and every ancestor's (a limit a container's own namespace hides is the tree's
    root, where the walk ends) and the machine's MemTotal. Available: the smallest of each limit less what its
    cgroup uses (but for page cache it can drop) and the machine's MemAvailable."""
    meminfo = {}
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        number = value.split()[:1]
        if number and number[0].isdigit():
            meminfo[key] = int(number[0]) * 1024
    limit, available, source = meminfo.get("MemTotal"), meminfo.get("MemAvailable"), "machine"
    for version, path in _own_cgroups(root).items():
        mount, limit_file, usage_file, cache_key = CGROUP_MEMORY[version]
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):
            folder = root.joinpath(mount, *parts[:depth])
            cap = _number(folder / limit_file)
            if cap is None or cap >= 1 << 60:  # v1 writes "no limit" as a huge number
                continue
            if limit is None or cap < limit:
                limit, source = cap, version
            used = _number(folder / usage_file)
            if used is not None:
                free = max(cap - max(used - _stat(folder / "memory.stat", cache_key), 0), 0)
                available = free if available is None else min(available, free)
    if available is not None and limit is not None:
        available = min(available, limit)
    return limit, available, source


def shared_memory(root: Path) -> bool:
    """Whether CPU ranks can average gradients in shared memory: a writable /dev/shm, on x86-64 Linux, whose
    stores reach other cores in program order (the flags in the segment rely on it; ARM reorders them)."""
    shm = root / "dev/shm"
    x86 = _platform.machine().lower() in ("x86_64", "amd64")
    return sys.platform.startswith("linux") and x86 and shm.is_dir() and os.access(shm, os.W_OK)


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


# --- GPUs -----------------------------------------------------------------------------------


def _visible(gpus: list[GPU], env: Mapping[str, str]) -> tuple[GPU, ...]:
    """Apply CUDA_VISIBLE_DEVICES as CUDA would (indices; UUID forms leave NVML's list as it is)."""
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return tuple(gpus)
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if any(not p.lstrip("-").isdigit() for p in parts):
        return tuple(gpus)
    picked: list[GPU] = []
    for part in parts:
        idx = int(part)
        if not 0 <= idx < len(gpus):
            break  # CUDA stops at the first invalid entry
        picked.append(replace(gpus[idx], index=len(picked)))
    return tuple(picked)


def gpus_from_nvml() -> list[GPU] | None:
    """Describe GPUs through libnvidia-ml with ctypes; None when NVML is not there or fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        gpus = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
                return None
            name = ctypes.create_string_buffer(96)
            nvml.nvmlDeviceGetName(handle, name, 96)

            class Memory(ctypes.Structure):
                _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

            mem = Memory()
            mib = mem.total // 2**20 if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == 0 else None
            major, minor = ctypes.c_int(), ctypes.c_int()
            ok = nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0
            gpus.append(GPU(i, name.value.decode(errors="replace"), mib, (major.value, minor.value) if ok else None))
        return gpus
    finally:
        nvml.nvmlShutdown()


def gpus_from_nvidia_smi(timeout: float = 10.0) -> list[GPU] | None:
    """Describe GPUs through nvidia-smi (argument list, time limit); None when absent or failing."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    for fields in ("index,name,memory.total,compute_cap", "index,name,memory.total"):
        try:
            out = subprocess.run(
                [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode == 0:
            break
    else:
        return None
    gpus = []
    for line in out.stdout.strip().splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 2 or not cols[0].isdigit():
            continue
        mib = int(cols[2]) if len(cols) > 2 and cols[2].isdigit() else None
        cap = None
        if len(cols) > 3 and "." in cols[3]:
            major, _, minor = cols[3].partition(".")
            if major.isdigit() and minor.isdigit():
                cap = (int(major), int(minor))
        gpus.append(GPU(int(cols[0]), cols[1], mib, cap))
    return gpus


def torch_cuda_arch_list(timeout: float = 60.0) -> tuple[str, ...] | None:
    """Ask `torch.cuda.get_arch_list()` in a subprocess: asking it here would poison every later fork."""
    code = "import torch; print(' '.join(torch.cuda.get_arch_list()))"
    env = dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1")
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return tuple(out.stdout.split())


def _tpu(env: Mapping[str, str], root: Path) -> str | None:
    accel_type = env.get("TPU_ACCELERATOR_TYPE")
    if accel_type:
        return accel_type
    if env.get("COLAB_TPU_1VM") or env.get("TPU_NAME") or (root / "dev/accel0").exists():
        return "tpu"
    return None


# --- versions -------------------------------------------------------------------------------


def versions() -> tuple[tuple[str, str | None], ...]:
    found: list[tuple[str, str | None]] = [("python", _platform.python_version())]
    for dist in VERSIONED:
        try:
            found.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            found.append((dist, None))
    return tuple(found)


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def _omp(env: Mapping[str, str]) -> int | None:
    value = env.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def probe(
    shell: Any = None,
    *,
    env: Mapping[str, str] | None = None,
    user_ns: Mapping[str, Any] | None = None,
    root: Path | str = "/",
    affinity: int | None = None,
) -> Runtime:
    """Describe this runtime. Reads only: no CUDA call, no torch import, no google.colab import.

    ``env``, ``root`` (where /sys and /proc are read) and ``affinity`` exist so tests can
    describe other machines; by default they are this process's.
    """
    env = os.environ if env is None else env
    root = Path(root)
    if user_ns is None and shell is not None:
        user_ns = getattr(shell, "user_ns", None)
    listed, source = gpus_from_nvml(), "nvml"
    if listed is None:
        listed, source = gpus_from_nvidia_smi(), "nvidia-smi"
    if listed is None:
        listed, source = [], "none"
    found = _visible(listed, env)
    archs = torch_cuda_arch_list() if found else None
    aff = _affinity() if affinity is None else affinity
    ram, ram_available, ram_limit = memory(root)
    return Runtime(
        platform=detect_platform(env, shell, user_ns),
        shell=shell_kind(shell),
        gpus=found,
        gpu_source=source,
        torch_cuda_archs=archs,
        tpu=_tpu(env, root),
        torch_xla=importlib.util.find_spec("torch_xla") is not None,
        mps=sys.platform == "darwin" and _platform.machine() == "arm64",
        deepspeed=importlib.util.find_spec("deepspeed") is not None,
        cpu_budget=cpu_budget(env, root, aff),
        cpu_count=os.cpu_count() or aff,
        ram_bytes=ram,
        ram_available=ram_available,
        ram_limit=ram_limit,
        cuda_initialized=_cuda_initialized(),
        omp_num_threads=_omp(env),
        shared_memory=shared_memory(root),
        versions=versions(),
    )


def describe_gpus(gpus: Sequence[GPU]) -> str:
    if not gpus:
        return "none"
    names = [g.name for g in gpus]
    if len(set(names)) == 1:
        return f"{len(gpus)} x {gpus[0].describe()}"
    return "; ".join(g.describe() for g in gpus)
