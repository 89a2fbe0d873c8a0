"""The setup panel: the plan as a headline, the changes to what was asked, notes and folded details, in plain
text and in HTML that needs no widget state or stylesheet, shown once per `%accel_setup`.

The HTML is one plain display (text/plain + text/html): it reads the same live, in a notebook reopened without
a kernel, in an nbconvert export and on GitHub. Styles are inline and only refine it (GitHub drops them); colors
are inherited and borders translucent, so light and dark themes both work.
"""

from __future__ import annotations

import html
import textwrap
from typing import TYPE_CHECKING

from .runtime import describe_gpus
from .session import current

if TYPE_CHECKING:  # the plan renders itself through this module, which therefore never imports it at run time
    from .plan import Fallback, Plan
    from .runtime import Runtime

__all__ = [
    "headline",
    "change_rows",
    "plan_notes",
    "detail_groups",
    "plan_text",
    "plan_html",
    "panel_bundle",
    "show_plan",
    "mark_shown",
]

PLATFORMS = {
    "colab": "Colab",
    "kaggle": "Kaggle",
    "binder": "Binder",
    "vscode": "VS Code",
    "jupyter": "Jupyter",
    "terminal": "terminal IPython",
    "python": "Python, outside IPython",
}
PACKAGES = {"python": "Python", "ipython": "IPython"}
STRATEGY_NAMES = {"ddp": "DDP", "fsdp": "FSDP", "deepspeed": "DeepSpeed"}
TEXT_WIDTH = 100


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "unknown"


def _memory(rt: Runtime) -> str:
    """The memory limit that applies to the kernel, where it comes from, and what is available under it."""
    if not rt.ram_bytes:
        return "unknown"
    limit = _gib(rt.ram_bytes) + ("" if rt.ram_limit == "machine" else f" ({rt.ram_limit} limit)")
    return limit if rt.ram_available is None else f"{limit}, {_gib(rt.ram_available)} available"


def _where(plan: Plan) -> str:
    """The device in a word or two: CPU, 2 × Tesla T4, TPU v5e-1."""
    rt = plan.runtime
    if plan.device == "cuda":
        names = {g.name for g in rt.gpus}
        if len(names) != 1:
            return _count(plan.num_processes, "GPU")
        name = names.pop()
        return name if plan.num_processes == 1 else f"{plan.num_processes} × {name}"
    if plan.device == "xla":
        return f"TPU {rt.tpu}" if rt.tpu else "TPU"
    if plan.device == "mps":
        return "Apple GPU (MPS)"
    return "CPU"


def _short_version(version: str | None) -> str | None:
    return ".".join(version.split(".")[:2]) if version else None


def headline(plan: Plan) -> str:
    """One line: where it trains, how many ranks, precision, strategy, accelerate's version."""
    parts = [_where(plan)]
    threads = _count(plan.threads_per_process, "thread")
    if plan.launch == "kernel":
        parts.append("in the kernel")
        if plan.device == "cpu":
            parts.append(threads)
    else:
        if plan.backend:
            parts.append(plan.backend)  # shared-memory averaging is in the details (the headline fits 720 px)
        if plan.num_nodes > 1:
            parts.append(f"node {plan.node_rank} of {plan.num_nodes}")
        ranks = _count(plan.num_processes, "rank")
        parts.append(f"{ranks} × {threads}" if plan.device == "cpu" else ranks)
    if plan.mixed_precision != "no":
        parts.append(plan.mixed_precision)
    if plan.strategy != "ddp":
        parts.append(STRATEGY_NAMES.get(plan.strategy, plan.strategy))
    accelerate = _short_version(plan.runtime.version.get("accelerate"))
    if accelerate:
        parts.append(f"accelerate {accelerate}")
    return " · ".join(parts)


def _change(fallback: Fallback) -> str:
    said = "asked" if fallback.asked else "found"
    return f"{said} {fallback.wanted} → using {fallback.using}"


