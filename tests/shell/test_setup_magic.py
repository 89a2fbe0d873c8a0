"""%load_ext / %accel_setup / %unload_ext in an InteractiveShell."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from IPython import get_ipython
from IPython.core.error import UsageError

import accel_magic


def test_load_ext_imports_nothing_heavy_and_sets_nvml_check() -> None:
    code = (
        "import os, sys\n"
        "os.environ.pop('PYTORCH_NVML_BASED_CUDA_CHECK', None)\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance()\n"
        "ip.run_line_magic('load_ext', 'accel_magic')\n"
        "print(sorted(m for m in ('torch', 'accelerate', 'ipywidgets') if m in sys.modules))\n"
        "print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))\n"
        "print('accel_setup' in ip.magics_manager.magics['line'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:3] == ["[]", "1", "True"]


def test_import_time_lists_no_heavy_module() -> None:
    err = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import accel_magic"], capture_output=True, text=True, check=True
    ).stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in err.splitlines() if "|" in line}
    assert "accel_magic" in imported
    assert not imported & {"torch", "accelerate", "ipywidgets"}


def test_user_setting_of_nvml_check_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    shell = get_ipython()
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    shell.run_line_magic("load_ext", "accel_magic")
    shell.run_line_magic("unload_ext", "accel_magic")
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


def test_setup_builds_cpu_accelerator_and_returns_plan(ip) -> None:
    ip.run_cell("plan = %accel_setup --quiet", store_history=False)
    plan, acc = ip.user_ns["plan"], ip.user_ns["accelerator"]
    assert (plan.device, plan.backend, plan.cpu) == ("cpu", "gloo", True)
    assert type(acc).__name__ == "LazyAccelerator" and not acc.built  # accelerate's state stays empty until used
    assert acc.device.type == "cpu" and acc.built and acc.distributed_type == "NO"
    assert os.environ["USE_TORCH_XLA"] == "0"


def test_setup_twice_with_other_options_resets_state_and_says_so(ip) -> None:
    ip.run_line_magic("accel_setup", "--quiet")
    unused = ip.run_line_magic("accel_setup", "--quiet --mixed-precision fp8")
    assert not any("state was reset" in n for n in unused.notes)  # an accelerator never used left no state
    assert ip.user_ns["accelerator"].device.type == "cpu"
    plan = ip.run_line_magic("accel_setup", "--quiet --mixed-precision bf16")
    assert ip.user_ns["accelerator"].mixed_precision == "bf16"
    assert any("state was reset" in n for n in plan.notes)


def test_stale_deepspeed_flag_is_removed(ip, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    plan = ip.run_line_magic("accel_setup", "--quiet")
    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ
    assert any("ACCELERATE_USE_DEEPSPEED" in n for n in plan.notes)
    assert ip.user_ns["accelerator"].device.type == "cpu"


def test_config_sets_defaults(ip) -> None:
    ip.run_line_magic("config", "AccelMagics.num_processes = 2")
    ip.run_line_magic("config", "AccelMagics.mixed_precision = 'bf16'")
    try:
        plan = ip.run_line_magic("accel_setup", "--quiet")
        assert (plan.num_processes, plan.mixed_precision, plan.launch) == (2, "bf16", "fork")
        assert ip.run_line_magic("accel_setup", "--quiet -n 1").num_processes == 1
    finally:
        ip.run_line_magic("config", "AccelMagics.num_processes = None")
        ip.run_line_magic("config", "AccelMagics.mixed_precision = None")


def test_every_trait_is_an_option_of_the_same_name_and_every_option_says_what_it_does() -> None:
    from accel_magic.magics import AccelMagics

    actions = [a for magic in (AccelMagics.accel_setup, AccelMagics.accel_train) for a in magic.parser._actions]
    options = {a.dest: a for a in actions}
    for name, trait in AccelMagics.class_traits(config=True).items():
        assert name in options, f"the trait {name} sets a default for no option"
        assert f"--{name.replace('_', '-')}" in options[name].option_strings, (name, options[name].option_strings)
        assert trait.help, f"%config AccelMagics shows no help for {name}"
    assert all(a.help for a in actions), [a.option_strings for a in actions if not a.help]
    shared = {a.dest: a.help for a in AccelMagics.accel_setup.parser._actions}
    for a in AccelMagics.accel_train.parser._actions:  # what both magics take means the same in both
        assert shared.get(a.dest, a.help) == a.help, a.dest


def test_name_and_force(ip) -> None:
    ip.user_ns["keep"] = [1, 2]
    with pytest.raises(UsageError, match="already holds a list"):
        ip.run_line_magic("accel_setup", "--quiet --name keep")
    assert ip.user_ns["keep"] == [1, 2]
    ip.run_line_magic("accel_setup", "--quiet --name keep --force")
    assert type(ip.user_ns["keep"]).__name__ == "LazyAccelerator"


def test_unload_removes_everything_and_reload_works(monkeypatch: pytest.MonkeyPatch) -> None:
    shell = get_ipython()
    monkeypatch.delenv(accel_magic.NVML_CHECK, raising=False)
    before_configurables = len(shell.configurables)
    shell.run_line_magic("load_ext", "accel_magic")
    assert shell.find_line_magic("accel_setup") is not None
    shell.run_line_magic("unload_ext", "accel_magic")
    assert shell.find_line_magic("accel_setup") is None
    assert "AccelMagics" not in shell.magics_manager.registry
    assert len(shell.configurables) == before_configurables
    assert accel_magic.NVML_CHECK not in os.environ
    shell.run_line_magic("load_ext", "accel_magic")
    shell.run_line_magic("reload_ext", "accel_magic")
    assert shell.find_line_magic("accel_setup") is not None
    assert len([c for c in shell.configurables if type(c).__name__ == "AccelMagics"]) == 1
    shell.run_line_magic("unload_ext", "accel_magic")


def test_the_kernels_state_is_one_session_that_unload_drops(ip) -> None:
    """What the extension keeps between cells (the setup plan launches follow, the panel shown, the hint's
    shell, the variables it set) is one object, gone after %unload_ext; a load after it starts afresh."""
    from accel_magic import session

    shell = ip
    plan = shell.run_line_magic("accel_setup", "--cpu --quiet")
    kept = session.current()
    assert kept.setup_plan.request == plan.request and kept.setup_plan.request.cpu and kept.panel_shown is not None
    shell.run_line_magic("unload_ext", "accel_magic")
    assert session._current is None
    shell.run_line_magic("load_ext", "accel_magic")
    assert session.current() is not kept and session.current().setup_plan is None


BAD = [
    ("unknown flag", "--bogus", "unrecognized arguments: --bogus"),
    ("zero processes", "-n 0", "at least 1"),
    ("negative processes", "-n -1", "at least 1"),
    ("processes not a number", "-n abc", "at least 1"),
    ("unknown mixed precision", "--mixed-precision fp17", "must be one of no, fp16, bf16, fp8"),
    ("FSDP on CPU under --strict", "--strategy fsdp --strict", "use --strategy ddp"),
    ("unknown strategy", "--strategy zero", "must be one of ddp, fsdp, deepspeed"),
    ("name not an identifier", "--name 1abc", "Python identifier"),
    ("name is a keyword", "--name class", "Python identifier"),
    ("name holds a user's list", "--name keep", "pass --force"),
]


@pytest.mark.parametrize(("line", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_sentence_and_loses_nothing(ip, line: str, says: str) -> None:
    ip.user_ns["keep"] = ["precious"]
    ip.user_ns["accelerator"] = sentinel = object.__new__(type("Accelerator", (), {"__module__": "accelerate.x"}))
    before = dict(ip.user_ns)
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("accel_setup", line)
    message = str(info.value)
    assert says in message
    assert "\n" not in message and message.endswith(".")
    assert ip.user_ns == before and ip.user_ns["accelerator"] is sentinel


def test_bad_input_shows_no_traceback(ip, capsys) -> None:
    result = ip.run_cell("%accel_setup -n abc", store_history=False)
    captured = capsys.readouterr()
    assert result.error_in_exec is not None
    assert "Traceback" not in captured.out + captured.err
    assert "UsageError: -n/--num-processes must be a whole number of at least 1, not 'abc'." in captured.err


def test_fake_gpu_kernel_that_touched_cuda_refuses_to_fork_gpu_ranks(ip, monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a fake 2xT4 runtime is probed, and the fork check is faked to report a poisoned kernel."""
    from accel_magic import magics
    from accel_magic.launch import forks as guard
    from accel_magic.runtime import GPU, Runtime

    fake_two_t4 = Runtime(
        platform="kaggle",
        gpus=(GPU(0, "Tesla T4", 15360, (7, 5)), GPU(1, "Tesla T4", 15360, (7, 5))),
        torch_cuda_archs=("sm_75",),
        cpu_budget=4,
    )
    monkeypatch.setattr(magics, "probe", lambda shell=None: fake_two_t4)
    monkeypatch.setattr(guard, "cuda_fork_blocker", lambda: "CUDA is already initialized in this kernel (fake)")
    ip.user_ns["keep"] = "mine"
    with pytest.raises(
        UsageError,
        match=r"CUDA is already initialized in this kernel \(fake\), so GPU ranks cannot be forked: restart the kernel",
    ):
        ip.run_cell_magic("accel_train", "-n 2", "keep = 'changed'")
    assert ip.user_ns["keep"] == "mine"
    with pytest.raises(UsageError, match="add --cpu"):
        ip.run_cell_magic("accel_train", "-n 3", "x = 1")


