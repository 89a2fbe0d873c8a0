"""accel_magic: `%accel_setup` and `%%accel_train` make accelerate work in any notebook runtime, and
`notebook_launcher` is accelerate's, run by the same launcher.

Importing this package or loading the extension imports none of torch, accelerate or ipywidgets.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load_ipython_extension", "unload_ipython_extension", "notebook_launcher"]

# torch.cuda.is_available() asks NVML instead of initializing CUDA (which poisons every later fork).
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _show_with_hint(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: int | None = None) -> None:
    """Show a ValueError as IPython would; accelerate's refusal to launch becomes one sentence saying what to
    do."""
    from .errors import error_line
    from .launcher import launcher_refusal_hint

    hint = launcher_refusal_hint(value)
    if hint is not None:
        value.args = (hint,)
        value._render_traceback_ = lambda: [error_line(etype.__name__, hint)]  # type: ignore[attr-defined]
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)


def load_ipython_extension(ipython: Any) -> None:
    from . import spawn
    from .launch import forks  # noqa: F401  (every fork in the kernel waits for its output streams from here on)
    from .magics import AccelMagics
    from .session import current

    session = current()
    if NVML_CHECK not in os.environ:
        os.environ[NVML_CHECK] = "1"
        session.env_set.add(NVML_CHECK)
    ipython.register_magics(AccelMagics)
    spawn.hook(ipython)  # torch's spawn of a notebook function runs through the launcher
    if not ipython.custom_exceptions:  # another extension's handler is left alone
        ipython.set_custom_exc((ValueError,), _show_with_hint)
        session.hint_shell = ipython


def unload_ipython_extension(ipython: Any) -> None:
    """Remove exactly what load_ipython_extension added, and forget the kernel's session."""
    from .session import drop

    manager = ipython.magics_manager
    instance = manager.registry.pop("AccelMagics", None)
    jobs = sys.modules.get(f"{__name__}.jobs")
    if jobs is not None:
        jobs.stop_jobs()
    for kind, names in (("line", ("accel_setup", "accel_export", "accel_wait")), ("cell", ("accel_train",))):
        for name in names:
            manager.magics[kind].pop(name, None)
    if instance is not None and instance in ipython.configurables:
        ipython.configurables.remove(instance)
    spawn = sys.modules.get(f"{__name__}.spawn")
    if spawn is not None:
        spawn.unhook()
    session = drop()
    if session is not None and session.hint_shell is ipython and ipython.custom_exceptions == (ValueError,):
        ipython.set_custom_exc((), None)  # IPython's default
    launcher = sys.modules.get(f"{__name__}.launcher")
    if launcher is not None:
        launcher.restore_accelerate_launcher()
    elastic = sys.modules.get(f"{__name__}.launch.elastic")
    if elastic is not None:
        elastic.shutdown_agent_thread()
    for key in session.env_set if session is not None else ():
        os.environ.pop(key, None)


def __getattr__(name: str) -> Any:
    """`from accel_magic import notebook_launcher` imports the launcher only when asked for."""
    if name == "notebook_launcher":
        from .launcher import notebook_launcher

        return notebook_launcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
