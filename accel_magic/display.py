"""What the notebook shows: the setup panel (a core-ipywidgets view with readable text/plain and text/html
beside it) and the ranks' output."""

from __future__ import annotations

import codecs
import contextlib
import html
import sys
from typing import Any

from .plan import Plan
from .runtime import describe_gpus

__all__ = [
    "plan_rows",
    "plan_text",
    "plan_html",
    "panel_bundle",
    "show_plan",
    "mark_shown",
    "RankLines",
    "forward_kernel_message",
    "launch_banner",
    "write_rank_text",
]

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "unknown"


def plan_rows(plan: Plan) -> list[tuple[str, str]]:
    rt = plan.runtime
    where = "in the kernel" if plan.launch == "kernel" else "as forked ranks"
    accel = "built now" if plan.accelerator == "eager" else "built on first use"
    backend = plan.backend or "none"
    versions = ", ".join(f"{k} {v}" for k, v in rt.versions if v)
    return [
        ("platform", f"{rt.platform} (shell: {rt.shell})"),
        ("device", plan.device),
        ("backend", backend),
        ("num_processes", f"{plan.num_processes}, {where}"),
        ("mixed_precision", plan.mixed_precision),
        ("strategy", plan.strategy),
        ("threads", f"{plan.threads_per_process} per process"),
        ("accelerator", accel),
        ("timeout", f"{plan.timeout:g} s for a collective to wait for the other ranks (--timeout)"),
        ("CPU budget", f"{rt.cpu_budget} (of {rt.cpu_count} cores on the host), RAM {_gib(rt.ram_bytes)}"),
        ("GPUs", describe_gpus(rt.gpus)),
        ("TPU", rt.tpu or "none"),
        ("versions", versions),
    ]


def plan_text(plan: Plan) -> str:
    rows = plan_rows(plan)
    width = max(len(k) for k, _ in rows)
    lines = ["accel_magic plan"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if plan.notes:
        lines.append("  notes:")
        lines += [f"  - {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_html(plan: Plan) -> str:
    cells = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
        f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in plan_rows(plan)
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in plan.notes)
    notes_html = f"<div><b>Notes</b><ul>{notes}</ul></div>" if notes else ""
    return f"<div class='accel-magic-panel'><b>accel_magic plan</b><table>{cells}</table>{notes_html}</div>"


def _widget(html_value: str) -> Any | None:
    """A core ipywidgets HTML view, only where a kernel can carry its comm messages."""
    try:
        from IPython import get_ipython

        if getattr(get_ipython(), "kernel", None) is None:
            return None
        import ipywidgets
    except ImportError:
        return None
    try:
        return ipywidgets.HTML(value=html_value)
    except Exception:  # a front end without comms: the text/html beside it still shows
        return None


def panel_bundle(plan: Plan) -> dict[str, Any]:
    """One display bundle: the widget view (when possible) plus text/plain and text/html."""
    html_value = plan_html(plan)
    bundle: dict[str, Any] = {"text/plain": plan_text(plan), "text/html": html_value}
    widget = _widget(html_value)
    if widget is not None:
        bundle[WIDGET_VIEW] = {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}
    return bundle


_shown_by_magic: tuple[int, int] | None = None


def _execution_count() -> int:
    from IPython import get_ipython

    return getattr(get_ipython(), "execution_count", -1)


def mark_shown(plan: Plan) -> None:
    """Tell the display hook that the magic has dealt with this plan in this execution."""
    global _shown_by_magic
    _shown_by_magic = (id(plan), _execution_count())


def show_plan(plan: Plan, by_magic: bool = False) -> None:
    """Display the panel. The magic shows it and returns the plan; the display hook then skips it
    once, so a bare `%accel_setup` shows one panel, not a panel plus an Out[n]."""
    global _shown_by_magic
    from IPython.display import display

    if by_magic:
        mark_shown(plan)
    elif _shown_by_magic == (id(plan), _execution_count()):
        _shown_by_magic = None
        return
    display(panel_bundle(plan), raw=True)


# --- per-rank output ---------------------------------------------------------------------------------------------


def _last_segment(line: str) -> str:
    """What a terminal would show of a line that carriage returns overwrite."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


class RankLines:
    """Assembles the bytes each rank writes to fds 1 and 2 into whole lines, so ranks never interleave
    mid-line. Rank 0 passes through as is (a carriage-return progress bar stays live); lines from other
    ranks are marked with the rank and keep only their last carriage-return segment."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}
        self._decoders: dict[tuple[int, str], Any] = {}

    def feed(self, rank: int, stream: str, data: bytes) -> str:
        key = (rank, stream)
        decoder = self._decoders.setdefault(key, codecs.getincrementaldecoder("utf-8")("replace"))
        text = (self._partial.pop(key, "") + decoder.decode(data)).replace("\r\n", "\n")
        if rank == 0:
            cut = max(text.rfind("\n"), text.rfind("\r")) + 1
        else:
            cut = text.rfind("\n") + 1
        ready, rest = text[:cut], text[cut:]
        if rest:
            self._partial[key] = rest
        if rank == 0 or not ready:
            return ready
        return "".join(f"[rank {rank}] {_last_segment(line)}\n" for line in ready.split("\n")[:-1])

    def flush(self) -> list[tuple[int, str, str]]:
        """What is left without a line end, once the ranks have ended."""
        left = []
        for (rank, stream), text in list(self._partial.items()):
            del self._partial[(rank, stream)]
            left.append((rank, stream, f"{text}\n" if rank == 0 else f"[rank {rank}] {_last_segment(text)}\n"))
        return left


def forward_kernel_message(message: dict[str, Any]) -> None:
    """Publish on the kernel's IOPub a display or widget message that rank 0 sent, so `display()` and
    `tqdm.auto` bars from the rank appear in the cell."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return
    for stream in (sys.stdout, sys.stderr):  # what the ranks printed before this message shows before it
        with contextlib.suppress(AttributeError, ValueError):
            stream.flush()
    kernel.session.send(kernel.iopub_socket, message.pop("msg_or_type"), **message)


def launch_banner(plan: Plan) -> str:
    where = f"{plan.device} ({plan.backend})" if plan.backend else plan.device
    threads = f", {plan.threads_per_process} thread{'s' if plan.threads_per_process != 1 else ''} each"
    mp = f", mixed_precision {plan.mixed_precision}" if plan.mixed_precision != "no" else ""
    lines = [
        f"accel_train: {plan.num_processes} processes on {where}{threads}{mp}; collective timeout {plan.timeout:g} s"
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def write_rank_text(rank: int, stream: str, text: str) -> None:
    """Write a rank's assembled output to the cell, at once."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()
