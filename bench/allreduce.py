"""Gradient averaging of CPU ranks: shared memory (--allreduce shm, the default) against gloo (--allreduce gloo)
and one process, at -n 2 and -n 4, on the throughput benchmark's MLP (one 4.7 MB bucket a step) and on a small
convolutional net whose gradients travel in many small buckets; loop time on rank 0, alternated in one kernel.
The floor is -n 2 with no averaging at all (the timed loop in DDP's `no_sync`): what any averaging could reach."""

from __future__ import annotations

import textwrap

from common import TIMED_STEPS, Section, figures, med, run_cells, spread, verdict

NETS = {
    "MLP 128-1024-1024-10": """
model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
shape, cap = (128,), 25  # accelerate's default bucket size: one bucket a step
""",
    "conv net, 8 buckets": """
layers = [torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU()]
for _ in range(6):
    layers += [torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
shape, cap = (3, 8, 8), 0.04  # 40 KB buckets: each conv layer's gradients travel alone, as in a larger net
""",
}

LOOP = """
import time, torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
torch.manual_seed(0)
{net}
accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=cap)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model, opt = accelerator.prepare(model, opt)"""


ONE = "one process"
FLOOR = "-n 2 no averaging (floor)"
TIMED_LOOP = "for i in range(200):\n    step(i)"


def cases() -> dict[tuple[str, str], str]:
    """(net, case) -> the cell that measures it; the one-process anchor runs in the kernel itself."""
    found = {}
    for net, body in NETS.items():
        loop = LOOP.format(net=body.strip()) + TIMED_STEPS
        for n in (2, 4):
            for how in ("shm", "gloo"):
                found[(net, f"-n {n} {how}")] = f"%%accel_train -n {n} --allreduce {how} --no-return\n{loop}"
        assert TIMED_LOOP in loop
        unsynced = loop.replace(TIMED_LOOP, "with model.no_sync():\n" + textwrap.indent(TIMED_LOOP, "    "))
        found[(net, FLOOR)] = f"%%accel_train -n 2 --allreduce gloo --no-return\n{unsynced}"
        found[(net, ONE)] = loop
    return found


def measure(repeats: int = 3) -> Section:
    cells = ["%load_ext accel_magic"]
    order = []
    measured = cases()
    kernel = [key for key in measured if key[1] == ONE]
    launched = [key for key in measured if key[1] != ONE]
    for _ in range(repeats):
        for key in launched:
            cells.append(measured[key])
            order.append(key)
    for _ in range(repeats):  # last: an Accelerator in the kernel stays there
        for key in kernel:
            cells.append(measured[key])
            order.append(key)
    texts = run_cells(cells)[1:]
    found: dict[tuple[str, str], list[float]] = {}
    for key, text in zip(order, texts, strict=True):
        found.setdefault(key, []).extend(figures(text, "LOOP"))
    rows, verdicts = [], []
    for net in NETS:
        one = med(found[(net, ONE)])
        for n in (2, 4):
            shm, gloo = med(found[(net, f"-n {n} shm")]), med(found[(net, f"-n {n} gloo")])
            for how, value in (("shm", shm), ("gloo", gloo)):
                values = found[(net, f"-n {n} {how}")]
                rows.append([net, f"-n {n} {how}", f"{value:.2f}", spread(values), f"{value / one:.2f}x",
                             f"{gloo / value:.2f}x" if how == "shm" else ""])  # fmt: skip
            if n == 2:
                verdicts.append(verdict(f"{net}, -n 2: gloo / shm (speed-up)", gloo / shm, 1.5, lower_is_better=False))
                verdicts.append(verdict(f"{net}, -n 2: shm / one process", shm / one, 1.15))
            else:
                verdicts.append(verdict(f"{net}, -n 4 on this machine: shm / gloo", shm / gloo, 1.0))
        floor = med(found[(net, FLOOR)])
        rows.append([net, FLOOR, f"{floor:.2f}", spread(found[(net, FLOOR)]), f"{floor / one:.2f}x", ""])
        rows.append([net, ONE, f"{one:.2f}", spread(found[(net, ONE)]), "1.00x", ""])
        shm2 = med(found[(net, "-n 2 shm")])
        verdicts.append(f"{net}, -n 2 with no averaging / one process: {floor / one:.2f}x (the best any averaging can "
                        f"do); -n 2 shm / no averaging: {shm2 / floor:.2f}x")  # fmt: skip
    section = Section(
        "6. Gradient averaging: shared memory, gloo, one process",
        f"200 steps, global batch 128, after 5 warm-up steps (the conv net in DDP buckets of 40 KB); loop time on rank 0 in "
        f"seconds; {repeats} runs of each, alternated in one kernel. `shm` is `--allreduce shm` (the default), "
        "`gloo` is `--allreduce gloo`.",
        ["net", "case", "median (s)", "spread (s)", "vs one process", "gloo / shm"],
        rows,
    )
    section.verdicts = verdicts
    return section
