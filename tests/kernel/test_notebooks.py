"""The teaching notebooks run top to bottom in a real kernel and show what their text says."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).parents[2]
NOTEBOOKS = ROOT / "notebooks"
ACCURACY = 0.85  # digits with a small MLP reach about 0.9


def execute(name: str, folder: Path = NOTEBOOKS) -> tuple[list[str], float]:
    """Run the notebook in `folder` (its own by default), as Jupyter does."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    start = time.monotonic()
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    # a cell's last outputs may trail its reply on a busy machine: wait for them, and fail rather than lose them
    client.iopub_timeout, client.raise_on_iopub_timeout = 30, True
    client.execute()
    took = time.monotonic() - start
    keep_for_the_site(nb, NOTEBOOKS / name)
    texts = []
    for cell in nb.cells:
        parts = []
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            parts.append(out.get("text", "") or out.get("data", {}).get("text/plain", ""))
        texts.append("\n".join(parts))
    print(f"{name}: ran in {took:.1f} s")
    return texts, took


def keep_for_the_site(nb: nbformat.NotebookNode, notebook: Path) -> None:
    """On today's stack (.venv), the executed notebook is what the documentation site shows (`make docs`)."""
    if Path(sys.prefix) != ROOT / ".venv":
        return
    spec = importlib.util.spec_from_file_location("build_docs", ROOT / "scripts" / "build_docs.py")
    assert spec is not None and spec.loader is not None
    build_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_docs)
    build_docs.save_executed(nb, notebook)


def find(texts: list[str], pattern: str) -> re.Match[str]:
    for text in texts:
        match = re.search(pattern, text, re.M)
        if match:
            return match
    raise AssertionError(f"{pattern!r} not in the notebook's outputs")


def test_every_notebook_starts_with_a_conditional_install_that_does_not_import_google_colab() -> None:
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        first = "".join(cells[0]["source"])
        assert 'find_spec("accel_magic") is None' in first and "pip" in first, path.name
        assert "%load_ext accel_magic" in first and "google.colab" not in path.read_text(), path.name


def test_01_quickstart_trains_a_classifier() -> None:
    texts, _ = execute("01_quickstart.ipynb")
    assert find(texts, r"^cpu gloo 1$")
    assert find(texts, r"^<Figure size 500x250 with 1 Axes>$")  # the loss of every step that came back, drawn
    assert float(find(texts, r"test accuracy: ([\d.]+)").group(1)) > ACCURACY


def test_02_ddp_on_cpu_shows_shards_averaging_identical_weights_and_gathered_metrics(tmp_path: Path) -> None:
    texts, _ = execute("02_ddp_on_cpu.ipynb", tmp_path)  # its export section writes files into the folder
    labels0 = find(texts, r"^rank 0 of 2: 14 batches per epoch, first labels (\[.*\])$").group(1)
    labels1 = find(texts, r"^\[rank 1\] rank 1 of 2: 14 batches per epoch, first labels (\[.*\])$").group(1)
    assert labels0 != labels1  # each rank sees its own shard
    assert find(texts, r"^the ranks' own gradients differ: True$")
    assert find(texts, r"^after all-reduce every rank holds their mean: True$")
    assert find(texts, r"^rank 0: largest difference from rank 0's weights: 0\.0$")
    assert find(texts, r"^\[rank 1\] rank 1: largest difference from rank 0's weights: 0\.0$")
    gathered = float(find(texts, r"test accuracy gathered from both ranks: ([\d.]+) on 397 digits").group(1))
    in_notebook = float(find(texts, r"test accuracy in the notebook: ([\d.]+)").group(1))
    assert gathered > ACCURACY and in_notebook > ACCURACY
    assert find(texts, r"^Classifier$")
    # When you outgrow the notebook: the export, and the script run by accelerate launch from the notebook.
    assert find(texts, r"^Wrote train_digits.py and train_digits.slurm from these cells:$")
    assert find(texts, r"^  \[\d+\] defines F, model, opt, test_dl, torch, train_dl \(used by \[\d+\]\)$")
    assert find(texts, r"^  accelerate launch --multi_gpu --num_processes 2 train_digits.py --output-dir \S+$")
    assert find(texts, r"^wrote digits_out/model.pt\r?$")  # ! output comes through a terminal
    assert find(texts, r"^largest difference between the script's weights and the notebook's: 0\.0$")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits_out", "train_digits.py", "train_digits.slurm"]


