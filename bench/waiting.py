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

import os
import subprocess
import sys

from allreduce import LOOP, NETS
from common import TIMED_STEPS, Section, figures, med, run_cells, spread, verdict

MLP = "MLP 128-1024-1024-10"
# The timed loop, then the CPU time each rank took over it (every thread of its process) and the part of it that
# the rank's places watcher took (its thread's own CPU clock), as means over the ranks printed by rank 0.
START = """import os, threading
watcher = next(t for t in threading.enumerate() if t.name == "accel_magic-places")
clock = time.pthread_getcpuclockid(watcher.ident)
c0, w0 = sum(os.times()[:2]), time.clock_gettime(clock)
t0 = time.perf_counter()"""
END = """
spent = accelerator.gather(torch.tensor([[sum(os.times()[:2]) - c0, time.clock_gettime(clock) - w0]])).mean(0)
accelerator.print(f"CPU {spent[0]:.4f}"); accelerator.print(f"WATCHER {spent[1]:.6f}")"""
BODY = LOOP.format(net=NETS[MLP].strip()) + TIMED_STEPS.replace("t0 = time.perf_counter()", START) + END
assert START in BODY
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


def tally(keys: list[str], texts: list[str]) -> dict[str, dict[str, list[float]]]:
    """Each key's loop times ("LOOP"), CPU time per rank ("CPU") and its watcher's part ("WATCHER"), from the cells'
    texts in the same order."""
    found: dict[str, dict[str, list[float]]] = {}
    for key, text in zip(keys, texts, strict=True):
        if key:
            for tag in ("LOOP", "CPU", "WATCHER"):
                found.setdefault(key, {}).setdefault(tag, []).extend(figures(text, tag))
    return found


def loaded(count: int, place: str, repeats: int) -> dict[str, dict[str, list[float]]]:
    """shm and gloo, alternated in one kernel, while `count` busy processes run: started by the notebook
    ("notebook"), or each in a session of its own ("session")."""
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
    return tally([HOWS[i % 2] for i in range(len(texts))], texts)


def row(case: str, where: str, found: dict[str, list[float]], ratio: str = "") -> list[str]:
    return [MLP, case, where, f"{med(found['LOOP']):.2f}", spread(found["LOOP"]), f"{med(found['CPU']):.2f}", ratio]


def share(found: dict[str, list[float]]) -> float:
    """The part of the machine's CPUs that the two ranks took over the loop."""
    return 2 * med(found["CPU"]) / (med(found["LOOP"]) * len(os.sched_getaffinity(0)))


def measure(repeats: int = 3) -> Section:
    shm = f"%%accel_train -n 2 --allreduce shm --no-return\n{BODY}"
    # the watcher's cost, on a quiet machine
    cells = ["%load_ext accel_magic", ASLEEP]
    order = []
    for _ in range(2 * repeats):  # twice as many: the target is a difference of 2%
        cells += [AWAKE, shm, ASLEEP, shm]
        order += ["", "watched", "", "asleep"]
    cost = tally(order, run_cells(cells)[2:])
    watched, asleep = med(cost["watched"]["LOOP"]), med(cost["asleep"]["LOOP"])
    rows = [row("-n 2 shm, places watched", "quiet", cost["watched"]),
            row("-n 2 shm, watcher asleep", "quiet", cost["asleep"])]  # fmt: skip
    own, rank = med(cost["watched"]["WATCHER"]), med(cost["watched"]["CPU"])
    verdicts = [
        verdict("watched / watcher asleep (-n 2, shm)", watched / asleep, 1.02),
        f"the watcher thread's own CPU over the loop: {own * 1000:.1f} ms of the rank's {rank:.2f} s ({own / rank:.2%})",
    ]
    # shm against gloo: quiet, then busy processes the notebook started, then busy processes of other sessions
    for count, place in ((0, "notebook"), (1, "notebook"), (2, "notebook"), (1, "session"), (2, "session")):
        found = loaded(count, place, repeats)
        shm_s, gloo_s = med(found["shm"]["LOOP"]), med(found["gloo"]["LOOP"])
        where = "quiet"
        if count:
            whose = (
                "the notebook's" if place == "notebook" else f"{'each ' if count > 1 else ''}in a session of its own"
            )
            where = f"{count} busy process{'es' if count > 1 else ''}, {whose}"
        rows += [row("-n 2 shm", where, found["shm"], f"{gloo_s / shm_s:.2f}x"), row("-n 2 gloo", where, found["gloo"])]
        verdicts.append(verdict(f"gloo / shm, {where}", gloo_s / shm_s, 1.0, lower_is_better=False))
        if place == "session":
            taken = {how: f"{share(found[how]):.0%}" for how in HOWS}
            verdicts[-1] += (
                f" (the CPUs are shared between sessions first: the ranks took {taken['shm']} of them with shm, "
                f"{taken['gloo']} with gloo, where each of the {count + 1} sessions' fair share is {1 / (count + 1):.0%})"
            )
    section = Section(
        "7. Waiting ranks: the watcher's cost, and shared memory against gloo on a busy machine",
        f"The bench MLP, 200 steps after 5 warm-up steps; loop time on rank 0 in seconds, and the CPU time each rank "
        f"took over the loop (every thread of its process); {repeats} runs of each ({2 * repeats} for the watcher's "
        "cost), alternated in one kernel. The watcher asleep: its thread samples once an hour instead of every 0.2 s. Busy processes: a Python loop each, "
        "started by the notebook before the launches (they share the kernel's CPU group, as every process of a "
        "container does: Colab, Kaggle, Binder), or each in a session of its own (where the notebook's processes are "
        "in the root CPU group, Linux's autogroup shares the CPUs between sessions first, then within each). "
        f"{scheduling()}",
        ["net", "case", "machine", "median (s)", "spread (s)", "CPU per rank (s)", "gloo / shm"],
        rows,
    )
    section.verdicts = verdicts
    return section