def test_train_in_a_shell_without_kernel_runs_ranks_and_brings_names_back(ip, capfd) -> None:
    ip.run_cell_magic(
        "accel_train", "-n 2", "value = accelerator.num_processes * 10\nprint('rank', accelerator.process_index)"
    )
    out = capfd.readouterr().out
    assert ip.user_ns["value"] == 20
    assert "rank 0" in out and "[rank 1] rank 1" in out
    ip.user_ns.pop("value")
    ip.user_ns.pop("accel_result", None)


def test_setup_displays_one_plain_panel_once_and_the_plan_shows_again_when_asked(ip, monkeypatch) -> None:
    """Text and HTML only: no widget view, which a reopened notebook could not show."""
    shown: list[dict] = []
    monkeypatch.setattr(ip.display_pub, "publish", lambda data, *args, **kwargs: shown.append(data))
    # As in a kernel: the terminal shell of IPython 7 prints values without asking _ipython_display_.
    monkeypatch.setattr(ip.display_formatter.ipython_display_formatter, "enabled", True)
    ip.run_cell("plan = %accel_setup -n 2", store_history=True)
    (bundle,) = shown
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"].startswith("accel_magic: CPU · gloo · 2 ranks × ")
    assert "<details" in bundle["text/html"] and "widget-view" not in bundle["text/html"]
    ip.run_cell("plan", store_history=True)  # the display hook shows the plan the magic returned, like any value
    assert len(shown) == 2 and shown[1] == bundle
    ip.run_cell("%accel_setup --quiet", store_history=True)
    assert len(shown) == 2