def test_03_fallbacks_prints_each_decision() -> None:
    texts, _ = execute("03_fallbacks.ipynb")
    assert find(texts, r"fp16 has no effect on the CPU .* so training runs in full precision")
    assert find(texts, r"FSDP needs CUDA GPUs .* so the ranks use DDP")
    assert find(texts, r"DeepSpeed needs CUDA GPUs .* so the ranks use DDP")
    assert find(texts, r"^refused: FSDP needs CUDA GPUs .*: use --strategy ddp")
    assert find(texts, r"^rank 0: mixed_precision bf16, output dtype torch.bfloat16$")
    assert find(texts, r"^\[rank 1\] rank 1: mixed_precision bf16, output dtype torch.bfloat16$")
    assert find(texts, r"^Colab, one T4 \(described\): device cuda, backend nccl, num_processes 1")
    assert find(texts, r"^Kaggle, two T4 \(described\): device cuda, backend nccl, num_processes 2")
    assert find(texts, r"^Kaggle, P100 with a cu128 torch \(described\): device cpu, backend gloo")
    assert find(texts, r"^Colab TPU v5e-1 with torch_xla \(described\): device xla, backend xla")
    assert find(texts, r"^refused: 2 processes need 2 GPUs but this runtime has 1 .* add --cpu")


def test_04_runs_a_training_function_three_ways() -> None:
    texts, _ = execute("04_from_notebook_launcher.ipynb")
    launches = [t for t in texts if "2 processes, DistributedType.MULTI_CPU" in t]
    assert len(launches) == 3, texts  # accelerate's launcher, the drop-in and the cell: one gloo group each
    assert find(texts, r"^accelerate returned None$")
    accuracy = float(find(texts, r"^the drop-in returned rank 0's accuracy: ([\d.]+)$").group(1))
    assert accuracy > ACCURACY
    assert (
        float(find(texts, r"^test accuracy of the notebook's own model: ([\d.]+) \(Sequential\)$").group(1)) > ACCURACY
    )


def test_05_runs_pytorchs_ddp_tutorial_with_mp_spawn_and_as_a_cell_and_shows_the_collectives() -> None:
    texts, _ = execute("05_pytorch_ddp.ipynb")
    spawned, cell, lesson = (t for t in texts if "rank 0" in t)
    assert "torch.multiprocessing.spawn: 2 processes forked by accel_magic" in spawned
    assert "accel_magic: init_process_group joined the launch's process group" in cell
    for text in (spawned, cell):
        for rank, prefix in ((0, ""), (1, "[rank 1] ")):
            assert f"{prefix}rank {rank}: the same weights as every other rank: True" in text
            assert f"{prefix}Finished running basic DDP example on rank {rank}." in text
    for line in (
        "all_reduce: rank 0 held 1.0, now holds 3.0",
        "[rank 1] all_reduce: rank 1 held 2.0, now holds 3.0",
        "broadcast from rank 1: rank 0 held 0.0, now holds 10.0",
        "[rank 1] all_gather: rank 1 held 2.0, now holds [1.0, 2.0]",
        "reduce to rank 0: rank 0 held 1.0, now holds 3.0",
        "scatter from rank 0: rank 0 received 100.0",
        "[rank 1] scatter from rank 0: rank 1 received 200.0",
    ):
        assert line in lesson.split("\n"), line


@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_is_saved_without_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