def change_rows(plan: Plan) -> list[tuple[str, str, str]]:
    """(decision, "asked fp16 → using no", why) for each decision that differs from what was asked."""
    return [(f.topic, _change(f), f.note) for f in plan.fallbacks]


def plan_notes(plan: Plan) -> list[str]:
    """The notes that are not already the reason of a change row."""
    explained = {f.note for f in plan.fallbacks}
    return [n for n in plan.notes if n not in explained]


def _versions(plan: Plan) -> str:
    # A no-break space keeps each name with its version when the line wraps.
    return ", ".join(f"{PACKAGES.get(k, k)}\u00a0{v}" for k, v in plan.runtime.versions if v) or "unknown"


def _allreduce(plan: Plan) -> str:
    if plan.allreduce == "shm":
        return (
            "shm: the ranks average gradients in shared memory, gloo does the other collectives "
            "(--allreduce gloo turns it off)"
        )
    if plan.allreduce == "gloo" and plan.device == "cpu":
        return "gloo: the ranks average gradients through the process group"
    return plan.allreduce or "none"


def detail_groups(plan: Plan) -> list[tuple[str, list[tuple[str, str]]]]:
    """The details, grouped: the plan's settings (accelerate's names) and the runtime it was made for."""
    rt = plan.runtime
    per = "in the kernel" if plan.launch == "kernel" else "per rank"
    settings = [
        ("num_processes", f"{plan.num_processes}, {'in the kernel' if plan.launch == 'kernel' else 'as forked ranks'}"),
        ("mixed_precision", plan.mixed_precision),
        ("cpu", "True (accelerate's CPU mode)" if plan.cpu else "False"),
        ("device", plan.device),
        ("backend", plan.backend or "none"),
        ("allreduce", _allreduce(plan)),
        ("strategy", plan.strategy),
        ("threads", f"{plan.threads_per_process} {per}"),
        ("timeout", f"{plan.timeout:g} s for a collective to wait for the other ranks"),
        ("accelerator", "ready" if plan.accelerator == "eager" else "built when first used"),
    ]
    if plan.num_nodes > 1:
        settings.insert(
            1, ("nodes", f"this is node {plan.node_rank} of {plan.num_nodes}, rendezvous {plan.rdzv_endpoint}")
        )
    cpus = str(rt.cpu_budget) if rt.cpu_budget == rt.cpu_count else f"{rt.cpu_budget} usable of {rt.cpu_count}"
    runtime = [
        ("runs in", PLATFORMS.get(rt.platform, rt.platform)),
        ("CPUs", cpus),
        ("memory", _memory(rt)),
        ("GPUs", describe_gpus(rt.gpus)),
        ("TPU", rt.tpu or "none"),
        ("versions", _versions(plan)),
    ]
    return [("plan", settings), ("runtime", runtime)]


# --- text ---------------------------------------------------------------------------------------------------------


def _wrap(text: str, first: str, rest: str) -> list[str]:
    lines = textwrap.wrap(text, TEXT_WIDTH, initial_indent=first, subsequent_indent=rest) or [first.rstrip()]
    return [line.replace("\u00a0", " ") for line in lines]


def plan_text(plan: Plan) -> str:
    """The panel for terminals, logs and repr(plan): headline, changes, notes, then the details."""
    groups = detail_groups(plan)
    changes = change_rows(plan)
    keys = [len(c[0]) + 2 for c in changes] + [len(k) + 4 for _, rows in groups for k, _ in rows]
    column = max(keys) + 2  # where every value starts
    lines = [f"accel_magic: {headline(plan)}"]
    for topic, change, why in changes:
        lines += _wrap(change, f"  {topic}".ljust(column), " " * column)
        lines += _wrap(why, " " * column, " " * column)
    for note in plan_notes(plan):
        lines += _wrap(note, "  note: ", "        ")
    for title, rows in groups:
        lines.append(f"  {title}:")
        for key, value in rows:
            lines += _wrap(value, f"    {key}".ljust(column), " " * column)
    return "\n".join(lines)


