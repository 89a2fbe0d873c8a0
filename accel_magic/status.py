"""The status widget a background launch leaves in its cell, in core ipywidgets only (7 and 8): a headline, one
row per rank (state, time it ran, the last line it printed), rank 0's displays (tqdm.auto bars), a Stop button
and the whole output on demand. The job's thread updates it; the widget's own events arrive in the kernel's main
thread."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .jobs import Job

__all__ = ["StatusView", "duration", "rank_rows", "headline", "shown_output", "bundle_html"]

SHOWN_LINES = 400  # of the whole output, the last lines the widget shows (the job keeps more: job.output)
COLOURS = {"starting": "#777", "running": "#1565c0", "done": "#2e7d32", "failed": "#c62828", "stopped": "#ef6c00"}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def headline(job: Job) -> str:
    plan = job.plan
    n = plan.num_processes
    where = f"{plan.device} ({plan.backend})" if plan.backend else plan.device
    state = job.status.upper() if job.status in ("failed", "stopped") else job.status
    colour = COLOURS.get(job.status, "#777")
    text = (
        f"<b>accel_train</b> in the background · {n} rank{'s' if n > 1 else ''} on {html.escape(where)} · "
        f'<b style="color:{colour}">{state}</b> · {duration(job.elapsed)}'
    )
    if job.status == "done" and not job.applied:
        text += " · the results come into the notebook when the next cell runs (or now: <code>%accel_wait</code>)"
    if job.error:
        text += f'<div style="color:{COLOURS["failed"]};margin-top:2px">{html.escape(job.error)}</div>'
    if job.details:
        text += f'<pre style="margin:2px 0;font-size:12px;line-height:1.3">{html.escape(job.details)}</pre>'
    if job.note:
        text += f'<div style="margin-top:2px">{html.escape(job.note)}</div>'
    return f'<div style="font-size:13px;line-height:1.4">{text}</div>'


def rank_rows(job: Job) -> str:
    cell = "padding:1px 10px 1px 0;text-align:left;white-space:nowrap"
    rows = [
        f'<tr style="color:#777"><th style="{cell}">rank</th><th style="{cell}">state</th>'
        f'<th style="{cell}">time</th><th style="{cell}">where</th><th style="{cell}">last line</th></tr>'
    ]
    for rank in job.ranks:
        state = job.rank_states[rank]
        last = job.last_line[rank]
        last = last if len(last) <= 160 else last[:159] + "…"
        rows.append(
            f'<tr><td style="{cell}">{rank}</td><td style="{cell};color:{COLOURS.get(state, "#777")}">{state}</td>'
            f'<td style="{cell}">{duration(job.rank_time(rank))}</td>'
            f'<td style="{cell}">{html.escape(job.places.get(rank, ""))}</td>'
            f'<td style="{cell};font-family:monospace;overflow:hidden;max-width:60em">{html.escape(last)}</td></tr>'
        )
    return f'<table style="border-collapse:collapse;font-size:12px;margin:2px 0">{"".join(rows)}</table>'


def shown_output(text: str) -> str:
    """The last lines of the ranks' output as a terminal shows them (a carriage return overwrites its line)."""
    lines = [line.rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")][-SHOWN_LINES:]
    body = html.escape("\n".join(lines)) if text else "(nothing printed yet)"
    return f'<pre style="max-height:24em;overflow:auto;font-size:12px;line-height:1.3;margin:2px 0">{body}</pre>'


class StatusView:
    """The widget of one job."""

    def __init__(self, job: Job):
        import ipywidgets as w

        self.job = job
        self.head = w.HTML(headline(job))
        self.table = w.HTML(rank_rows(job))
        self.displays = displays_box()  # rank 0's displays, set from the job's thread
        self.stop_button = w.Button(
            description="Stop",
            button_style="danger",
            tooltip="End every rank now (acts when no other cell is running)",
        )
        self.show_output = w.ToggleButton(description="Output", tooltip="Everything the ranks printed")
        self.output = w.HTML(layout=w.Layout(display="none"))
        self.widget = w.VBox(
            [self.head, self.table, self.displays, w.HBox([self.stop_button, self.show_output]), self.output]
        )
        self.stop_button.on_click(self._stop)
        self.show_output.observe(self._toggle, names="value")
        self._shown: list[tuple[str | None, dict[str, Any]]] = []  # rank 0's displays: (display_id, data)
        self._made: list[Any] = []  # the HTML widgets that show those that are not widgets
        self._clear_on_next = False

    def show(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _stop(self, _: Any = None) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        self.job.stop(wait=False)

    def _toggle(self, change: Any) -> None:
        self.output.layout.display = "" if change["new"] else "none"
        if change["new"]:
            self.output.value = shown_output(self.job.output)

    def refresh(self, job: Job) -> None:
        """Each part anew, the headline last: a front end shows each part as its message comes, so when the
        headline says how the job ended, the rows and the button already do."""
        self.table.value = rank_rows(job)
        if self.show_output.value:
            self.output.value = shown_output(job.output)
        if job.ended.is_set():
            self.stop_button.disabled = True
            self.stop_button.description = "Stop"
        self.head.value = headline(job)

    def rank_message(self, message: dict[str, Any]) -> None:
        """A kernel message from rank 0: a display goes into the widget (the cell that started the launch has
        ended, and front ends drop its late outputs); widget traffic is published as is."""
        from .launch.relay import publish_kernel_message

        msg = message.get("msg_or_type")
        if isinstance(msg, dict):
            kind, content = msg.get("header", {}).get("msg_type"), msg.get("content", {})
        else:
            kind, content = msg, message.get("content") or {}
        if kind in ("display_data", "update_display_data", "execute_result"):
            self._display(kind, content)
        elif kind == "clear_output":
            if content.get("wait"):
                self._clear_on_next = True
            else:
                self._set_shown([])
        else:
            publish_kernel_message(message, flush=False)

    def _display(self, kind: str, content: dict[str, Any]) -> None:
        shown = [] if self._clear_on_next else list(self._shown)
        self._clear_on_next = False
        data = content.get("data", {})
        display_id = (content.get("transient") or {}).get("display_id")
        if kind == "update_display_data":
            for index, (key, _) in enumerate(shown):
                if key == display_id:
                    shown[index] = (key, data)
        else:
            shown.append((display_id, data))
        self._set_shown(shown)

    def _set_shown(self, shown: list[tuple[str | None, dict[str, Any]]]) -> None:
        import ipywidgets as w

        self._shown = shown
        children, made = [], []
        for _, data in shown:
            view = data.get(WIDGET_VIEW)
            if isinstance(view, dict) and view.get("model_id"):
                children.append(f"IPY_MODEL_{view['model_id']}")  # a widget rank 0 made (a tqdm.auto bar)
            else:
                made.append(w.HTML(bundle_html(data)))
                children.append(f"IPY_MODEL_{made[-1].model_id}")
        self.displays.children = children
        for widget in self._made:
            widget.close()
        self._made = made


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def bundle_html(data: dict[str, Any]) -> str:
    """A display's richest form that HTML can show: HTML, an image, SVG, else its text."""
    if "text/html" in data:
        return str(data["text/html"])
    for mime in ("image/png", "image/jpeg", "image/gif"):
        if mime in data:
            return f'<img src="data:{mime};base64,{str(data[mime]).strip()}">'
    if "image/svg+xml" in data:
        return str(data["image/svg+xml"])
    return f'<pre style="margin:0">{html.escape(str(data.get("text/plain", "")))}</pre>'


def displays_box() -> Any:
    """A VBox whose children are given as model references ("IPY_MODEL_<id>"), so that widgets rank 0 made,
    which have no object in the kernel, can be shown in it. (ipywidgets' Output widget would take the displays
    as they are, but classic Notebook with ipywidgets 7 cannot make its model.)"""
    import ipywidgets as w
    from traitlets import List, Unicode

    class RankDisplays(w.VBox):
        children = List(Unicode()).tag(sync=True)  # type: ignore[assignment]

    return RankDisplays()
