"""The screenshots in docs/screenshots (shown in the README) are what JupyterLab renders today: the panel, the
panel in the notebook reopened with no kernel, a training cell with its bar and rank output, a failure and an
interrupt. `make screenshots` takes them anew; this test takes them again and fails when a committed one differs
in a way a person would notice. Text that changes from run to run (durations, rates, pids, ports, temporary
paths, dates) is made fixed in the page before each screenshot, when they are written and when they are checked."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

import pytest
from frontends import ROOT, FrontEnd, NotebookPage, Server, write_notebook

SHOTS = ROOT / "docs" / "screenshots"
WRITE = os.environ.get("ACCEL_MAGIC_SCREENSHOTS") == "write"  # set by `make screenshots`
WIDTH = 960  # the window; the notebook fills it, about as wide as the README shows it
TILE = 16  # px: the images are compared tile by tile, in color
LIMIT = 10  # of 255: a tile whose mean color difference is above this looks changed (a glyph, a bar's color)

CELLS = {
    "panel": "%load_ext accel_magic\n%accel_setup -n 2 --mixed-precision fp16",
    "training": """\
%%accel_train -n 2
from tqdm.auto import tqdm
import time
for step in tqdm(range(50), disable=accelerator.process_index != 0):
    time.sleep(0.02)
with accelerator.main_process_first():
    print(f"rank {accelerator.process_index}: trained on its shard")""",
    "failure": """\
%%accel_train -n 2
batch = [1, 2, 3]
if accelerator.process_index == 1:
    raise ValueError("rank 1 got a bad batch")
accelerator.wait_for_everyone()""",
    "interrupt": """\
%%accel_train -n 2
import time
with accelerator.main_process_first():
    print("training, rank", accelerator.process_index)
