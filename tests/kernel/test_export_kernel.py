"""%accel_export of notebooks/02_ddp_on_cpu.ipynb's training cell: the script, run by accelerate launch, torchrun
and two torchrun "nodes" on loopback, trains the same weights as the notebook's own %%accel_train -n 2 run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from ports import free_port

NOTEBOOK = Path(__file__).parents[2] / "notebooks" / "02_ddp_on_cpu.ipynb"
TIMEOUT = 180


class Exported:
    def __init__(self, folder: Path, summary: str):
        self.folder, self.summary = folder, summary

    def run(self, *command: str, output: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*command, "train_digits.py", "--output-dir", output],
            cwd=self.folder,
            env=script_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )

    def same_weights(self, output: str) -> None:
        import torch

        notebook = torch.load(self.folder / "notebook_model.pt")
        script = torch.load(self.folder / output / "model.pt")
        assert notebook.keys() == script.keys()
        differ = [k for k in notebook if not torch.equal(notebook[k], script[k])]
        assert not differ, f"{output}: {differ} differ from the notebook's weights"


def script_env() -> dict[str, str]:
    """One thread per process (two cores run two ranks), gloo on loopback, and no accel_magic on the path."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return env


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    """The notebook's cells up to its export section, run in a real kernel in a temp folder, then the trained
    model's weights saved and the training cell exported."""
    folder = tmp_path_factory.mktemp("export")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    end = next(i for i, c in enumerate(code) if "%accel_export" in c.source)
    nb.cells = [
        *code[:end],
        nbformat.v4.new_code_cell('torch.save(model.state_dict(), "notebook_model.pt")'),
        nbformat.v4.new_code_cell("%accel_export train_digits.py"),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # the ranks in the kernel and in the scripts compute alike
        client = NotebookClient(
            nb, timeout=TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        )
        client.iopub_timeout, client.raise_on_iopub_timeout = 30, True  # as run_cells: no output lost
        client.execute()
    summary = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    return Exported(folder, summary)


def test_export_prints_the_files_cells_and_commands(exported: Exported) -> None:
    assert "Wrote train_digits.py and train_digits.slurm" in exported.summary
    assert "defines F, model, opt, test_dl, torch, train_dl (used by [" in exported.summary
    assert "accelerate launch --multi_gpu --num_processes 2 train_digits.py" in exported.summary
    assert "torchrun --nproc-per-node 2 train_digits.py" in exported.summary
    script = (exported.folder / "train_digits.py").read_text()
    assert "accel_magic" not in script.split('"""', 2)[2]  # the code needs torch and accelerate only
    assert "%accel_setup" not in script and "load_digits" in script


def test_accelerate_launch_trains_the_notebooks_weights(exported: Exported) -> None:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    result = exported.run(*launch, "--multi_gpu", "--num_processes", "2", output="accelerate_out")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test accuracy gathered from both ranks" in result.stdout
    exported.same_weights("accelerate_out")


def test_accelerate_launch_cpu_that_starts_one_process_is_refused(exported: Exported) -> None:
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port())]
    result = exported.run(*launch, "--cpu", "--num_processes", "2", output="one_process_out")
    assert result.returncode != 0
    assert "accelerate launch started one process, not several" in result.stderr
    assert "--multi_gpu --num_processes 2" in result.stderr
    assert not (exported.folder / "one_process_out").exists()


def test_torchrun_trains_the_notebooks_weights(exported: Exported) -> None:
    launch = [sys.executable, "-m", "torch.distributed.run", "--master-port", str(free_port())]
    result = exported.run(*launch, "--nproc-per-node", "2", output="torchrun_out")
    assert result.returncode == 0, result.stderr[-3000:]
    exported.same_weights("torchrun_out")


def test_two_torchrun_nodes_on_loopback_train_the_notebooks_weights(exported: Exported) -> None:
    port = free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    launch += ["--rdzv-id", "export-test", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [
        subprocess.Popen(
            [*launch, "--node-rank", str(rank), "train_digits.py", "--output-dir", "nodes_out"],
            cwd=exported.folder,
            env=script_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=TIMEOUT)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    exported.same_weights("nodes_out")
