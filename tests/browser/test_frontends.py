"""What a user sees in JupyterLab 4, Notebook 7 and classic Notebook 6.5.7 (Colab's widget stack): the panel
(also in a 720 px window, in JupyterLab's light and dark themes), a rank-0 progress bar, the other ranks' lines,
the stop button, and the panel after the notebook is reopened with no kernel or exported."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from frontends import ROOT, front_ends, write_notebook

SETUP = "%load_ext accel_magic\n%accel_setup -n 2"
TRAIN = """\
%%accel_train -n 2
from tqdm.auto import tqdm
import time
for step in tqdm(range(20), disable=accelerator.process_index != 0):
    time.sleep(0.05)
print("done on rank", accelerator.process_index)"""
LONG = """\
%%accel_train -n 2
import time
print("started on rank", accelerator.process_index)
while True:
    time.sleep(0.1)"""
WIDGET_ERRORS = ("Error displaying widget", "could not be displayed", "model not found")


def panel_readable(text: str) -> None:
    assert re.search(r"\bcpu\b", text, re.I) and "gloo" in text, text
    assert not any(error in text for error in WIDGET_ERRORS), text


def full_bars(nb, index: int, timeout: float = 30) -> list:
    """The cell's progress bars, once one is drawn at 100%."""
    deadline = time.monotonic() + timeout
    while True:
        bars = nb.progress_bars(index)
        if any(bar["width"] == "100%" for bar in bars):
            return bars
        if time.monotonic() > deadline:
            shown = nb.output_text(index)
            raise AssertionError(f"no progress bar at 100% in cell {index} within {timeout:g} s: {bars}\n{shown}")
        time.sleep(0.2)


def test_the_panel_a_rank_0_bar_at_100_and_the_other_ranks_lines_render(server, open_notebook) -> None:
    write_notebook(server.root / "train.ipynb", SETUP, TRAIN, "import accel_magic\nprint(accel_magic.__file__)")
    nb = open_notebook("train.ipynb")
    nb.run_all()
    for line in ("[rank 1] done on rank 1", "done on rank 0"):
        nb.wait_for_output(1, line)
    panel_readable(nb.wait_for_output(0, "gloo"))
    # tqdm.auto's widget, forwarded from rank 0, drawn by the front end's widget manager: one progress bar, full,
    # with its counts beside it (tqdm's text fallback, "100%|###| 20/20", has no such element)
    bars = full_bars(nb, 1)
    assert len(bars) == 1 and bars[0]["drawn"] > 0.99 and "20/20" in bars[0]["text"], bars
    shown = nb.output_text(1)
    assert not any(error in shown for error in WIDGET_ERRORS), shown
    # the kernel runs this checkout's accel_magic (frontends.Server puts it first on PYTHONPATH)
    assert nb.wait_for_output(2, "__init__.py").strip() == str(ROOT / "accel_magic" / "__init__.py")


def test_the_stop_button_ends_a_two_rank_cell_with_one_short_line_and_the_next_cell_runs(
    server, open_notebook, two_ranks_stopped
) -> None:
    write_notebook(server.root / "stop.ipynb", "%load_ext accel_magic", LONG, "print('next cell ran')")
    nb = open_notebook("stop.ipynb")
    nb.run_all()
    # Both ranks in the cell: rank 1's line alone can come while rank 0 still builds its accelerator, and an
    # interrupt then rightly names no cell line of rank 0's.
    nb.wait_for_output(1, "[rank 1] started on rank 1")
    nb.wait_for_output(1, "started on rank 0")
    clicked = time.monotonic()
    nb.stop()
    shown = nb.wait_for_output(1, "KeyboardInterrupt", timeout=30)
    took = time.monotonic() - clicked
    error = shown[shown.index("KeyboardInterrupt") :].strip()
    assert re.fullmatch("KeyboardInterrupt: " + two_ranks_stopped(r"\d"), error), error
    assert took < 15, took  # seconds, not the collective timeout
    nb.run_cell(2)
    nb.wait_for_output(2, "next cell ran")


def test_the_panel_stays_readable_when_the_notebook_is_reopened_without_a_kernel_and_exported(
    server, open_notebook, front
) -> None:
    write_notebook(server.root / "panel.ipynb", SETUP)
    nb = open_notebook("panel.ipynb")
    nb.run_all()
    panel_readable(nb.wait_for_output(0, "gloo"))
    nb.save()
    nb.page.close()
    server.shut_down_kernels()
    server.restart(kernels=False)  # the page asks for a kernel, and gets "No Kernel"
    again = open_notebook("panel.ipynb")
    panel_readable(again.wait_for_output(0, "gloo", timeout=30))
    again.page.wait_for_timeout(2000)  # a kernel the page would start late
    assert server.api("GET", "/api/sessions") == [] and server.api("GET", "/api/kernels") == []
    panel_readable(again.output_text(0))
    html = server.root / "panel.html"
    subprocess.run(
        [front.python, "-m", "nbconvert", "--to", "html", "--output", html.name, "panel.ipynb"],
        cwd=server.root,
        check=True,
        capture_output=True,
        timeout=120,
    )
    again.page.goto(html.as_uri())
    panel_readable(again.page.inner_text("body"))


