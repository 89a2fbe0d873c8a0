"""The shell layer's shell: IPython's test shell with accel_magic loaded, left as each test found it."""

from __future__ import annotations

import pytest
from IPython import get_ipython
from IPython.testing.globalipapp import start_ipython

start_ipython()  # the test shell: a TerminalInteractiveShell that IPython's own tests use


@pytest.fixture
def ip():
    shell = get_ipython()
    before = set(shell.user_ns)
    shell.run_line_magic("load_ext", "accel_magic")
    yield shell
    shell.run_line_magic("unload_ext", "accel_magic")
    for name in set(shell.user_ns) - before:
        del shell.user_ns[name]
