"""Shared pieces of the benchmarks: cells run in a real kernel (nbclient + ipykernel), medians and spreads."""

from __future__ import annotations

import os
import platform
import re
import statistics
from dataclasses import dataclass, field
from importlib import metadata

import nbformat
from nbclient import NotebookClient

# The timed part of the data-parallel benchmarks, run where `model` and `opt` are prepared and `shape` is one
# sample's: 5 warm-up steps, then 200 timed steps of a global batch of 128; rank 0 prints the loop's time.
TIMED_STEPS = """
per_rank = 128 // accelerator.num_processes
xs = torch.randn(8, per_rank, *shape); ys = torch.randint(0, 10, (8, per_rank))
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
accelerator.print(f"LOOP {time.perf_counter() - t0:.4f}")
"""


@dataclass
class Section:
    """One benchmark case: a table, and lines that set each figure against its target."""

    title: str
    what: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    verdicts: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"## {self.title}", "", self.what, ""]
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "---|" * len(self.header))
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.verdicts:
            lines += [""] + [f"- {v}" for v in self.verdicts]
        return "\n".join(lines) + "\n"


def run_cells(cells: list[str], timeout: int = 1200) -> list[str]:
    """Execute the cells in one fresh kernel; return each cell's stream text."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=timeout, kernel_name="python3").execute()
    return ["".join(o.get("text", "") for o in c.get("outputs", []) if o["output_type"] == "stream") for c in nb.cells]


def figures(text: str, tag: str) -> list[float]:
    """Every number printed after `tag` (lines such as `LOOP 1.234`)."""
    return [float(x) for x in re.findall(rf"^{re.escape(tag)} (-?[\d.e+-]+)", text, re.M)]


def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f}"


def verdict(name: str, value: float, target: float, unit: str = "x", lower_is_better: bool = True) -> str:
    met = value <= target if lower_is_better else value >= target
    sign = "<=" if lower_is_better else ">="
    return f"{name}: {value:.2f}{unit} (target {sign} {target:g}{unit}) - {'met' if met else 'MISSED'}"


def machine() -> list[str]:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    budget = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = []
    for name in ("torch", "accelerate", "ipython", "ipykernel", "ipywidgets", "accel-magic"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{name} -")
    return [
        f"- Machine: {cpu}, {budget} CPUs usable, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}; " + ", ".join(versions),
        "- GPU: none on this machine; the GPU figures are not measured here.",
    ]
