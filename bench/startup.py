"""Start-up: what `import accel_magic` + `%load_ext` import and cost, and what `%accel_setup` costs."""

from __future__ import annotations

from common import Section, figures, med, run_cells, spread, verdict

LOAD = """
import sys, time
before = set(sys.modules)
t0 = time.perf_counter()
get_ipython().run_line_magic("load_ext", "accel_magic")
print("LOAD", time.perf_counter() - t0)
new = set(sys.modules) - before
print("MODULES", len(new))
print("HEAVY", len([m for m in ("torch", "accelerate", "ipywidgets") if m in new]))
"""
IMPORTS = "\n".join(
    f"t0 = time.perf_counter()\nimport {m}\nprint('{m.upper()}', time.perf_counter() - t0)"
    for m in ("ipywidgets", "torch", "accelerate")  # ipywidgets first: accelerate's tqdm.auto imports it
)
SETUP = """
t0 = time.perf_counter()
get_ipython().run_line_magic("accel_setup", "")
print("SETUP", time.perf_counter() - t0)
from accel_magic.runtime import probe
from accel_magic.plan import make_plan
from accel_magic.panel import panel_bundle
for _ in range(5):
    t0 = time.perf_counter(); rt = probe(get_ipython()); t1 = time.perf_counter()
    plan = make_plan(rt); t2 = time.perf_counter()
    panel_bundle(plan); t3 = time.perf_counter()
    print("PROBE", t1 - t0); print("PLAN", t2 - t1); print("PANEL", t3 - t2); print("PPP", t3 - t0)
"""


def measure(repeats: int = 5) -> Section:
    found: dict[str, list[float]] = {}
    heavy = []
    for _ in range(repeats):  # a fresh kernel each time: first imports are first imports
        text = "".join(run_cells([LOAD, IMPORTS, SETUP]))
        for tag in ("LOAD", "MODULES", "TORCH", "ACCELERATE", "IPYWIDGETS", "SETUP", "PROBE", "PLAN", "PANEL", "PPP"):
            found.setdefault(tag, []).extend(figures(text, tag))
        heavy += figures(text, "HEAVY")
    ms = 1000
    rows = [
        [
            "`import accel_magic` + `%load_ext accel_magic`",
            f"{med(found['LOAD']) * ms:.1f} ms",
            spread(found["LOAD"], ms, 1),
        ],
        ["modules it imports (count)", f"{med(found['MODULES']):.0f}", spread(found["MODULES"], 1, 0)],
        ["of those, torch / accelerate / ipywidgets", f"{max(heavy):.0f}", "-"],
        [
            "first `import ipywidgets` in a fresh kernel",
            f"{med(found['IPYWIDGETS']) * ms:.0f} ms",
            spread(found["IPYWIDGETS"], ms, 0),
        ],
        ["then `import torch`", f"{med(found['TORCH']) * ms:.0f} ms", spread(found["TORCH"], ms, 0)],
        ["then `import accelerate`", f"{med(found['ACCELERATE']) * ms:.0f} ms", spread(found["ACCELERATE"], ms, 0)],
        [
            "first `%accel_setup` (all three imported; builds the Accelerator)",
            f"{med(found['SETUP']) * ms:.0f} ms",
            spread(found["SETUP"], ms, 0),
        ],
        ["probe()", f"{med(found['PROBE']) * ms:.1f} ms", spread(found["PROBE"], ms, 1)],
        ["make_plan()", f"{med(found['PLAN']) * ms:.2f} ms", spread(found["PLAN"], ms, 2)],
        [
            "panel (text/plain + text/html)",
            f"{med(found['PANEL']) * ms:.1f} ms",
            spread(found["PANEL"], ms, 1),
        ],
        ["probe + plan + panel", f"{med(found['PPP']) * ms:.1f} ms", spread(found["PPP"], ms, 1)],
    ]
    section = Section(
        "1. Start-up",
        f"{repeats} fresh kernels. Times are medians with min-max.",
        ["what", "median", "spread"],
        rows,
    )
    section.verdicts = [
        verdict("load", med(found["LOAD"]) * ms, 50, " ms"),
        verdict("probe + plan + panel", med(found["PPP"]) * ms, 150, " ms"),
        f"heavy modules imported by load: {max(heavy):.0f} (target 0) - {'met' if max(heavy) == 0 else 'MISSED'}",
    ]
    return section
