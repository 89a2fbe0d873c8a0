"""%accel_export in an InteractiveShell: the last %%accel_train cell and the cells it uses, as a script that a
plain `python` runs to the notebook's own weights; refusals as one UsageError sentence."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.core.error import UsageError

SETUP = "import torch"
MODEL = (
    "torch.manual_seed(0)\nmodel = torch.nn.Linear(3, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)"  # momentum: the optimizer has a state
)
SHOW = "print(model)"
TRAIN = (
    "%%accel_train -n 1\n"
    "model, opt = accelerator.prepare(model, opt)\n"
    "for step in range(3):\n"
    "    loss = model(torch.ones(4, 3)).pow(2).sum()\n"
    "    accelerator.backward(loss)\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n"
)
# accel_magic is not installed where the script runs: the script must not need it.
WITHOUT_ACCEL_MAGIC = (
    "import runpy, sys\nsys.modules['accel_magic'] = None\nsys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


# A later training cell that goes on from the first one's model, optimizer and `steps`.
TRAIN_MORE = (
    "%%accel_train -n 1\n"
    "model, opt = accelerator.prepare(model, opt)\n"
    "for step in range(steps):\n"
    "    loss = (model(torch.ones(4, 3)) - 1).pow(2).sum()\n"
    "    accelerator.backward(loss)\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n"
)


def run(shell, source: str) -> None:
    result = shell.run_cell(source, store_history=True)
    if result.error_in_exec is not None:
        raise result.error_in_exec
    if result.error_before_exec is not None:
        raise result.error_before_exec


def run_script(folder: Path, output: str) -> subprocess.CompletedProcess[str]:
    """`python train.py --output-dir OUTPUT` in `folder`, one process, where accel_magic cannot be imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_ACCEL_MAGIC, str(folder / "train.py"), "--output-dir", output],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def same_state(saved, notebook) -> bool:
    """Equal state dicts: tensors equal element by element, the rest (lr, momentum, step counts) equal."""
    import torch

    if isinstance(saved, torch.Tensor):
        return isinstance(notebook, torch.Tensor) and torch.equal(saved, notebook)
    if isinstance(saved, dict):
        return (
            isinstance(notebook, dict)
            and saved.keys() == notebook.keys()
            and all(same_state(saved[k], notebook[k]) for k in saved)
        )
    if isinstance(saved, (list, tuple)):
        return (
            isinstance(notebook, (list, tuple))
            and len(saved) == len(notebook)
            and all(same_state(a, b) for a, b in zip(saved, notebook, strict=True))
        )
    return saved == notebook


def usage_error(shell, line: str) -> str:
    with pytest.raises(UsageError) as err:
        shell.run_line_magic("accel_export", line)
    message = str(err.value)
    assert message and "\n" not in message and message.endswith("."), message
    return message


def test_export_writes_a_script_that_python_runs_to_the_notebooks_weights(ip, tmp_path: Path, capsys) -> None:
    for source in (SETUP, MODEL, SHOW, TRAIN):
        run(ip, source)
    first = ip.execution_count - 4
    before = {k: v for k, v in ip.user_ns.items() if not k.startswith("_")}
    capsys.readouterr()
    run(ip, f"%accel_export {tmp_path}/train.py")
    out = capsys.readouterr().out
    assert f"Wrote {tmp_path}/train.py and {tmp_path}/train.slurm from these cells:" in out
    assert f"  [{first}] defines torch (used by [{first + 1}], [{first + 3}])\n" in out
    assert f"[{first + 1}] defines model, opt (used by [{first + 3}])" in out
    assert f"[{first + 2}]" not in out  # the cell that only prints is left out
    assert f"[{first + 3}] the %%accel_train cell" in out
    assert f"accelerate launch --cpu --num_processes 1 {tmp_path}/train.py --output-dir accel_export_output" in out
    assert f"sbatch {tmp_path}/train.slurm" in out
    after = {k: v for k, v in ip.user_ns.items() if not k.startswith("_")}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)  # the notebook as it was

    done = run_script(tmp_path, "out")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote out/model.pt" in done.stdout and "wrote out/opt.pt" in done.stdout
    import torch

    saved = torch.load(tmp_path / "out" / "model.pt")
    notebook = ip.user_ns["model"].state_dict()
    assert saved.keys() == notebook.keys() and all(torch.equal(saved[k], notebook[k]) for k in saved)
    saved_opt = torch.load(tmp_path / "out" / "opt.pt")
    assert len(saved_opt["state"]) == 2 and saved_opt["param_groups"][0]["momentum"] == 0.9  # weight and bias
    assert same_state(saved_opt, ip.user_ns["opt"].state_dict())  # momentum buffers after the same 3 steps


