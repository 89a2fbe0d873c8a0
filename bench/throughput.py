"""CPU data-parallel throughput: 200 steps of an MLP 128-1024-1024-10, global batch 128, 5 warm-up steps; loop
time on rank 0, alternated in one kernel session."""

from __future__ import annotations

from common import TIMED_STEPS, Section, figures, med, run_cells, spread, verdict

LOOP = (
    """
import time, torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = accelerator.prepare(model, opt)
shape = (128,)"""
    + TIMED_STEPS
)


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


OURS = "accel_train -n 2"
NL1 = "notebook_launcher, Accelerator(cpu=True): 1 thread per rank"
NL2 = "the same forced to 2 threads per rank"
ONE = "one process in the kernel (anchor)"
CASES = {OURS: "%%accel_train -n 2 --no-return\n" + LOOP, NL1: launcher_cell(None), NL2: launcher_cell(2)}


def measure(repeats: int = 3) -> Section:
    cells = ["%load_ext accel_magic"]
    order = []
    for _ in range(repeats):
        for name, cell in CASES.items():
            cells.append(cell)
            order.append(name)
    for _ in range(repeats):  # last: an Accelerator in the kernel makes notebook_launcher refuse
        cells.append("from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n" + LOOP)
        order.append(ONE)
    texts = run_cells(cells)[1:]
    found: dict[str, list[float]] = {}
    for name, text in zip(order, texts, strict=True):
        found.setdefault(name, []).extend(figures(text, "LOOP"))
    anchor, one_thread = med(found[ONE]), med(found[NL1])
    rows = [
        [name, f"{med(v):.2f}", spread(v), f"{med(v) / anchor:.2f}x", f"{med(v) / one_thread:.2f}x"]
        for name, v in found.items()
    ]
    section = Section(
        "3. CPU data-parallel throughput",
        f"200 steps of an MLP 128-1024-1024-10, global batch 128, after 5 warm-up steps; loop time on rank 0 in "
        f"seconds; {repeats} runs of each, alternated in one kernel.",
        ["case", "median (s)", "spread (s)", "vs one process", "vs notebook_launcher 1 thread"],
        rows,
    )
    section.verdicts = [
        verdict("accel_train -n 2 / notebook_launcher at 1 thread per rank", med(found[OURS]) / one_thread, 1.05),
        verdict(
            "2 threads per rank / accel_train -n 2 (speed-up)",
            med(found[NL2]) / med(found[OURS]),
            3,
            lower_is_better=False,
        ),
    ]
    return section
