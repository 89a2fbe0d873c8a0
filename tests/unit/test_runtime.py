"""probe() under fake environments. Each fake says so in its name: env dicts, a fake nvidia-smi on PATH,
a fake /sys and /proc tree, fake shell classes named as the real ones are, a fake torch_xla package."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import accel_magic
from accel_magic import runtime
from accel_magic.plan import Request, make_plan
from accel_magic.runtime import GPU, probe

REPO = Path(accel_magic.__file__).resolve().parents[1]
CU128_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
CU126_ARCHS = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")


# --- fake shells: classes named like the real ones, so detection by type string is exercised ---
class ZMQInteractiveShell:  # fake of ipykernel.zmqshell.ZMQInteractiveShell
    user_ns: dict = {}


FakeZMQShell = ZMQInteractiveShell
FakeColabShell = type("Shell", (ZMQInteractiveShell,), {"__module__": "google.colab._shell"})


class TerminalInteractiveShell:  # fake of IPython.terminal.interactiveshell.TerminalInteractiveShell
    user_ns: dict = {}


@pytest.fixture
def fake_sys_root(tmp_path: Path) -> Path:
    """A fake / with /proc/meminfo (16 GiB) and an empty cgroup v2 tree."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:       16777216 kB\nMemFree:        1 kB\n")
    (tmp_path / "sys/fs/cgroup").mkdir(parents=True)
    return tmp_path


