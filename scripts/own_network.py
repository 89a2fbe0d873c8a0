"""own_network.py COMMAND [ARG ...]: run COMMAND in a network namespace of its own, its loopback up, so that two
test runs side by side never meet on a port (the default rendezvous port 29500, the DDP tutorial's 12355, a port
one run found free and the other took meanwhile). Where the machine gives a process no network of its own (not
root, no namespaces), COMMAND runs as it is.

own_network.py --check: exit status 0 where it can, else 1 with the reason on stderr (the Makefile then runs the
stacks one at a time).

Standard library only, for any Python 3 (it runs before the environments are used): unshare(2) through libc, the
loopback's flags through the SIOCGIFFLAGS/SIOCSIFFLAGS ioctls (linux/sockios.h), as `ip link set lo up` does."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

CLONE_NEWNET = 0x40000000  # linux/sched.h
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
IFREQ = "16sH14x"  # struct ifreq: the interface's name, then ifr_flags (a short) in a 24-byte union


def own_network() -> str:
    """Move this process into a network namespace of its own with its loopback up; '' when done, else why not."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux's ({sys.platform} here)"
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        before = os.open("/proc/self/ns/net", os.O_RDONLY)
    except OSError as err:
        return f"no network namespace to leave: {err}"
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            return f"unshare(CLONE_NEWNET) failed: {os.strerror(ctypes.get_errno())}"
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                asked = struct.pack(IFREQ, b"lo", 0)
                flags = struct.unpack(IFREQ, fcntl.ioctl(sock, SIOCGIFFLAGS, asked))[1]
                fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))
        except OSError as err:
            libc.setns(before, CLONE_NEWNET)  # back to the machine's network: a namespace without loopback is none
            return f"the loopback of a new network namespace stays down: {err}"
        return ""
    finally:
        os.close(before)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write(__doc__ or "")
        return 2
    why = own_network()
    if argv == ["--check"]:
        if why:
            sys.stderr.write(f"no network of its own for a test run: {why}\n")
        return 1 if why else 0
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
