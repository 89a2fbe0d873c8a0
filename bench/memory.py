"""Memory: the kernel's RSS before and after 20 launches, and a rank's peak RSS against the kernel's."""

from __future__ import annotations

from common import Section, figures, run_cells, verdict

PREPARE = """
import gc, psutil, resource, torch
get_ipython().run_line_magic("load_ext", "accel_magic")
me = psutil.Process()
def rss():
    gc.collect()
    return me.memory_info().rss / 2**20
"""
LAUNCH = (
    "%%accel_train -n 2\nimport torch, psutil, resource\nnet = accelerator.prepare(torch.nn.Linear(512, 512))\n"
    "out = net(torch.randn(64, 512)).sum()\nresult = torch.randn(100_000)\n"
    "if accelerator.is_main_process:\n"
    "    info = psutil.Process().memory_full_info()\n"
    "    print('RANKPEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n"
    "    print('RANKUSS', info.uss / 2**20)"
)


def measure(launches: int = 20) -> Section:
    # after two warm-up launches: before the second, the kernel imports what DDP imported in the first one's ranks
    # (once, 50 to 110 MB: not a leak)
    cells = [PREPARE, LAUNCH, LAUNCH, "print('BEFORE', rss())"]
    cells += [LAUNCH] * launches
    cells += ["print('AFTER', rss())", "print('KERNELPEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"]
    text = "".join(run_cells(cells))
    before, after = figures(text, "BEFORE")[0], figures(text, "AFTER")[0]
    peak = max(figures(text, "RANKPEAK"))
    uss = max(figures(text, "RANKUSS"))
    kernel_peak = figures(text, "KERNELPEAK")[0]
    growth = after - before
    section = Section(
        "5. Memory",
        f"Kernel RSS after two warm-up launches (before the second, the kernel imports what DDP imported in the "
        f"first one's ranks), then after {launches} more launches that return a tensor and a prepared model; MB.",
        ["what", "MB"],
        [
            ["kernel RSS before", f"{before:.0f}"],
            [f"kernel RSS after {launches} launches", f"{after:.0f}"],
            ["growth", f"{growth:.1f}"],
            ["kernel peak RSS", f"{kernel_peak:.0f}"],
            ["rank 0 peak RSS (shares the kernel's pages after fork)", f"{peak:.0f}"],
            ["rank 0 unique memory (USS)", f"{uss:.0f}"],
        ],
    )
    section.verdicts = [verdict(f"kernel growth over {launches} launches", growth, 50, " MB")]
    return section