def test_a_script_with_an_earlier_training_cell_runs_to_the_notebooks_weights(ip, tmp_path: Path, capsys) -> None:
    first_training = TRAIN.replace("for step in range(3):", "steps = 2\nfor step in range(3):")
    for source in (SETUP, MODEL, first_training, SHOW, TRAIN_MORE):
        run(ip, source)
    first = ip.execution_count - 5
    capsys.readouterr()
    run(ip, f"%accel_export {tmp_path}/train.py")
    out = capsys.readouterr().out
    assert f"  [{first + 2}] an earlier %%accel_train cell; defines model, opt, steps (used by [{first + 4}])" in out
    assert f"  [{first + 4}] the %%accel_train cell" in out

    done = run_script(tmp_path, "out")
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    saved = torch.load(tmp_path / "out" / "model.pt")
    notebook = ip.user_ns["model"].state_dict()
    assert saved.keys() == notebook.keys() and all(torch.equal(saved[k], notebook[k]) for k in saved)
    assert same_state(torch.load(tmp_path / "out" / "opt.pt"), ip.user_ns["opt"].state_dict())


def test_the_port_and_the_plans_mixed_precision_reach_the_files(ip, tmp_path: Path) -> None:
    run(ip, "%%accel_train -n 1 --mixed-precision bf16\nx = 1")
    ip.run_line_magic("accel_export", f"{tmp_path}/job.py --port 29611")
    assert '--rdzv-endpoint "$head_node:29611"' in (tmp_path / "job.slurm").read_text()
    assert 'mixed_precision="bf16"' in (tmp_path / "job.py").read_text()


def test_ipythons_own_magic_translations_are_used(ip, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCEL_EXPORT_CHECK", "0")  # so that what %env sets below is undone after the test
    # IPython 7.34 on Python 3.12 and later leaves `x = !cmd` untransformed (a syntax error in the cell itself).
    assign = "getoutput" in ip.transform_cell("files = !echo a")
    captured = "files = !echo a" if assign else "files = ['a']"
    run(ip, f"%cd .\n%env ACCEL_EXPORT_CHECK=1\n!echo hi\n{captured}\n%time x = len(files)\n%load_ext accel_magic")
    run(ip, "%%accel_train -n 1\ny = x")
    ip.user_ns.pop("y", None)
    ip.run_line_magic("accel_export", f"{tmp_path}/t.py")
    script = (tmp_path / "t.py").read_text()
    for line in [
        "os.chdir(os.path.expanduser('.'))",
        "os.environ['ACCEL_EXPORT_CHECK'] = '1'",
        "subprocess.run('echo hi', shell=True)",
        "files = subprocess.run('echo a', shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)"
        ".stdout.splitlines()"
        if assign
        else captured,
        "x = len(files)",
        "pass  # %load_ext accel_magic (not needed in a script)",
    ]:
        assert f"\n{line}\n" in script, line
    compile(script, "t.py", "exec")


def test_refusals_are_one_sentence(ip, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run(ip, 'globals()["hidden"] = 1')
    run(ip, "%%accel_train -n 1\nx = hidden")
    count = ip.execution_count - 1
    assert usage_error(ip, f"{tmp_path}/t.py").startswith(f"Cell [{count}] uses `hidden`, which no earlier cell")
    assert "does not exist" in usage_error(ip, f"{tmp_path}/missing/t.py")
    assert "see %accel_export? for the options" in usage_error(ip, "")
    assert "--port must be a whole number" in usage_error(ip, f"{tmp_path}/t.py --port 0")
    no_training = ["", *["x = 1\nprint(x)"] * (ip.execution_count - 1)]  # a kernel that never trained
    monkeypatch.setattr(ip.history_manager, "input_hist_raw", no_training)
    assert usage_error(ip, f"{tmp_path}/t.py") == (
        "No %%accel_train cell has run in this kernel: run the training cell first, then %accel_export."
    )
    assert not list(tmp_path.iterdir())  # nothing was written
    (tmp_path / "folder.py").mkdir()
    run(ip, "%%accel_train -n 1\nx = 1")
    assert "is a folder" in usage_error(ip, f"{tmp_path}/folder.py")


def test_a_training_cells_refusal_counts_its_lines_below_the_magic_as_a_launch_does(ip, tmp_path: Path) -> None:
    run(ip, "%%accel_train -n 1\nx = 1\n\n%who_ls")
    message = usage_error(ip, f"{tmp_path}/t.py")
    assert re.match(r"Cell \[\d+\] line 3 uses %who_ls, which has no plain-Python equivalent: ", message), message


def test_unload_ext_removes_the_magic(ip) -> None:
    assert "accel_export" in ip.magics_manager.magics["line"]
    ip.run_line_magic("unload_ext", "accel_magic")
    assert "accel_export" not in ip.magics_manager.magics["line"]
    ip.run_line_magic("load_ext", "accel_magic")
