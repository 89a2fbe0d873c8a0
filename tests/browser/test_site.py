"""The documentation site as `make docs` builds it (warnings as errors, links checked), served on 127.0.0.1 and
opened in Chromium: every page loads with everything it asks of the site, no image is broken, and the panel's
screenshot and the quick start's loss curve show. It runs after the kernel layer (tests/conftest.py), whose
notebook test leaves the executed notebooks the site renders."""

from __future__ import annotations

import functools
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SITE = ROOT / "build" / "docs"

# Every image of the page, loaded now (the theme may mark some lazy): the ones that did not decode, by address.
BROKEN_IMAGES = """async () => {
    const broken = [];
    for (const img of document.images) {
        img.loading = "eager";
        try { await img.decode(); } catch (e) { broken.push(img.src); continue; }
        if (!img.naturalWidth) broken.push(img.src);
    }
    return broken;
}"""


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    """`make docs` run now, the site it built served on a free port of 127.0.0.1; its address."""
    built = subprocess.run(["make", "-s", "docs"], cwd=ROOT, capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(SITE)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def site_pages() -> list[str]:
    return [p.relative_to(SITE).as_posix() for p in sorted(SITE.rglob("*.html")) if "_static" not in p.parts]


def test_every_page_of_the_site_loads_with_its_images_and_the_panel_and_a_plot_show(site, chromium) -> None:
    page = chromium.new_page(viewport={"width": 1280, "height": 900})
    failed: list[str] = []
    page.on("requestfailed", lambda request: failed.append(f"{request.url} ({request.failure})"))
    page.on(
        "response", lambda response: response.status >= 400 and failed.append(f"{response.url} ({response.status})")
    )
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    pages = site_pages()
    expected = {"index.html", "setup.html", "training.html", "failures.html", "background.html", "launchers.html",
                "leaving.html", "cpu.html", "gpus.html", "troubleshooting.html", "api.html", "notebooks.html",
                "notebooks/01_quickstart.html", "notebooks/05_pytorch_ddp.html"}  # fmt: skip
    assert expected <= set(pages), sorted(expected - set(pages))
    try:
        for name in pages:
            response = page.goto(f"{site}/{name}", wait_until="load")
            assert response is not None and response.ok, name
            assert page.evaluate(BROKEN_IMAGES) == [], name
            assert page.locator("h1").first.inner_text().strip(), name  # a page with a title, not an empty shell
        assert not failed, failed
        assert not errors, errors

        page.goto(f"{site}/index.html")
        panel = page.locator("img[src*='panel']").first
        panel.scroll_into_view_if_needed()
        assert panel.evaluate("img => img.naturalWidth") > 400 and panel.bounding_box()["width"] > 300

        page.goto(f"{site}/notebooks/01_quickstart.html")
        assert "test accuracy" in page.locator("main").inner_text()
        plot = page.locator(".cell_output img").first  # the loss curve, as the notebook's kernel drew it
        plot.scroll_into_view_if_needed()
        assert plot.evaluate("img => img.naturalWidth") > 200 and plot.bounding_box()["height"] > 100
    finally:
        page.close()
