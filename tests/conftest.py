"""Markers follow the folder: unit (pure), shell (InteractiveShell), kernel (real ipykernel)."""

from __future__ import annotations

import pytest

LAYERS = ("unit", "shell", "kernel", "binder", "browser")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for layer in LAYERS:
            if f"/tests/{layer}/" in str(item.path):
                item.add_marker(getattr(pytest.mark, layer))
