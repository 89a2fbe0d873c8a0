"""Waiting ranks: what the thread that watches each rank's place costs (the bench MLP at -n 2 with it and with it
asleep, alternated in one kernel), and how a waiting rank waits when the machine is busy: shared-memory averaging
against gloo on the same MLP, quiet and with one and two busy processes (a Python loop each) competing for the
CPUs."""

from __future__ import annotations

import subprocess
import sys

from allreduce import LOOP, NETS
from common import TIMED_STEPS, Section, figures, med, run_cells, spread, verdict

MLP = "MLP 128-1024-1024-10"
BODY = LOOP.format(net=NETS[MLP].strip()) + TIMED_STEPS
# The watcher asleep: its thread starts in every rank, as always, and samples once an hour.
ASLEEP = "import accel_magic.launch.places as places\nplaces.EVERY, every = 3600.0, places.EVERY"
AWAKE = "places.EVERY = every"


def busy(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def measure(repeats: int = 3) -> Section:
    launch = {how: f"%%accel_train -n 2 --allreduce {how} --no-return\n{BODY}" for how in ("shm", "gloo")}
    # the watcher's cost, on a quiet machine
    cells = ["%load_ext accel_magic", ASLEEP]
    order = []
    for _ in range(repeats):
        cells += [AWAKE, launch["shm"], ASLEEP, launch["shm"]]
        order += ["", "watched", "", "asleep"]
    texts = run_cells(cells)[2:]
    cost: dict[str, list[float]] = {}
    for key, text in zip(order, texts, strict=True):
        if key:
            cost.setdefault(key, []).extend(figures(text, "LOOP"))
    # shm against gloo, quiet and loaded
    loaded: dict[tuple[int, str], list[float]] = {}
    for load in (0, 1, 2):
        procs = busy(load)
        try:
            texts = run_cells(["%load_ext accel_magic"] + [launch[how] for _ in range(repeats) for how in launch])[1:]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
        for i, text in enumerate(texts):
            loaded.setdefault((load, list(launch)[i % 2]), []).extend(figures(text, "LOOP"))
    watched, asleep = med(cost["watched"]), med(cost["asleep"])
    rows = [[MLP, "-n 2 shm, places watched", "quiet", f"{watched:.2f}", spread(cost["watched"]), ""],
            [MLP, "-n 2 shm, watcher asleep", "quiet", f"{asleep:.2f}", spread(cost["asleep"]), ""]]  # fmt: skip
    verdicts = [verdict("watched / watcher asleep (-n 2, shm)", watched / asleep, 1.02)]
    for load in (0, 1, 2):
        shm, gloo = med(loaded[(load, "shm")]), med(loaded[(load, "gloo")])
        where = "quiet" if load == 0 else f"{load} busy process{'es' if load > 1 else ''}"
        for how, value in (("shm", shm), ("gloo", gloo)):
            rows.append([MLP, f"-n 2 {how}", where, f"{value:.2f}", spread(loaded[(load, how)]),
                         f"{gloo / shm:.2f}x" if how == "shm" else ""])  # fmt: skip
        verdicts.append(verdict(f"gloo / shm, {where}", gloo / shm, 1.0, lower_is_better=False))
    section = Section(
        "7. Waiting ranks: the watcher's cost, and shared memory against gloo on a busy machine",
        f"The bench MLP, 200 steps after 5 warm-up steps; loop time on rank 0 in seconds; {repeats} runs of each, "
        "alternated in one kernel. The watcher asleep: its thread samples once an hour instead of every 0.2 s. Busy "
        "processes: `python -c 'while True: pass'`, started before the kernel.",
        ["net", "case", "machine", "median (s)", "spread (s)", "gloo / shm"],
        rows,
    )
    section.verdicts = verdicts
    return section
