"""scripts/own_network.py, which gives each stack's test run a network of its own so two runs side by side never
meet on a port: a command run through it has a loopback that works and that no port of the machine's reaches."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "own_network.py"
# Binds the port given on 127.0.0.1 and ::1 (the launches' loopback addresses), connects to it, says "alone".
PROBE = """import socket, sys
port = int(sys.argv[1])
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
    with socket.socket(family) as server, socket.socket(family) as client:
        server.bind((host, port))
        server.listen()
        client.connect((host, port))
print("alone")
"""


def own_network_here() -> str:
    check = subprocess.run([sys.executable, SCRIPT, "--check"], capture_output=True, text=True)
    return "" if check.returncode == 0 else check.stderr.strip()


def test_a_command_gets_a_loopback_of_its_own_where_the_machine_allows_it() -> None:
    why = own_network_here()
    if why:
        pytest.skip(f"this machine gives a process no network namespace ({why}); the stacks run one at a time")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = subprocess.run(
            [sys.executable, SCRIPT, sys.executable, "-c", PROBE, str(port)], capture_output=True, text=True
        )
        assert (ran.returncode, ran.stdout) == (0, "alone\n"), ran.stderr
        outside = subprocess.run([sys.executable, "-c", PROBE, str(port)], capture_output=True, text=True)
        assert "Address already in use" in outside.stderr  # the probe can fail: the port is the machine's here


def test_the_command_runs_and_its_exit_status_is_kept_whether_or_not_it_got_a_network() -> None:
    ran = subprocess.run([sys.executable, SCRIPT, sys.executable, "-c", "raise SystemExit(3)"])
    assert ran.returncode == 3
    assert subprocess.run([sys.executable, SCRIPT], capture_output=True).returncode == 2
