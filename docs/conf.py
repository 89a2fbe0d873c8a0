"""Sphinx configuration of the documentation site (`make docs`, scripts/build_docs.py): MyST Markdown pages, the
notebooks rendered with the outputs the kernel layer gave them (never executed here), and an API reference from
the docstrings."""

from __future__ import annotations

import accel_magic

project = "accel_magic"
release = version = accel_magic.__version__
extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
nitpicky = True  # every cross-reference must resolve
smartquotes = False  # "--strict" stays two hyphens, as typed, not a dash
nitpick_ignore_regex = [
    ("py:class", r"(torch|accelerate|ipywidgets|IPython|typing|collections)\..*"),
    ("py:class", r"accel_magic\.errors\.KeyboardInterrupt"),  # LaunchInterrupted's base, as notebooks name it
]
suppress_warnings = ["myst.header"]  # a notebook's title may follow its install cell

# The notebooks come executed (build/notebooks, by tests/kernel/test_notebooks.py or build_docs.py).
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_typehints_description_target = "documented"

html_theme = "pydata_sphinx_theme"
html_title = "accel_magic"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_static_path: list[str] = []
