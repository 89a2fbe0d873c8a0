"""CPU data-parallel throughput, measured in one real kernel session (nbclient + ipykernel).

200 steps of an MLP 128-1024-1024-10, global batch 128, 5 warm-up steps; loop time on rank 0:
  - %%accel_train -n 2
  - plain notebook_launcher(num_processes=2) with Accelerator(cpu=True)      (accelerate: 1 thread per rank)
  - the same, forced to 2 threads per rank  (what a non-CPU-mode Accelerator or a user's setting gives)
  - one process in the kernel (the anchor)
Prints each figure's median and spread over the repeats, and the ratios. Never fails on speed.

Usage: python bench/throughput.py [--repeats N]
"""

from __future__ import annotations

import argparse
import re
import statistics

import nbformat
from nbclient import NotebookClient

LOOP = """
import time, torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = accelerator.prepare(model, opt)
per_rank = 128 // accelerator.num_processes
xs = torch.randn(8, per_rank, 128); ys = torch.randint(0, 10, (8, per_rank))
def step(i):
    loss = F.cross_entropy(model(xs[i % 8]), ys[i % 8])
    accelerator.backward(loss); opt.step(); opt.zero_grad()
for i in range(5):
    step(i)
accelerator.wait_for_everyone()
t0 = time.perf_counter()
for i in range(200):
    step(i)
accelerator.wait_for_everyone()
accelerator.print(f"LOOP {time.perf_counter() - t0:.4f} threads {torch.get_num_threads()}")
"""


def launcher_cell(threads: int | None) -> str:
    body = "\n".join("    " + line for line in LOOP.strip().splitlines())
    force = f"    torch.set_num_threads({threads})\n" if threads else ""
    return (
        "from accelerate import Accelerator, notebook_launcher\n"
        "def train():\n"
        "    import torch\n"
        "    accelerator = Accelerator(cpu=True)\n"
        f"{force}{body}\n"
        "notebook_launcher(train, num_processes=2)"
    )


CASES = {
    "accel_train -n 2": "%%accel_train -n 2 --no-return\n" + LOOP,
    "notebook_launcher, 1 thread per rank": launcher_cell(None),
    "notebook_launcher, 2 threads per rank": launcher_cell(2),
}
ANCHOR = "one process in the kernel"


def run(cells: list[str]) -> list[str]:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=900, kernel_name="python3").execute()
    texts = []
    for cell in nb.cells:
        texts.append("".join(o.get("text", "") for o in cell.get("outputs", []) if o["output_type"] == "stream"))
    return texts


def loop_time(text: str) -> float:
    found = re.findall(r"^LOOP ([\d.]+)", text, re.M)
    if not found:
        raise RuntimeError(f"no loop time in:\n{text}")
    return float(found[-1])


def measure(repeats: int) -> dict[str, list[float]]:
    cells = ["%load_ext accel_magic"]
    order: list[str] = []
    for _ in range(repeats):  # alternated in one kernel session
        for name, cell in CASES.items():
            cells.append(cell)
            order.append(name)
    # The anchor last: an Accelerator in the kernel makes notebook_launcher refuse to launch.
    for _ in range(repeats):
        cells.append("from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n" + LOOP)
        order.append(ANCHOR)
    texts = run(cells)[1:]
    results: dict[str, list[float]] = {}
    for name, text in zip(order, texts, strict=True):
        results.setdefault(name, []).append(loop_time(text))
    return results


def report(results: dict[str, list[float]]) -> str:
    anchor = statistics.median(results[ANCHOR])
    one_thread = statistics.median(results["notebook_launcher, 1 thread per rank"])
    two_threads = statistics.median(results["notebook_launcher, 2 threads per rank"])
    lines = [
        "| case | median loop (s) | spread (min-max) | vs one process | vs notebook_launcher 1 thread |",
        "|---|---|---|---|---|",
    ]
    for name, values in results.items():
        med = statistics.median(values)
        spread = f"{min(values):.2f}-{max(values):.2f}"
        lines.append(f"| {name} | {med:.2f} | {spread} | {med / anchor:.2f}x | {med / one_thread:.2f}x |")
    ours = statistics.median(results["accel_train -n 2"])
    lines.append("")
    lines.append(f"accel_train -n 2 / notebook_launcher 1 thread: {ours / one_thread:.2f} (target <= 1.05)")
    lines.append(f"notebook_launcher 2 threads / accel_train -n 2: {two_threads / ours:.1f}x slower (target >= 3)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(report(measure(args.repeats)))


if __name__ == "__main__":
    main()
