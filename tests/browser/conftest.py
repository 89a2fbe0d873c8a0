"""Fixtures of the browser layer: one headless Chromium for the session, and a Jupyter server per test."""

from __future__ import annotations

from pathlib import Path

import pytest
from frontends import COLAB_PYTHON, FrontEnd, NotebookPage, Server, chromium_path, front_ends


@pytest.fixture(scope="session")
def chromium():
    from playwright.sync_api import sync_playwright

    path = chromium_path()
    if path is None:
        pytest.fail(
            "Debian's chromium is not installed: run `make test`, which installs it, or apt-get install chromium."
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(params=front_ends(), ids=lambda f: f.name)
def front(request: pytest.FixtureRequest) -> FrontEnd:
    if request.param.classic and not COLAB_PYTHON.exists():
        pytest.fail("classic Notebook runs from Colab's environment: build it with `make envs` (make test does).")
    return request.param


@pytest.fixture
def theme() -> str:
    """JupyterLab's and Notebook 7's theme (classic Notebook has only its own); a test parametrizes it."""
    return "JupyterLab Light"


@pytest.fixture
def server(front: FrontEnd, theme: str, tmp_path: Path):
    root = tmp_path / "notebooks"
    root.mkdir()
    server = Server(front, root, theme=theme)
    yield server
    server.close()


@pytest.fixture
def open_notebook(chromium, server: Server):
    """Open a notebook of the server's folder in a fresh page, 1280 x 900."""
    pages = []

    def open_(name: str, width: int = 1280) -> NotebookPage:
        page = chromium.new_page(viewport={"width": width, "height": 900})
        pages.append(page)
        return NotebookPage(page, server, name)

    yield open_
    for page in pages:
        page.close()
