"""Results back: models of 1M, 10M and 100M parameters returned to the notebook after `-n 2` (the launch with
results minus the same launch with --no-return), against torch.save + torch.load of the same state_dict
through /dev/shm in the kernel."""

from __future__ import annotations

from common import Section, figures, med, run_cells, spread, verdict

SIZES = {"1M": 1000, "10M": 3162, "100M": 10000}  # one Linear(n, n): n*n + n parameters

PREPARE = """
import os, time, tempfile, torch
get_ipython().run_line_magic("load_ext", "accel_magic")
shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
def timed_launch(options, tag):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("accel_train", "-n 2 --max-return-mb 4096 " + options, "model = accelerator.prepare(model)")
    print(tag, time.perf_counter() - t0)
def save_load():
    path = os.path.join(shm, "accel_magic_bench.pt")
    t0 = time.perf_counter()
    torch.save(model.state_dict(), path)
    state = torch.load(path)
    print("SAVELOAD", time.perf_counter() - t0)
    os.remove(path)
"""


def cells_for(n: int, repeats: int) -> list[str]:
    cells = [f"model = torch.nn.Linear({n}, {n})\nprint('PARAMS', sum(p.numel() for p in model.parameters()))"]
    for _ in range(repeats):
        cells += ["timed_launch('', 'WITH')", "timed_launch('--no-return', 'WITHOUT')", "save_load()"]
    return cells


def measure(repeats: int = 3) -> Section:
    section = Section(
        "4. Results back",
        f"Seconds; {repeats} alternated runs per size in one kernel. Cost = median(launch with results) - "
        "median(same launch with --no-return); anchor = torch.save + torch.load of the state_dict via /dev/shm.",
        [
            "parameters",
            "MB",
            "launch with results",
            "with --no-return",
            "cost of results",
            "save+load anchor",
            "ratio",
            "ms per MB",
        ],
    )
    ratios = []
    for label, n in SIZES.items():
        texts = run_cells([PREPARE, *cells_for(n, repeats)], timeout=3600)
        text = "".join(texts)
        params = figures(text, "PARAMS")[0]
        with_, without, anchor = figures(text, "WITH"), figures(text, "WITHOUT"), figures(text, "SAVELOAD")
        cost = med(with_) - med(without)
        mb = params * 4 / 2**20
        ratio = cost / med(anchor)
        ratios.append((label, ratio))
        section.rows.append(
            [label, f"{mb:.0f}", f"{med(with_):.3f} ({spread(with_, 1, 3)})", f"{med(without):.3f} ({spread(without, 1, 3)})",
             f"{cost:.3f}", f"{med(anchor):.3f} ({spread(anchor, 1, 3)})", f"{ratio:.2f}", f"{cost / mb * 1000:.2f}"]
        )  # fmt: skip
    section.verdicts = [verdict(f"cost / save+load at {label}", r, 1.5) for label, r in ratios]
    return section