while True:
    time.sleep(0.1)""",
}
WAIT_FOR = {
    "panel": "gloo",
    "training": "[rank 1] rank 1: trained on its shard",
    "failure": "ValueError",
    "interrupt": "KeyboardInterrupt",
}


# Text that changes from run to run, as (pattern, what it becomes); the patterns are JavaScript's and Python's.
VOLATILE = [
    (r"\d+(?:\.\d+)?(?=it/s|s/it)", "50.00"),  # tqdm's rate
    (r"\d+:\d\d<\d+:\d\d", "00:01<00:00"),  # tqdm's elapsed and remaining time
    (r"\d+\.\d+(?= ?(?:s|ms|seconds?)\b(?!/))", "1.0"),  # a measured duration (a set one, "timeout 900 s", stays)
    (r"(?<=\bpid )\d+|(?<=\bpids )\d+", "4242"),
    (r"(?<=127\.0\.0\.1:)\d+|(?<=localhost:)\d+|(?<=\bport )\d+", "29500"),
    (r"/tmp/[\w.+\-/]+", "/tmp/accel_magic"),
    (r"\b\d{4}-\d\d-\d\d\b", "2026-01-01"),
    (r"\b\d\d:\d\d:\d\d(?:[.,]\d+)?\b", "12:00:00"),
]
# Rewrites the text nodes of an element's output areas with VOLATILE; returns how many it changed.
FIX_TEXT = """(element, rules) => {
    const patterns = rules.map(([pattern, fixed]) => [new RegExp(pattern, 'g'), fixed]);
    let changed = 0;
    for (const area of element.querySelectorAll('.jp-OutputArea, .output_area')) {
        const walker = document.createTreeWalker(area, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            const text = patterns.reduce((text, [pattern, fixed]) => text.replace(pattern, () => fixed), node.data);
            if (text !== node.data) { node.data = text; changed += 1; }
        }
    }
    return changed;
}"""


def fix_volatile(text: str) -> str:
    """What FIX_TEXT makes of a text (the same patterns, in Python)."""
    for pattern, fixed in VOLATILE:
        text = re.sub(pattern, fixed, text)
    return text


def differs(old: bytes, new: bytes) -> str:
    """Why a person would see the two images as different ("" when they would not): another size, or a tile of
    TILE x TILE px whose colors changed by more than LIMIT on average (one glyph in it is enough)."""
    from PIL import Image, ImageChops

    a, b = (Image.open(io.BytesIO(png)).convert("RGB") for png in (old, new))
    if a.size != b.size:
        return f"its size changed from {a.width}x{a.height} to {b.width}x{b.height}"
    means = ImageChops.difference(a, b).reduce(TILE).tobytes()  # each tile's mean difference, per channel
    changed = [
        (sum(means[i : i + 3]) / 3, i // 3) for i in range(0, len(means), 3) if sum(means[i : i + 3]) / 3 > LIMIT
    ]
    if not changed:
        return ""
    most, tile = max(changed)
    columns = -(-a.width // TILE)
    x, y = tile % columns * TILE, tile // columns * TILE
    return (
        f"{len(changed)} of its {TILE}x{TILE} px tiles changed, the most at ({x}, {y}) by {most:.0f} of 255 on average"
    )


def shoot(nb: NotebookPage, cell: int, clip_from: str | None = None) -> bytes:
    """The cell as it looks (from the top of `clip_from` when given), its volatile text made fixed first."""
    nb.cells().nth(cell).evaluate(FIX_TEXT, VOLATILE)
    nb.page.mouse.click(5, 5)  # no cell hovered or in edit mode
    if clip_from is None:
        return nb.cells().nth(cell).screenshot(animations="disabled")
    top, bottom = nb.page.locator(clip_from).bounding_box(), nb.cells().nth(cell).bounding_box()
    clip = {"x": top["x"], "y": top["y"], "width": top["width"], "height": bottom["y"] + bottom["height"] - top["y"]}
    return nb.page.screenshot(clip=clip, animations="disabled")


def take(chromium, tmp_path: Path) -> dict[str, bytes]:
    root = tmp_path / "shots"
    root.mkdir()
    write_notebook(root / "shots.ipynb", *CELLS.values())
    server = Server(FrontEnd("lab", sys.executable), root)
    pages = []
    try:
        pages.append(chromium.new_page(viewport={"width": WIDTH, "height": 1200}, device_scale_factor=1))
        nb = NotebookPage(pages[-1], server, "shots.ipynb")
        nb.fold_left_area()
        shots = {}
        for index, name in enumerate(CELLS):
            nb.run_cell(index)
            if name == "interrupt":
                nb.wait_for_output(index, "[rank 1] training, rank 1")
                nb.stop()
            nb.wait_for_output(index, WAIT_FOR[name])
            nb.wait_until_idle()
            if name == "training":  # rank 0's bar drawn full
                nb.wait(lambda i=index: any(b["width"] == "100%" for b in nb.progress_bars(i)), "the bar at 100%")
            shots[name] = shoot(nb, index)
        nb.save()
        # reopened where no kernel is offered, "No Kernel" chosen: the toolbar says so, the panel still reads
        server.shut_down_kernels()
        server.restart(kernels=False)
        pages.append(chromium.new_page(viewport={"width": WIDTH, "height": 1200}, device_scale_factor=1))
        again = NotebookPage(pages[-1], server, "shots.ipynb")
        again.fold_left_area()
        again.wait_for_output(0, WAIT_FOR["panel"])
        assert server.api("GET", "/api/kernels") == [], "the reopened notebook has a kernel"
        again.cells().nth(1).locator(".jp-InputPrompt").click()  # the panel's cell not the active one
        shots["reopened"] = shoot(again, 0, clip_from=".jp-NotebookPanel-toolbar")
        return shots
    finally:
        for page in pages:
            page.close()
        server.close()


def test_the_committed_screenshots_show_what_jupyterlab_renders(chromium, tmp_path: Path) -> None:
    shots = take(chromium, tmp_path)
    if WRITE:
        SHOTS.mkdir(parents=True, exist_ok=True)
        for name, png in shots.items():
            (SHOTS / f"{name}.png").write_bytes(png)
        return
    stale = []
    for name, png in shots.items():
        path = SHOTS / f"{name}.png"
        why = differs(path.read_bytes(), png) if path.exists() else "it is missing"
        if why:
            (tmp_path / f"{name}.png").write_bytes(png)
            stale.append(f"{path.relative_to(ROOT)}: {why} (the new one: {tmp_path / f'{name}.png'})")
    if stale:
        pytest.fail(
            "Screenshots no longer match the UI; look at the new ones and run `make screenshots`:\n" + "\n".join(stale)
        )


# --- the comparison itself, on the committed images (no browser) ---------------------------------------------------


def _image(name: str):
    from PIL import Image

    return Image.open(SHOTS / f"{name}.png").convert("RGB")


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _text_lines(image) -> list[tuple[int, int]]:
    """The rows (top, bottom) of each line of text, top to bottom: runs of rows with a dark pixel."""
    gray = image.convert("L")
    rows = [y for y in range(image.height) if gray.crop((0, y, image.width, y + 1)).getextrema()[0] < 128]
    lines: list[list[int]] = []
    for y in rows:
        if lines and y == lines[-1][1] + 1:
            lines[-1][1] = y
        else:
            lines.append([y, y])
    return [(top, bottom) for top, bottom in lines]


def _columns(image, top: int, bottom: int, gap: int = 12) -> list[tuple[int, int]]:
    """The runs (left, right) of a line's dark columns that more than `gap` px of background separate."""
    gray = image.convert("L").crop((0, top, image.width, bottom + 1))
    xs = [x for x in range(gray.width) if gray.crop((x, 0, x + 1, gray.height)).getextrema()[0] < 128]
    runs: list[list[int]] = []
    for x in xs:
        if runs and x - runs[-1][1] <= gap:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return [(left, right) for left, right in runs]