@pytest.fixture
def no_gpu_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No NVML, and a PATH with only a folder the test may put a fake nvidia-smi into."""
    bin_dir = tmp_path / "fake_bin"
    bin_dir.mkdir()
    monkeypatch.setattr(runtime, "gpus_from_nvml", lambda: None)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def install_fake_nvidia_smi(bin_dir: Path, rows: list[str]) -> None:
    script = bin_dir / "nvidia-smi"
    lines = "".join(f"echo '{row}'\n" for row in rows)  # shell builtins only: PATH holds just this folder
    script.write_text(f"#!/bin/sh\n{lines}")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


def fake_arch_list(archs: tuple[str, ...]):
    return lambda timeout=60.0: archs


@pytest.fixture
def fake_torch_xla(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "fake_site" / "torch_xla"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('the probe must not import torch_xla')\n")
    monkeypatch.syspath_prepend(str(pkg.parent))


def test_fake_colab_cpu_runtime(fake_sys_root: Path, no_gpu_tools: Path) -> None:
    env = {"COLAB_GPU": "", "COLAB_TPU_1VM": "", "COLAB_RELEASE_TAG": "release-colab_20261101"}
    rt = probe(FakeColabShell(), env=env, root=fake_sys_root, affinity=2)
    assert (rt.platform, rt.shell, rt.gpus, rt.tpu, rt.cpu_budget) == ("colab", "colab", (), None, 2)
    assert rt.ram_bytes == 16 * 2**30
    plan = make_plan(rt, Request(num_processes=2))
    assert (plan.device, plan.backend, plan.launch) == ("cpu", "gloo", "fork")


def test_fake_colab_t4_runtime_via_fake_nvidia_smi(
    fake_sys_root: Path, no_gpu_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_nvidia_smi(no_gpu_tools, ["0, Tesla T4, 15360, 7.5"])
    monkeypatch.setattr(runtime, "torch_cuda_arch_list", fake_arch_list(CU126_ARCHS))
    rt = probe(FakeColabShell(), env={"COLAB_GPU": "1"}, root=fake_sys_root, affinity=2)
    assert rt.platform == "colab" and rt.gpu_source == "nvidia-smi"
    assert rt.gpus == (GPU(0, "Tesla T4", 15360, (7, 5)),)
    plan = make_plan(rt)
    assert (plan.device, plan.backend, plan.accelerator) == ("cuda", "nccl", "eager")


@pytest.mark.parametrize("with_xla", [True, False], ids=["with torch_xla", "without torch_xla"])
def test_fake_colab_tpu_v5e_runtime(
    fake_sys_root: Path, no_gpu_tools: Path, request: pytest.FixtureRequest, with_xla: bool
) -> None:
    if with_xla:
        request.getfixturevalue("fake_torch_xla")
    env = {"COLAB_GPU": "", "COLAB_TPU_1VM": "1", "TPU_ACCELERATOR_TYPE": "v5e-1"}
    rt = probe(FakeColabShell(), env=env, root=fake_sys_root, affinity=8)
    assert (rt.platform, rt.tpu, rt.torch_xla) == ("colab", "v5e-1", with_xla)
    assert "torch_xla" not in sys.modules or not with_xla
    assert make_plan(rt).device == ("xla" if with_xla else "cpu")


def test_fake_kaggle_two_t4_with_colab_variables(
    fake_sys_root: Path, no_gpu_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_nvidia_smi(no_gpu_tools, ["0, Tesla T4, 15360, 7.5", "1, Tesla T4, 15360, 7.5"])
    monkeypatch.setattr(runtime, "torch_cuda_arch_list", fake_arch_list(CU126_ARCHS))
    env = {"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "COLAB_GPU": "1", "COLAB_RELEASE_TAG": "x"}
    rt = probe(FakeColabShell(), env=env, root=fake_sys_root, affinity=4)
    assert rt.platform == "kaggle" and rt.gpu_count == 2
    plan = make_plan(rt)
    assert (plan.num_processes, plan.backend, plan.accelerator) == (2, "nccl", "lazy")


def test_fake_kaggle_p100_with_cu128_torch_plans_cpu(
    fake_sys_root: Path, no_gpu_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake_nvidia_smi(no_gpu_tools, ["0, Tesla P100-PCIE-16GB, 16384, 6.0"])
    monkeypatch.setattr(runtime, "torch_cuda_arch_list", fake_arch_list(CU128_ARCHS))
    rt = probe(FakeZMQShell(), env={"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, root=fake_sys_root, affinity=4)
    plan = make_plan(rt)
    assert plan.device == "cpu" and any("cannot run the Tesla P100" in n for n in plan.notes)


@pytest.mark.parametrize("cgroup", ["v2", "v1"])
def test_fake_binder_one_cpu_quota_on_many_core_node(fake_sys_root: Path, no_gpu_tools: Path, cgroup: str) -> None:
    cg = fake_sys_root / "sys/fs/cgroup"
    if cgroup == "v2":
        (cg / "cpu.max").write_text("100000 100000\n")
        (cg / "memory.max").write_text(str(2 * 2**30))
    else:
        (cg / "cpu,cpuacct").mkdir()
        (cg / "cpu,cpuacct/cpu.cfs_quota_us").write_text("150000\n")
        (cg / "cpu,cpuacct/cpu.cfs_period_us").write_text("100000\n")
        (cg / "memory").mkdir()
        (cg / "memory/memory.limit_in_bytes").write_text(str(2 * 2**30))
    env = {"BINDER_REQUEST": "v2/gh/org/repo/HEAD", "BINDER_REPO_URL": "https://github.com/org/repo"}
    rt = probe(FakeZMQShell(), env=env, root=fake_sys_root, affinity=64)
    assert (rt.platform, rt.cpu_budget, rt.ram_bytes) == ("binder", 1, 2 * 2**30)
    plan = make_plan(rt, Request(num_processes=2))
    assert plan.threads_per_process == 1 and any("not for speed" in n for n in plan.notes)


GiB = 2**30
MEMINFO = "MemTotal:       16777216 kB\nMemFree:        1 kB\nMemAvailable:   12582912 kB\n"  # 16 GiB, 12 free


def described(root: Path, files: dict[str, str]) -> Path:
    for rel, text in {"proc/meminfo": MEMINFO, **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_memory_under_cgroup_v2_is_the_tightest_limit_up_the_tree_less_what_it_uses_but_dropped_cache(
    fake_sys_root: Path,
) -> None:
    kernel = "sys/fs/cgroup/user.slice/session/kernel"
    root = described(fake_sys_root, {
        "proc/self/cgroup": "0::/user.slice/session/kernel\n",
        f"{kernel}/memory.max": "max\n", f"{kernel}/memory.current": str(GiB),
        "sys/fs/cgroup/user.slice/session/memory.max": str(3 * GiB),
        "sys/fs/cgroup/user.slice/session/memory.current": str(GiB + GiB // 2),
        "sys/fs/cgroup/user.slice/session/memory.stat": f"anon {GiB}\ninactive_file {GiB // 2}\n",
        "sys/fs/cgroup/user.slice/memory.max": str(8 * GiB),
    })  # fmt: skip
    assert runtime.memory(root) == (3 * GiB, 2 * GiB, "cgroup v2")


@pytest.mark.parametrize("own", ["/process_api/90cd", "/docker/abc"], ids=["own path", "hidden by the namespace"])
def test_memory_under_cgroup_v1_is_the_cgroups_limit_less_what_it_uses_but_dropped_cache(
    fake_sys_root: Path, own: str
) -> None:
    at = "sys/fs/cgroup/memory" + ("/process_api/90cd" if own == "/process_api/90cd" else "")
    root = described(fake_sys_root, {
        "proc/self/cgroup": f"4:memory:{own}\n1:cpu:/\n0::/\n",
        f"{at}/memory.limit_in_bytes": str(3 * GiB), f"{at}/memory.usage_in_bytes": str(5 * GiB // 2),
        f"{at}/memory.stat": f"cache {GiB}\ninactive_file 1\ntotal_inactive_file {GiB}\n",
    })  # fmt: skip
    if own == "/process_api/90cd":
        (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit above
    assert runtime.memory(root) == (3 * GiB, 3 * GiB // 2, "cgroup v1")


def test_memory_without_a_limit_is_the_machines_and_unreadable_is_unknown(fake_sys_root: Path) -> None:
    root = described(fake_sys_root, {
        "proc/self/cgroup": "4:memory:/a\n0::/\n",
        "sys/fs/cgroup/memory/a/memory.limit_in_bytes": "9223372036854771712",
        "sys/fs/cgroup/memory/a/memory.usage_in_bytes": str(GiB),
        "sys/fs/cgroup/memory.max": "max",
    })  # fmt: skip
    assert runtime.memory(root) == (16 * GiB, 12 * GiB, "machine")
    (root / "proc/meminfo").unlink()
    (root / "proc/self/cgroup").unlink()
    assert runtime.memory(root) == (None, None, "machine")
    rt = probe(FakeZMQShell(), env={}, root=root, affinity=2)
    assert "memory           unknown" in repr(make_plan(rt))


def test_cpu_limit_variable_caps_the_budget(fake_sys_root: Path, no_gpu_tools: Path) -> None:
    rt = probe(None, env={"CPU_LIMIT": "3.5"}, root=fake_sys_root, affinity=16)
    assert rt.cpu_budget == 3 and rt.platform == "python"


def test_fake_vscode_kernel(fake_sys_root: Path, no_gpu_tools: Path) -> None:
    rt = probe(FakeZMQShell(), env={}, user_ns={"__vsc_ipynb_file__": "/x.ipynb"}, root=fake_sys_root, affinity=2)
    assert rt.platform == "vscode"


def test_fake_terminal_ipython(fake_sys_root: Path, no_gpu_tools: Path) -> None:
    rt = probe(TerminalInteractiveShell(), env={}, root=fake_sys_root, affinity=2)
    assert (rt.platform, rt.shell) == ("terminal", "terminal")


def test_plain_jupyter(fake_sys_root: Path, no_gpu_tools: Path) -> None:
    rt = probe(FakeZMQShell(), env={}, root=fake_sys_root, affinity=2)
    assert (rt.platform, rt.shell, rt.gpu_source) == ("jupyter", "zmq", "none")


def test_cuda_visible_devices_hides_gpus(fake_sys_root: Path, no_gpu_tools: Path, monkeypatch) -> None:
    install_fake_nvidia_smi(no_gpu_tools, ["0, Tesla T4, 15360, 7.5", "1, NVIDIA L4, 23034, 8.9"])
    monkeypatch.setattr(runtime, "torch_cuda_arch_list", fake_arch_list(CU126_ARCHS))
    rt = probe(None, env={"CUDA_VISIBLE_DEVICES": "1"}, root=fake_sys_root, affinity=2)
    assert rt.gpus == (GPU(0, "NVIDIA L4", 23034, (8, 9)),)
    assert probe(None, env={"CUDA_VISIBLE_DEVICES": ""}, root=fake_sys_root, affinity=2).gpus == ()


def test_failing_nvidia_smi_means_no_gpu(fake_sys_root: Path, no_gpu_tools: Path) -> None:
    script = no_gpu_tools / "nvidia-smi"
    script.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    script.chmod(0o755)
    rt = probe(None, env={}, root=fake_sys_root, affinity=2)
    assert (rt.gpus, rt.gpu_source) == ((), "none")


def test_probe_never_reaches_the_cuda_runtime(
    fake_sys_root: Path, no_gpu_tools: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every torch entry point that initializes CUDA or poisons fork raises; the probe still works."""
    import torch

    def poisoned(*args, **kwargs):
        raise AssertionError("the probe reached the CUDA runtime")

    for obj, name in [
        (torch.cuda, "is_available"),
        (torch.cuda, "device_count"),
        (torch.cuda, "get_arch_list"),
        (torch.cuda, "get_device_properties"),
        (torch.cuda, "get_device_name"),
        (torch.cuda, "get_device_capability"),
        (torch.cuda, "_lazy_init"),
        (torch.cuda, "init"),
        (torch._C, "_cuda_getDeviceCount"),
        (torch._C, "_cuda_init"),
    ]:
        if hasattr(obj, name):
            monkeypatch.setattr(obj, name, poisoned)
    install_fake_nvidia_smi(no_gpu_tools, ["0, Tesla T4, 15360, 7.5"])
    rt = probe(FakeColabShell(), env={"COLAB_GPU": "1"}, root=fake_sys_root, affinity=2)
    assert rt.gpu_count == 1 and rt.cuda_initialized is False
    # The architecture question went to a subprocess (this CPU build answers with no architectures).
    assert rt.torch_cuda_archs == ()


