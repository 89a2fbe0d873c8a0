"""Launch overhead: an (almost) empty `%%accel_train -n 2` vs notebook_launcher(num_processes=2) building
Accelerator(cpu=True), alternated in one kernel, and the floor: a bare fork of 2 processes that join a gloo
group and all-reduce one tensor."""

from __future__ import annotations

from common import Section, figures, med, run_cells, spread, verdict

PREPARE = """
import os, socket, time
import torch, torch.distributed as dist
from accelerate import notebook_launcher
get_ipython().run_line_magic("load_ext", "accel_magic")

def build():
    from accelerate import Accelerator
    Accelerator(cpu=True)

def floor():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            try:
                store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
                t = torch.ones(1); dist.all_reduce(t)
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
"""
OURS = """
t0 = time.perf_counter()
get_ipython().run_cell_magic("accel_train", "-n 2 --no-return", "pass")
print("OURS", time.perf_counter() - t0)
print("CLEANUP", accel_result.cleanup_time)
"""
NL = "t0 = time.perf_counter()\nnotebook_launcher(build, num_processes=2)\nprint('NL', time.perf_counter() - t0)"
FLOOR = "t0 = time.perf_counter()\nfloor()\nprint('FLOOR', time.perf_counter() - t0)"


def measure(repeats: int = 15) -> Section:
    cells = [PREPARE, OURS, NL, FLOOR]  # one warm-up round, not counted
    for _ in range(repeats):
        cells += [OURS, NL, FLOOR]
    text = "".join(run_cells(cells)[4:])
    ours, nl, floor, cleanup = (figures(text, t) for t in ("OURS", "NL", "FLOOR", "CLEANUP"))
    rows = [
        ["`%%accel_train -n 2` (`pass`)", f"{med(ours):.3f}", spread(ours, 1, 3), f"{med(ours) / med(nl):.2f}x"],
        ["of which cleanup", f"{med(cleanup):.3f}", spread(cleanup, 1, 3), "-"],
        ["notebook_launcher(num_processes=2), Accelerator(cpu=True)", f"{med(nl):.3f}", spread(nl, 1, 3), "1.00x"],
        [
            "floor: bare fork of 2, gloo group, one all-reduce",
            f"{med(floor):.3f}",
            spread(floor, 1, 3),
            f"{med(floor) / med(nl):.2f}x",
        ],
    ]
    section = Section(
        "2. Launch overhead",
        f"{repeats} rounds alternated in one kernel after a warm-up round; seconds.",
        ["case", "median (s)", "spread (s)", "vs notebook_launcher"],
        rows,
    )
    ratio = med(ours) / med(nl)
    section.verdicts = [verdict("accel_train / notebook_launcher", ratio, 1.5), verdict("stretch", ratio, 1.25)]
    return section
