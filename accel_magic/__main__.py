"""`python -m accel_magic`: the runtime probe and the plan, as text or JSON, for bug reports."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from .plan import MIXED_PRECISION, STRATEGIES, PlanError, Request, make_plan
from .runtime import probe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accel_magic", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("-n", "--num-processes", type=int, default=None)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--mixed-precision", choices=MIXED_PRECISION)
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    args = parser.parse_args(argv)
    runtime = probe()
    request = Request(args.num_processes, args.cpu, args.mixed_precision, args.strategy)
    try:
        plan = make_plan(runtime, request)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        described = asdict(runtime)
        described["versions"] = dict(runtime.versions)
        print(json.dumps({"runtime": described, "plan": plan.to_dict()}, indent=2, default=str))
    else:
        print(repr(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
