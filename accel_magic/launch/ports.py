"""Ports: whether one is free on an address now, and the rendezvous socket bound at once so nothing takes it."""

from __future__ import annotations

import socket

__all__ = ["check_port", "listener"]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_port(port: int, host: str = "127.0.0.1") -> bool:
    """True when the port can be bound on `host` now."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def listener(port: int | None, host: str = "127.0.0.1") -> socket.socket:
    """The rendezvous socket, bound now to `host` alone (port None: a free one), so no other launch or program
    can take the port between choosing and using it."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.bind((host, port or 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
