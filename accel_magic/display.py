"""What a launch prints into the cell: the banner that says how it runs, and each rank's assembled text."""

from __future__ import annotations

import re
import sys

from .plan import Plan

__all__ = ["launch_banner", "write_rank_text"]

# gloo announces each connection on a rank's stdout on some torch releases (2.9, 2.10): noise in the user's cell.
GLOO_CHATTER = re.compile(r"^(?:\[rank \d+\] )?\[Gloo\] Rank \d+ is connected to \d+ peer ranks\..*\n", re.M)


def launch_banner(plan: Plan) -> str:
    where = f"{plan.device} ({plan.backend})" if plan.backend else plan.device
    if plan.allreduce == "shm":  # the off switch is --allreduce gloo
        where = f"{plan.device} ({plan.backend}, gradients in shared memory)"
    threads = f", {plan.threads_per_process} thread{'s' if plan.threads_per_process != 1 else ''} each"
    mp = f", mixed_precision {plan.mixed_precision}" if plan.mixed_precision != "no" else ""
    nodes = ""
    if plan.num_nodes > 1:
        first, last = plan.node_rank * plan.num_processes, (plan.node_rank + 1) * plan.num_processes - 1
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        nodes = (
            f"node {plan.node_rank} of {plan.num_nodes} ({ranks} of {plan.num_nodes * plan.num_processes}, "
            f"rendezvous at {plan.rdzv_endpoint}): "
        )
    processes = f"{plan.num_processes} process{'es' if plan.num_processes != 1 else ''}"
    background = ", in the background" if plan.background else ""
    lines = [
        f"accel_train: {nodes}{processes} on {where}{threads}{mp}{background}; collective timeout {plan.timeout:g} s"
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def write_rank_text(rank: int, stream: str, text: str) -> None:
    """Write a rank's assembled output to the cell, at once."""
    text = GLOO_CHATTER.sub("", text)
    if not text:
        return
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()