def test_python_m_accel_magic_prints_plan_as_text_and_json_without_secrets(monkeypatch) -> None:
    import json

    env = dict(os.environ, HF_TOKEN="hf_secret_value_123", WANDB_API_KEY="wandb_secret")
    text = subprocess.run(
        [sys.executable, "-m", "accel_magic"], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert "backend          gloo" in text
    raw = subprocess.run(
        [sys.executable, "-m", "accel_magic", "--json", "-n", "2"], capture_output=True, text=True, env=env, check=True
    ).stdout
    data = json.loads(raw)
    assert data["plan"]["backend"] == "gloo" and data["plan"]["num_processes"] == 2
    assert data["runtime"]["versions"]["torch"]
    assert "secret" not in text + raw


def test_python_m_accel_magic_in_a_memory_limited_cgroup_shows_its_limit_and_what_is_available() -> None:
    import json

    from cgroups import memory_cgroup

    with memory_cgroup(3 * 2**30) as cgroup:
        raw, text = [
            subprocess.run(
                [sys.executable, "-m", "accel_magic", *extra],
                capture_output=True,
                text=True,
                check=True,
                preexec_fn=cgroup.enter,
            ).stdout
            for extra in (["--json"], [])
        ]
    found = json.loads(raw)["runtime"]
    assert (found["ram_bytes"], found["ram_limit"]) == (3 * 2**30, cgroup.version), found
    assert 0 < found["ram_available"] < 3 * 2**30, found
    assert re.search(rf"memory +3\.0 GiB \({cgroup.version} limit\), [\d.]+ GiB available", text), text


def test_the_name_trait_set_after_loading_names_the_ranks_accelerator(ip) -> None:
    ip.run_line_magic("config", "AccelMagics.name = 'acc'")
    try:
        ip.run_cell_magic("accel_train", "-n 2", "world = acc.num_processes\nhas_default = 'accelerator' in dir()")
        assert ip.user_ns["world"] == 2 and ip.user_ns["has_default"] is False
        ip.run_line_magic("accel_setup", "--quiet --name acc2")  # an explicit --name wins over the trait
        ip.run_cell_magic("accel_train", "-n 2", "named = type(acc2).__name__")
        assert ip.user_ns["named"] == "Accelerator"
    finally:
        ip.run_line_magic("config", "AccelMagics.name = 'accelerator'")
        for name in ("world", "has_default", "named", "accel_result", "acc"):
            ip.user_ns.pop(name, None)


def test_the_launch_outcome_never_replaces_a_users_own_variable_without_a_word(ip) -> None:
    ip.user_ns["accel_result"] = "my own result"
    try:
        with pytest.raises(UsageError, match=r"^`accel_result` already holds a str: choose another name .* --result"):
            ip.run_cell_magic("accel_train", "-n 2", "ran = True")
        assert "ran" not in ip.user_ns and ip.user_ns["accel_result"] == "my own result"
        ip.run_cell_magic("accel_train", "-n 2 --result outcome", "ran = True")
        assert ip.user_ns["accel_result"] == "my own result" and ip.user_ns["outcome"].ok
        with pytest.raises(UsageError, match=r"--result must be a Python identifier"):
            ip.run_cell_magic("accel_train", "-n 2 --result 'not a name'", "ran = True")
    finally:
        for name in ("accel_result", "outcome", "ran"):
            ip.user_ns.pop(name, None)


def test_allreduce_is_an_option_of_both_magics_and_a_trait(ip, capsys) -> None:
    ip.run_line_magic("config", "AccelMagics")
    assert "AccelMagics.allreduce" in capsys.readouterr().out
    for magic in (ip.find_line_magic("accel_setup"), ip.find_cell_magic("accel_train")):
        assert "--allreduce" in magic.__doc__
    plan = ip.run_line_magic("accel_setup", "--quiet -n 2")
    assert plan.allreduce == ("shm" if plan.runtime.shared_memory else "gloo")
    assert ip.run_line_magic("accel_setup", "--quiet -n 2 --allreduce gloo").allreduce == "gloo"
    ip.run_line_magic("config", "AccelMagics.allreduce = 'gloo'")
    try:
        assert ip.run_line_magic("accel_setup", "--quiet -n 2").allreduce == "gloo"
    finally:
        ip.run_line_magic("config", "AccelMagics.allreduce = None")
    with pytest.raises(UsageError, match=r"^--allreduce must be one of shm, gloo, not 'nccl'\.$"):
        ip.run_line_magic("accel_setup", "--quiet --allreduce nccl")
