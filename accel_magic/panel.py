"""The setup panel: the plan as rows, text, HTML and a core-ipywidgets view, shown once per `%accel_setup`."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from .runtime import describe_gpus

if TYPE_CHECKING:  # the plan renders itself through this module, which therefore never imports it at run time
    from .plan import Plan

__all__ = ["WIDGET_VIEW", "plan_rows", "plan_text", "plan_html", "panel_bundle", "show_plan", "mark_shown"]

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
