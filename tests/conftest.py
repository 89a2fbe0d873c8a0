"""Markers follow the folder: unit (pure), ranks (forked ranks of real process groups, no IPython), shell
(InteractiveShell), kernel (real ipykernel)."""

from __future__ import annotations

import pytest

VERSIONS = (
    "torch",
    "accelerate",
    "ipython",
    "ipykernel",
    "ipywidgets",
    "traitlets",
    "jupyter_client",
    "nbclient",
    "tqdm",
)


def pytest_report_header() -> str:
    """Which stack this run tests (the README's test command runs three)."""
    import platform
    from importlib import metadata

    found = []
    for name in VERSIONS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} -")
    return f"stack: python {platform.python_version()}, " + ", ".join(found)


LAYERS = ("unit", "ranks", "shell", "kernel", "binder", "browser")


# The documentation site shows the notebooks as the kernel layer executed them: its test runs after that layer.
LAST = "tests/browser/test_site.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for layer in LAYERS:
            if f"/tests/{layer}/" in str(item.path):
                item.add_marker(getattr(pytest.mark, layer))
    items.sort(key=lambda item: str(item.path).endswith(LAST))  # stable: every other test keeps its place


def two_ranks_stopped(line: str, at: str = "cell line {}", starting: bool = False) -> str:
    """A regular expression of the line an interrupt of 2 ranks ends with, rank 0 at `line` (a pattern): each
    rank's place, rank 1's wherever it was (or nowhere yet), and both together when they were at the same place.
    `starting`: the interrupt may come as the ranks start, when rank 1 may be in the cell and rank 0 not yet."""
    rank_0, rank_1 = at.format(line), at.format(r"\d+")
    places = rf"ranks 0 and 1 were at {rank_0}|rank 0 was at {rank_0}(, rank 1 at {rank_1})?"
    if starting:
        places += f"|rank 1 was at {rank_1}"
    return rf"the 2 ranks were stopped \(({places})\)"


@pytest.fixture(name="two_ranks_stopped")
def two_ranks_stopped_fixture():
    """`two_ranks_stopped` for the kernel and browser layers' interrupt tests."""
    return two_ranks_stopped