# --- HTML ---------------------------------------------------------------------------------------------------------

# Inline only: notebook front ends style output tables (right-aligned cells, 0.5em padding, striped rows, centered
# tables, black text in classic Notebook); these override that, and GitHub, which drops them, still shows a table.
PANEL = "color:inherit;line-height:1.35;margin:2px 0"
TABLE = "border-collapse:collapse;margin:2px 0;table-layout:auto;color:inherit;font-size:inherit;width:auto"
ROW = "background:transparent;border-top:1px solid rgba(128,128,128,0.25)"
KEY = "text-align:left;vertical-align:top;padding:2px 14px 2px 0;white-space:nowrap;font-weight:600;line-height:1.35"
VALUE = "text-align:left;vertical-align:top;padding:2px 0;line-height:1.35;overflow-wrap:anywhere"
GROUP = "text-align:left;padding:6px 0 1px 0;font-weight:600;opacity:0.7;line-height:1.35"
MUTED = "opacity:0.72;line-height:1.3"  # with <small>, which keeps notes small where styles are dropped
SUMMARY = "cursor:pointer;opacity:0.8;margin:2px 0"


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def _row(key: str, value_html: str) -> str:
    return f'<tr style="{ROW}"><th scope="row" style="{KEY}">{_e(key)}</th><td style="{VALUE}">{value_html}</td></tr>'


def plan_html(plan: Plan) -> str:
    """The panel as self-contained HTML: no scripts, no <style>, no classes it depends on."""
    parts = [
        f'<div class="accel-magic-panel" style="{PANEL}">',
        f'<div style="margin:0 0 2px 0"><span style="opacity:0.65">accel_magic:</span> <strong>{_e(headline(plan))}'
        "</strong></div>",
    ]
    changes = change_rows(plan)
    if changes:
        rows = "".join(
            _row(topic, f'<div>{_e(change)}</div><div style="{MUTED}"><small>{_e(why)}</small></div>')
            for topic, change, why in changes
        )
        parts.append(f'<table style="{TABLE}"><tbody>{rows}</tbody></table>')
    for note in plan_notes(plan):
        parts.append(f'<div style="{MUTED};margin:1px 0"><small>note: {_e(note)}</small></div>')
    body = ""
    for title, rows in detail_groups(plan):
        body += f'<tr style="background:transparent"><th colspan="2" style="{GROUP}">{_e(title)}</th></tr>'
        body += "".join(_row(key, _e(value)) for key, value in rows)
    parts.append(
        f'<details style="margin:2px 0"><summary style="{SUMMARY}">details</summary>'
        f'<table style="{TABLE}"><tbody>{body}</tbody></table></details>'
    )
    parts.append("</div>")
    return "".join(parts)


def panel_bundle(plan: Plan) -> dict[str, str]:
    """One display bundle, text/plain and text/html: nothing that needs a kernel or widget state to show."""
    return {"text/plain": plan_text(plan), "text/html": plan_html(plan)}


def _execution_count() -> int:
    from IPython import get_ipython

    return getattr(get_ipython(), "execution_count", -1)


def mark_shown(plan: Plan) -> None:
    """Tell the display hook that the magic has dealt with this plan in this execution."""
    current().panel_shown = (id(plan), _execution_count())


def show_plan(plan: Plan, by_magic: bool = False) -> None:
    """Display the panel. The magic shows it and returns the plan; the display hook then skips it
    once, so a bare `%accel_setup` shows one panel, not a panel plus an Out[n]."""
    from IPython.display import display

    session = current()
    if by_magic:
        mark_shown(plan)
    elif session.panel_shown == (id(plan), _execution_count()):
        session.panel_shown = None
        return
    display(panel_bundle(plan), raw=True)
