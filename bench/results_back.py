"""Results back: models of 1M, 10M and 100M parameters returned to the notebook after `-n 2`, against
torch.save + torch.load of the same state_dict through /dev/shm in the kernel.

Two measures of the cost: the launch with results minus the same launch with --no-return (medians; launches of
a DDP model vary by tenths of a second, which hides small costs), and the results phases timed where they run
(writing in rank 0, reading and applying in the kernel: `accel_result.results_seconds`)."""

from __future__ import annotations

from common import Section, figures, med, run_cells, spread, verdict

SIZES = {"1M": (1000, 3), "10M": (3162, 3), "100M": (10000, 1)}  # Linear(n, n): n*n + n parameters; repeat factor

PREPARE = """
import os, time, tempfile, torch
get_ipython().run_line_magic("load_ext", "accel_magic")
shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
def timed_launch(options, tag):
    t0 = time.perf_counter()
    get_ipython().run_cell_magic("accel_train", "-n 2 --max-return-mb 4096 " + options, "model = accelerator.prepare(model)")
    print(tag, time.perf_counter() - t0)
    if accel_result.results_seconds:
        print("PHASES", sum(accel_result.results_seconds.values()))
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
    runs = {label: repeats * factor for label, (_, factor) in SIZES.items()}
    section = Section(
        "4. Results back",
        "Seconds; alternated runs in one kernel per size ("
        + ", ".join(f"{label}: {n}" for label, n in runs.items())
        + "). Anchor: torch.save + torch.load of the state_dict via /dev/shm in the kernel.",
        ["parameters", "MB", "launch with results", "with --no-return", "difference", "results phases, timed",
         "save+load anchor", "phases / anchor", "difference / anchor", "phases ms per MB"],
    )  # fmt: skip
    ratios = []
    for label, (n, _) in SIZES.items():
        text = "".join(run_cells([PREPARE, *cells_for(n, runs[label])], timeout=3600))
        params = figures(text, "PARAMS")[0]
        with_, without, anchor = figures(text, "WITH"), figures(text, "WITHOUT"), figures(text, "SAVELOAD")
        phases = figures(text, "PHASES")
        difference = med(with_) - med(without)
        mb = params * 4 / 2**20
        ratio = med(phases) / med(anchor)
        ratios.append((label, ratio, difference / med(anchor)))
        section.rows.append(
            [label, f"{mb:.0f}", f"{med(with_):.3f} ({spread(with_, 1, 3)})", f"{med(without):.3f} ({spread(without, 1, 3)})",
             f"{difference:.3f}", f"{med(phases):.3f} ({spread(phases, 1, 3)})", f"{med(anchor):.3f} ({spread(anchor, 1, 3)})",
             f"{ratio:.2f}", f"{difference / med(anchor):.2f}", f"{med(phases) / mb * 1000:.2f}"]
        )  # fmt: skip
    section.verdicts = [verdict(f"results phases / save+load at {label}", r, 1.5) for label, r, _ in ratios]
    section.verdicts += [f"difference of launch medians / save+load at {label}: {d:.2f}" for label, _, d in ratios]
    return section
