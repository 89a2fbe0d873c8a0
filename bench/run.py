"""`make bench`: run every benchmark in real kernels and write bench/RESULTS.md. Prints figures; never fails on
speed.

Usage: python bench/run.py [--quick] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import compileall
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import allreduce
import footprint
import launch_overhead
import memory
import results_back
import startup
import throughput
import waiting
from common import machine

CASES = {
    "startup": (startup.measure, {"repeats": 5}, {"repeats": 2}),
    "launch": (launch_overhead.measure, {"repeats": 15}, {"repeats": 3}),
    "throughput": (throughput.measure, {"repeats": 5}, {"repeats": 1}),
    "results": (results_back.measure, {"repeats": 3}, {"repeats": 1}),
    "memory": (memory.measure, {"launches": 20}, {"launches": 5}),
    "allreduce": (allreduce.measure, {"repeats": 3}, {"repeats": 1}),
    "waiting": (waiting.measure, {"repeats": 3}, {"repeats": 1}),
    "footprint": (footprint.measure, {}, {"counts": (1, 2), "first_use": False}),
}


def compile_package() -> str:
    """Compile accel_magic's bytecode, as pip does when it installs a wheel: an editable install on a machine with
    PYTHONDONTWRITEBYTECODE set would otherwise compile every module from source in each fresh kernel and rank."""
    spec = importlib.util.find_spec("accel_magic")
    assert spec is not None and spec.submodule_search_locations, "accel_magic is not installed in this environment"
    folder = spec.submodule_search_locations[0]
    compileall.compile_dir(folder, quiet=1)
    return "- accel_magic's bytecode compiled before the run, as pip compiles a wheel's when it installs it."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, to try the scripts")
    parser.add_argument("--only", nargs="*", choices=list(CASES), help="run only these cases")
    args = parser.parse_args()
    started = time.monotonic()
    parts = ["# Benchmarks", "", "Written by `make bench` (`python bench/run.py`). Every case runs in a real kernel "
             "(nbclient + ipykernel); ratios are against plain `notebook_launcher` or one process, measured in the "
             "same run.", "", *machine(), compile_package(), ""]  # fmt: skip
    for name in args.only or list(CASES):
        measure, full, quick = CASES[name]
        section = measure(**(quick if args.quick else full))
        text = section.markdown()
        print(text, flush=True)
        parts.append(text)
    parts.append(f"Total time of the run: {time.monotonic() - started:.0f} s.\n")
    out = Path(__file__).parent / "RESULTS.md"
    if not args.quick and not args.only:
        out.write_text("\n".join(parts))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