def _erase(image, box: tuple[int, int, int, int]):
    """The image with the box painted in the color just right of it (the output area's background)."""
    from PIL import ImageDraw

    erased = image.copy()
    left, top, right, bottom = box
    ImageDraw.Draw(erased).rectangle(box, fill=image.getpixel((min(right + 2, image.width - 1), top)))
    assert _png(erased) != _png(image), f"nothing to erase in {box}"
    return erased


def test_the_comparison_sees_a_line_a_box_or_a_color_gone_and_nothing_in_the_same_image() -> None:
    from PIL import Image

    panel, training, interrupt = _image("panel"), _image("training"), _image("interrupt")
    for name in ("panel", "training", "failure", "interrupt", "reopened"):
        committed = (SHOTS / f"{name}.png").read_bytes()
        assert differs(committed, committed) == "", name
        assert differs(committed, _png(_image(name))) == "", name  # decoded and encoded again

    # the panel: its input's lines, then the headline, then the first change row (mixed_precision: asked -> using)
    lines = _text_lines(panel)[len(CELLS["panel"].splitlines()) :]
    headline, change = lines[0], lines[1]
    no_headline = _erase(panel, (0, headline[0] - 1, panel.width - 3, headline[1] + 1))
    assert differs(_png(panel), _png(no_headline)), "the panel without its headline"
    _, value = _columns(panel, *change)[:2]  # the setting's name, then what changed
    no_change = _erase(panel, (value[0] - 1, change[0] - 1, value[1] + 1, change[1] + 1))
    assert differs(_png(panel), _png(no_change)), "the panel without 'asked fp16 -> using no'"

    # the interrupt: its red box (the error's background and text) painted over
    red = []
    for y in range(interrupt.height):
        for x in range(interrupt.width):
            r, g, b = interrupt.getpixel((x, y))
            if r > g + 20 and r > b + 20:
                red.append((x, y))
    assert len(red) > 1000, "the interrupt screenshot shows no red box"
    box = (min(x for x, _ in red), min(y for _, y in red), max(x for x, _ in red), max(y for _, y in red))
    assert differs(_png(interrupt), _png(_erase(interrupt, box))), "the interrupt without its red box"

    # the training: rank 0's bar turned red (tqdm's color for a bar that stopped short)
    greens = {}
    for y in range(training.height):
        for x in range(training.width):
            r, g, b = training.getpixel((x, y))
            if g > r + 40 and g > b + 40:
                greens[(r, g, b)] = greens.get((r, g, b), 0) + 1
    bar = max(greens, key=greens.get)  # the bar's fill, far more pixels than any green in the code
    assert greens[bar] > 1000, "the training screenshot shows no green bar"
    pixels = bytearray(training.tobytes())
    for i in range(0, len(pixels), 3):
        if tuple(pixels[i : i + 3]) == bar:
            pixels[i : i + 3] = bytes((211, 47, 47))
    recolored = Image.frombytes("RGB", training.size, bytes(pixels))
    assert differs(_png(training), _png(recolored)), "the training with a red bar"


def test_volatile_text_is_made_fixed_and_the_rest_is_kept() -> None:
    assert fix_volatile("50/50 [00:01<00:00, 48.82it/s]") == fix_volatile("50/50 [00:02<00:00, 23.10it/s]")
    assert fix_volatile("3/50 [00:04<01:10, 1.52s/it]") == "3/50 [00:01<00:00, 50.00s/it]"
    assert fix_volatile("took 3.4 s, then 12.25 s") == "took 1.0 s, then 1.0 s"
    assert fix_volatile("rank 1 (pid 81234) on 127.0.0.1:41237, port 29517") == (
        "rank 1 (pid 4242) on 127.0.0.1:29500, port 29500"
    )
    assert fix_volatile("in /tmp/accel_magic-k2j3/results at 2026-03-04 17:05:09,123") == (
        "in /tmp/accel_magic at 2026-01-01 12:00:00"
    )
    kept = (
        "accel_train: 2 processes on cpu (gloo, gradients in shared memory), 1 thread each; collective timeout 900 s\n"
        "[rank 1] rank 1: trained on its shard\nLaunchError: rank 1 raised ValueError: rank 1 got a bad batch\n"
        "CPU · gloo · 2 ranks × 1 thread · accelerate 1.16\n  Cell line 3, in <module>\n"
        "KeyboardInterrupt: the 2 ranks were stopped (rank 0 was at cell line 5)"
    )
    assert fix_volatile(kept) == kept