LAB, NOTEBOOK7, CLASSIC = front_ends()
NARROW = [
    pytest.param(LAB, "JupyterLab Light", id="lab-light"),
    pytest.param(LAB, "JupyterLab Dark", id="lab-dark"),
    pytest.param(NOTEBOOK7, "JupyterLab Light", id="notebook7"),
    pytest.param(CLASSIC, "JupyterLab Light", id="classic"),
]
# How the panel lays out: its text and background luminance, the headline's height in lines, how far the panel and
# its output area overflow (scrollWidth - clientWidth), the elements that reach past the panel's right edge, and
# the height in lines of the text of each table row's header and of a change row's "asked -> using" line, and the
# rows of the details when they are open.
LAYOUT = """p => {
    const lum = c => { const [r, g, b] = c.match(/\\d+/g).map(Number); return (r + g + b) / 765; };
    let bg = 'rgba(0, 0, 0, 0)', e = p;
    while (e && /rgba\\(0, 0, 0, 0\\)|transparent/.test(bg)) { bg = getComputedStyle(e).backgroundColor; e = e.parentElement; }
    const lines = e => { const r = document.createRange(); r.selectNodeContents(e);  // its text, not its box
        return r.getBoundingClientRect().height / parseFloat(getComputedStyle(e).lineHeight); };
    const right = p.getBoundingClientRect().right;
    const output = p.closest('.jp-OutputArea-output, .output_subarea');
    const row = r => ({key: lines(r.cells[0]), change: r.closest('details') ? null : lines(r.cells[1].firstElementChild),
                       text: r.innerText.slice(0, 60)});
    return {text: lum(getComputedStyle(p).color), background: lum(bg), headline: lines(p.firstElementChild),
            panel: p.scrollWidth - p.clientWidth, output: output.scrollWidth - output.clientWidth,
            page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
            beyond: [...p.querySelectorAll('*')].filter(e => e.getBoundingClientRect().right > right + 0.5)
                .map(e => e.tagName + ': ' + e.textContent.slice(0, 40)),
            changes: [...p.querySelectorAll(':scope > table tr')].map(row),
            details: [...p.querySelectorAll('details[open] tr')].map(row)};
}"""


@pytest.mark.parametrize("front, theme", NARROW, indirect=["front"])
def test_the_panel_is_compact_and_legible_at_720_px(server, open_notebook, front, theme) -> None:
    write_notebook(server.root / "narrow.ipynb", SETUP + " --mixed-precision fp16 --strategy fsdp")
    nb = open_notebook("narrow.ipynb", width=720)
    nb.fold_left_area()  # the notebook as wide as the window
    nb.run_all()
    nb.wait_for_output(0, "gloo")
    panel = nb.page.locator(".accel-magic-panel")
    looks = panel.evaluate(LAYOUT)
    shown = json.dumps(looks, indent=1)  # in full when a check fails
    if "Dark" in theme and not front.classic:
        assert looks["text"] > 0.6 and looks["background"] < 0.3, shown  # light text on the dark theme
    else:
        assert looks["text"] < 0.4 and looks["background"] > 0.7, shown
    assert looks["headline"] < 1.5, shown  # the headline on one line at 720 px
    assert looks["panel"] <= 0 and looks["output"] <= 0 and looks["page"] <= 0 and not looks["beyond"], shown
    assert len(looks["changes"]) == 2, shown  # mixed_precision and strategy: asked -> using
    assert all(r["key"] < 1.5 and r["change"] < 1.5 for r in looks["changes"]), shown
    assert looks["details"] == [], shown  # folded
    panel.locator("summary").click()
    opened = panel.evaluate(LAYOUT)
    shown = json.dumps(opened, indent=1)
    assert len(opened["details"]) > 10, shown  # the plan's settings and the runtime, with their group rows
    assert opened["panel"] <= 0 and opened["output"] <= 0 and opened["page"] <= 0 and not opened["beyond"], shown
    assert all(r["key"] < 1.5 for r in opened["details"]), shown  # each setting's name on one line


BACKGROUND = """\
%%accel_train -n 2 --background
from tqdm.auto import tqdm
import time
for step in tqdm(range(100_000), disable=accelerator.process_index != 0):
    time.sleep(0.05)
    print("step", step, flush=True)"""


def test_a_background_launch_shows_its_ranks_and_bar_while_another_cell_runs_and_stop_ends_it(
    server, open_notebook, two_ranks_stopped
) -> None:
    write_notebook(server.root / "background.ipynb", "%load_ext accel_magic", BACKGROUND, "print('meanwhile', 6 * 7)")
    nb = open_notebook("background.ipynb")
    nb.run_cell(0)
    nb.wait_until_idle()
    nb.run_cell(1)
    nb.wait_for_output(1, "in the background")
    shown = nb.wait_for_output(1, "step 3")  # each rank's last line, in its row
    assert re.search(r"\b0\s+running\b[\s\S]*\b1\s+running\b", shown), shown
    assert re.search(r"\d+it \[|\d+/100000", nb.wait_for_output(1, "it/s")), shown  # rank 0's tqdm.auto bar
    nb.run_cell(2)
    assert "meanwhile 42" in nb.wait_for_output(2, "meanwhile 42")
    assert "step" not in nb.output_text(2)  # the ranks' output stays in their own widget
    clicked = time.monotonic()
    nb.cells().nth(1).locator("button:has-text('Stop')").click()
    shown = nb.wait_for_output(1, "STOPPED", timeout=30)
    print(f"stopped {time.monotonic() - clicked:.2f} s after the click")
    assert re.search(two_ranks_stopped("[345]"), shown), shown
    assert re.search(r"\b0\s+stopped\b[\s\S]*\b1\s+stopped\b", shown), shown
