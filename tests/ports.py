"""A free TCP port for a test to give a listener, from below the range the system hands out for port 0.

A kernel's ports (and every other port a program asks the system for) come from that ephemeral range, chosen
a moment before the kernel binds them: a test port taken from the same range could be the one a kernel starting
beside the test is about to bind, and a rank would then meet that kernel's socket instead of its rendezvous."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now and that the system does not hand out for port 0."""
    top = _ephemeral_start()
    for port in random.sample(range(max(top - 12000, 1024), top), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {top} on 127.0.0.1")
