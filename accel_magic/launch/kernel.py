"""The kernel as a launch found it: whatever torch's elastic agent changes in it (environment, signal handlers,
loggers) is put back afterwards."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

__all__ = ["kernel_state_kept"]

SIGNALS_KEPT = [s for s in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGINT") if hasattr(signal, s)]
ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.distributed.run",
    "torch.multiprocessing",
)
AGENT_ENV = "TORCHELASTIC_"  # what the elastic agent sets in the kernel's environment


@contextlib.contextmanager
def kernel_state_kept(all_env: bool = True) -> Iterator[None]:
    """Whatever torch's elastic agent changes in the kernel (environment, signal handlers, loggers) is put
    back as it was. With `all_env` False (a launch in the background, while the notebook's cells may change the
    environment), only the agent's own TORCHELASTIC_ variables are."""
    env = {k: v for k, v in os.environ.items() if all_env or k.startswith(AGENT_ENV)}
    handlers = {name: signal.getsignal(getattr(signal, name)) for name in SIGNALS_KEPT}
    levels = {name: logging.getLogger(name).level for name in ELASTIC_LOGGERS}
    for name in ELASTIC_LOGGERS:  # its error wall would repeat what the launch reports in one traceback
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for key in set(os.environ) - set(env):
            if all_env or key.startswith(AGENT_ENV):
                del os.environ[key]
        for key, value in env.items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        if threading.current_thread() is threading.main_thread():
            for name, handler in handlers.items():
                if handler is not None and signal.getsignal(getattr(signal, name)) is not handler:
                    signal.signal(getattr(signal, name), handler)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