CHILD_PROBE = """
import os, sys
cpus = sys.argv[1]
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
from accel_magic.runtime import probe
print(probe(root=sys.argv[2]).cpu_budget)
"""


def allowed_cpus() -> list[int]:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("this platform cannot narrow a process's CPU affinity")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("this process may use only one CPU: a budget of 1 would not tell whether the probe counted")
    return cpus


def budget_in_child(cpus: list[int] | None, env: dict[str, str], root: Path | str = "/") -> int:
    """The cpu_budget that probe() finds in a fresh Python whose affinity is `cpus` (None: left alone)."""
    child_env = {k: v for k, v in os.environ.items() if k != "CPU_LIMIT"}
    child_env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU to describe: the probe asks no torch subprocess
    child_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", CHILD_PROBE, ",".join(map(str, cpus or [])), str(root)],
        cwd=REPO,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_real_probe_counts_the_cpus_this_process_may_use_when_its_affinity_is_one_cpu() -> None:
    first = allowed_cpus()[0]
    assert budget_in_child([first], {}) == 1


def test_real_probe_takes_cpu_limit_from_the_environment_with_affinity_left_alone() -> None:
    allowed_cpus()
    assert budget_in_child(None, {"CPU_LIMIT": "1"}) == 1


def test_real_probe_of_a_process_allowed_two_cpus_and_no_quota_counts_two(fake_sys_root: Path) -> None:
    two = allowed_cpus()[:2]
    assert budget_in_child(two, {}, root=fake_sys_root) == 2


def test_real_probe_reads_the_versions_of_this_environment() -> None:
    import torch

    rt = probe(env={"CUDA_VISIBLE_DEVICES": ""})
    assert rt.version["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert rt.version["torch"] and torch.__version__.startswith(rt.version["torch"])  # 2.11.0 of 2.11.0+cu130


def test_shared_memory_is_a_writable_dev_shm_on_x86_64_linux(tmp_path, monkeypatch) -> None:
    import platform

    from accel_magic.runtime import shared_memory

    assert not shared_memory(tmp_path)  # no /dev/shm there
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert shared_memory(tmp_path) == sys.platform.startswith("linux")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")  # ARM reorders stores: the flags would lie
    assert not shared_memory(tmp_path)
