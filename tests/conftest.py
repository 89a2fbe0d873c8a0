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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for layer in LAYERS:
            if f"/tests/{layer}/" in str(item.path):
                item.add_marker(getattr(pytest.mark, layer))
