"""The screenshots in docs/screenshots (shown in the README) are what JupyterLab renders today: the panel, a
training cell with its bar and rank output, a failure and an interrupt. `make screenshots` takes them anew;
this test takes them again and fails when a committed one differs in a way a person would notice."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
from frontends import ROOT, FrontEnd, NotebookPage, Server, write_notebook

SHOTS = ROOT / "docs" / "screenshots"
WRITE = os.environ.get("ACCEL_MAGIC_SCREENSHOTS") == "write"  # set by `make screenshots`
WIDTH = 960  # the window; the notebook fills it, about as wide as the README shows it

CELLS = {
    "panel": "%load_ext accel_magic\n%accel_setup -n 2 --mixed-precision fp16",
    "training": """\
%%accel_train -n 2
from tqdm.auto import tqdm
import time
for step in tqdm(range(50), disable=accelerator.process_index != 0):
    time.sleep(0.02)
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


def differs(old: bytes, new: bytes) -> str:
    """Why a person would see the two images as different ("" when they would not): another size, or more than
    2% of the pixels changed visibly (timings and versions in the text change far fewer)."""
    from PIL import Image, ImageChops

    a, b = Image.open(io.BytesIO(old)).convert("L"), Image.open(io.BytesIO(new)).convert("L")
    if abs(a.width - b.width) > 4 or abs(a.height - b.height) > 0.05 * a.height + 4:
        return f"its size changed from {a.width}x{a.height} to {b.width}x{b.height}"
    b = b.resize(a.size)
    changed = sum(ImageChops.difference(a, b).point(lambda v: 255 if v > 64 else 0).histogram()[255:])
    share = changed / (a.width * a.height)
    return f"{share:.1%} of its pixels changed" if share > 0.02 else ""


def take(chromium, tmp_path: Path) -> dict[str, bytes]:
    root = tmp_path / "shots"
    root.mkdir()
    write_notebook(root / "shots.ipynb", *CELLS.values())
    server = Server(FrontEnd("lab", sys.executable), root)
    page = chromium.new_page(viewport={"width": WIDTH, "height": 1200}, device_scale_factor=1)
    try:
        nb = NotebookPage(page, server, "shots.ipynb")
        page.keyboard.press("Control+b")  # the file browser folded away: the notebook as wide as the window
        shots = {}
        for index, name in enumerate(CELLS):
            nb.run_cell(index)
            if name == "interrupt":
                nb.wait_for_output(index, "[rank 1] training, rank 1")
                nb.stop()
            nb.wait_for_output(index, WAIT_FOR[name])
            nb.wait_until_idle()
            page.mouse.click(5, 5)  # no cell hovered or in edit mode
            shots[name] = nb.cells().nth(index).screenshot(animations="disabled")
        return shots
    finally:
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
