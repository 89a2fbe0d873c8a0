"""Waiting ranks: what the thread that watches each rank's place costs (the bench MLP at -n 2 with it and with it
asleep, alternated in one kernel), and how a waiting rank waits when the machine is busy: shared-memory averaging
against gloo on the same MLP, quiet and with one and two busy processes (a Python loop each) competing for the
CPUs.

Where the busy processes run matters on Linux. In a container (Colab, Kaggle, Binder) every process of the runtime
shares one CPU group, and the scheduler shares the CPUs thread by thread; so it does for the processes the notebook
starts (a `!python` job, a data loader's workers). Where the notebook's processes are in the root CPU group (a Linux
desktop, this kind of VM), autogroup makes each session a group of its own and shares the CPUs between groups first,
then within each (as systemd's cgroups do where their CPU controller is on). Both are measured."""

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
# A busy process: a Python loop, which ends with the process that started it.
BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100000): pass"
HOWS = ("shm", "gloo")


def scheduling() -> str:
    """Whether autogroup is on here, and this process's CPU cgroup (autogroup applies only in the root one)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            autogroup = "on" if f.read().strip() == "1" else "off"
    except OSError:
        autogroup = "absent"
    with open("/proc/self/cgroup") as f:
        lines = [line.strip().split(":", 2) for line in f]
    cpu = next((path for _, controllers, path in lines if "cpu" in controllers.split(",")), None)
    cpu = cpu or next((path for hierarchy, _, path in lines if hierarchy == "0"), "unknown")
    return f"Here: autogroup {autogroup}; this process's CPU cgroup `{cpu}`."


def loaded(count: int, place: str, repeats: int) -> dict[str, list[float]]:
    """Loop times of shm and gloo, alternated in one kernel, while `count` busy processes run: started by the
    notebook ("notebook") or in another session ("session")."""
    launches = [f"%%accel_train -n 2 --allreduce {how} --no-return\n{BODY}" for _ in range(repeats) for how in HOWS]
    mine = count if place == "notebook" else 0
    start = (
        f"import subprocess, sys\nbusy = [subprocess.Popen([sys.executable, '-c', {BUSY!r}]) for _ in range({mine})]"
    )
    stop = "for p in busy:\n    p.kill(); p.wait()"
    procs = []
    if place == "session":
        procs = [subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True) for _ in range(count)]
    try:
        texts = run_cells(["%load_ext accel_magic", start, *launches, stop])[2:-1]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    found: dict[str, list[float]] = {}
    for i, text in enumerate(texts):
        found.setdefault(HOWS[i % 2], []).extend(figures(text, "LOOP"))
    return found


def measure(repeats: int = 3) -> Section:
    shm = f"%%accel_train -n 2 --allreduce shm --no-return\n{BODY}"
    # the watcher's cost, on a quiet machine
    cells = ["%load_ext accel_magic", ASLEEP]
    order = []
    for _ in range(repeats):
        cells += [AWAKE, shm, ASLEEP, shm]
        order += ["", "watched", "", "asleep"]
    texts = run_cells(cells)[2:]
    cost: dict[str, list[float]] = {}
    for key, text in zip(order, texts, strict=True):
        if key:
            cost.setdefault(key, []).extend(figures(text, "LOOP"))
    watched, asleep = med(cost["watched"]), med(cost["asleep"])
    rows = [[MLP, "-n 2 shm, places watched", "quiet", f"{watched:.2f}", spread(cost["watched"]), ""],
            [MLP, "-n 2 shm, watcher asleep", "quiet", f"{asleep:.2f}", spread(cost["asleep"]), ""]]  # fmt: skip
    verdicts = [verdict("watched / watcher asleep (-n 2, shm)", watched / asleep, 1.02)]
    # shm against gloo: quiet, then busy processes the notebook started, then busy processes of another session
    for count, place in ((0, "notebook"), (1, "notebook"), (2, "notebook"), (1, "session"), (2, "session")):
        times = loaded(count, place, repeats)
        shm_s, gloo_s = med(times["shm"]), med(times["gloo"])
        plural = "es" if count > 1 else ""
        where = {0: "quiet"}.get(count, f"{count} busy process{plural}, " + ("the notebook's" if place == "notebook"
                                                                              else "another session's"))  # fmt: skip
        for how, value in (("shm", shm_s), ("gloo", gloo_s)):
            rows.append([MLP, f"-n 2 {how}", where, f"{value:.2f}", spread(times[how]),
                         f"{gloo_s / shm_s:.2f}x" if how == "shm" else ""])  # fmt: skip
        verdicts.append(verdict(f"gloo / shm, {where}", gloo_s / shm_s, 1.0, lower_is_better=False))
    section = Section(
        "7. Waiting ranks: the watcher's cost, and shared memory against gloo on a busy machine",
        f"The bench MLP, 200 steps after 5 warm-up steps; loop time on rank 0 in seconds; {repeats} runs of each, "
        "alternated in one kernel. The watcher asleep: its thread samples once an hour instead of every 0.2 s. Busy "
        "processes: a Python loop each, started by the notebook before the launches (they share the kernel's CPU "
        "group, as every process of a container does: Colab, Kaggle, Binder), or in a session of their own (where "
        "the notebook's processes are in the root CPU group, Linux's autogroup shares the CPUs between sessions "
        f"first). {scheduling()}",
        ["net", "case", "machine", "median (s)", "spread (s)", "gloo / shm"],
        rows,
    )
    section.verdicts = verdicts
    return section
