"""The launch package's pieces that need no kernel: ports, the launch config, root-cause ordering, fork checks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import accel_magic
from accel_magic.launch import elastic, rank
from accel_magic.launch.outcome import LaunchOutcome, RankFailure
from accel_magic.launch.ports import check_port, listener
from accel_magic.plan import Request, make_plan
from accel_magic.runtime import GPU, Runtime
from accel_magic.train import PRELOAD, describe, launch_error

REPO = Path(accel_magic.__file__).resolve().parents[1]


def test_the_rendezvous_socket_is_a_fresh_port_on_loopback_and_check_port_sees_it_taken() -> None:
    with listener(None) as sock:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port != 29500
        assert not check_port(port)
    assert check_port(port)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError):
            listener(other.getsockname()[1])


def test_launch_config_never_asks_cuda_and_logs_in_the_private_dir(tmp_path: Path, monkeypatch) -> None:
    import torch

    def poisoned(*args, **kwargs):
        raise AssertionError("LaunchConfig asked CUDA in the kernel")

    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    monkeypatch.setattr(torch.cuda, "device_count", poisoned)
    before = set(Path("/tmp").glob("torchelastic_*"))
    config = elastic.launch_config(2, 29999, str(tmp_path / "logs"), 0.05, None)
    assert config.start_method == "fork" and config.max_restarts == 0
    assert config.rdzv_endpoint.startswith("127.0.0.1:")
    assert getattr(config, "numa_options", None) is None
    assert set(Path("/tmp").glob("torchelastic_*")) == before


def test_across_machines_the_rendezvous_waits_the_whole_seconds_of_the_timeout_never_less(tmp_path: Path) -> None:
    nodes = elastic.Nodes(2, 1, "10.0.0.5", timeout=2.5)
    config = elastic.launch_config(1, 29999, str(tmp_path / "logs"), 0.05, None, nodes)
    assert nodes.wait == 3 and config.rdzv_configs["timeout"] == 3 and config.rdzv_configs["rank"] == 1
    assert config.rdzv_endpoint == "10.0.0.5:29999" and config.min_nodes == config.max_nodes == 2
    assert elastic.Nodes(2, 0, timeout=7).wait == 7 and elastic.Nodes(2, 0, timeout=0.2).wait == 1


FORK_CHECK = """
import json, sys
import psutil, torch
from accel_magic.launch import forks as guard
exec(sys.argv[1])  # what the kernel asked torch before the check
answer = guard.cuda_fork_blocker()
children = [p.pid for p in psutil.Process().children(recursive=True)]
print(json.dumps({"answer": answer, "children": children, "initialized": torch.cuda.is_initialized()}))
"""


def fork_check_in_child(asked_first: str) -> dict:
    """`cuda_fork_blocker()`'s answer in a fresh Python that imported torch and ran `asked_first`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    done = subprocess.run(
        [sys.executable, "-c", FORK_CHECK, asked_first],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cuda_fork_check_answers_none_where_cuda_was_never_touched_and_leaves_no_child() -> None:
    found = fork_check_in_child("pass")
    assert found == {"answer": None, "children": [], "initialized": False}


def test_cuda_fork_check_sees_a_fork_poisoned_without_cuda_being_initialized() -> None:
    import torch

    if torch.version.cuda is None:
        pytest.skip(
            f"torch {torch.__version__} is a CPU build, which cannot poison fork; "
            "this runs under a CUDA build of torch (e.g. the colab test environment)"
        )
    # Without PYTORCH_NVML_BASED_CUDA_CHECK, device_count() asks the CUDA runtime (on a machine without a GPU,
    # or without NVML, too), which poisons every later fork while CUDA itself stays uninitialized.
    found = fork_check_in_child("torch.cuda.device_count()")
    assert found["initialized"] is False
    assert found["answer"] is not None
    assert found["answer"].startswith("this kernel asked CUDA something that poisons fork")
    assert found["children"] == []


def outcome(*failures: RankFailure, n: int = 2) -> LaunchOutcome:
    return LaunchOutcome(n, exitcodes={f.rank: f.exitcode for f in failures}, failures=list(failures))


ROOTS = [
    (
        "the raising rank, not the peer that lost its connection first",
        [
            RankFailure(0, 1, "collateral", "RuntimeError: Connection closed by peer", when=1.0),
            RankFailure(1, 1, "exception", "ValueError: x", when=1.2),
        ],
        1,
    ),
    (
        "the earlier of two raising ranks",
        [RankFailure(0, 1, "exception", "A", when=2.0), RankFailure(1, 1, "exception", "B", when=1.0)],
        1,
    ),
    (
        "a killed rank before the collateral error it caused",
        [
            RankFailure(0, 1, "collateral", "Connection reset by peer", when=1.0),
            RankFailure(1, -9, "signal", "was killed by SIGKILL"),
        ],
        1,
    ),
    (
        "a raising rank before the rank the agent stopped",
        [RankFailure(0, -15, "signal", "was killed by SIGTERM"), RankFailure(1, 1, "exception", "E", when=5.0)],
        1,
    ),
    (
        "a timeout before collateral errors",
        [RankFailure(0, 1, "timeout", "Timed out", when=3.0), RankFailure(1, 1, "collateral", "closed", when=2.0)],
        0,
    ),
]


@pytest.mark.parametrize(("failures", "root"), [r[1:] for r in ROOTS], ids=[r[0] for r in ROOTS])
def test_root_cause(failures: list[RankFailure], root: int) -> None:
    found = outcome(*failures).root_cause()
    assert found is not None and found.rank == root


def test_launch_error_is_one_headline_plus_the_rank_traceback() -> None:
    tb = "Traceback (most recent call last):\n  Cell line 3, in <module>\n    raise ValueError('x')\nValueError: x\n"
    err = launch_error(outcome(RankFailure(1, 1, "exception", "ValueError: x", tb, 1.0)), 900)
    assert str(err) == "rank 1 raised ValueError: x; the other ranks were stopped."
    rendered = err._render_traceback_()
    assert rendered[0].endswith("rank 1 raised ValueError: x; the other ranks were stopped.")
    assert "  Cell line 3, in <module>" in rendered and err.__cause__ is None and err.__context__ is None


def test_launch_error_for_a_timeout_names_the_option() -> None:
    err = launch_error(outcome(RankFailure(0, 1, "timeout", "RuntimeError: Timed out waiting 3000ms", when=1.0)), 3)
    assert str(err).startswith("rank 0: a collective waited more than 3 s (--timeout)")


def test_first_line_drops_gloo_source_prefix() -> None:
    err = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. "
        "This is typically caused by a remote worker crashing."
    )
    assert rank.first_line(err) == "Connection closed by peer [127.0.0.1]:1."
    assert rank.classify(err) == "collateral"


def test_a_users_own_timeout_error_is_an_ordinary_exception() -> None:
    assert rank.classify(TimeoutError("timed out waiting for the lock")) == "exception"
    assert rank.classify(RuntimeError("[x.cc:1] Timed out waiting 3000ms for recv operation to complete")) == "timeout"


def test_a_rank_turns_the_first_sigint_into_a_keyboardinterrupt_at_the_cell_line_and_ignores_a_second() -> None:
    import linecache
    import signal
    import time

    source = "import os, signal, time\nwhile True:\n    time.sleep(0.01)\n"
    linecache.cache["<cell under test>"] = (len(source), None, source.splitlines(True), "<cell under test>")
    saved = signal.signal(signal.SIGINT, rank.interrupt_once)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # SIGALRM -> SIGINT, as the front end sends it
            signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
            exec(compile(source, "<cell under test>", "exec"), {})
        os.kill(os.getpid(), signal.SIGINT)  # the kernel's SIGINT after the front end's: no second exception
        time.sleep(0.05)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, saved)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        del linecache.cache["<cell under test>"]
    tb = rank.cell_traceback(caught.value, "<cell under test>")
    assert re.search(r"Cell line [23], in <module>", tb) and "interrupt_once" not in tb and "rank.py" not in tb


@pytest.mark.parametrize("printed", ["KeyboardInterrupt", "ValueError, an interrupt coming meanwhile"])
def test_an_interrupt_python_could_only_print_comes_again_a_moment_later_where_the_rank_runs(
    monkeypatch, printed: str
) -> None:
    """Python prints an exception raised in a finalizer, or in sys.unraisablehook itself, and goes on: a rank's
    interrupt that went there (the first case: in a finalizer; the second: while the hook printed another
    finalizer's error) is raised again a moment after the hook returned."""
    import signal
    import time
    from types import SimpleNamespace

    seen = []

    def prints(unraisable: Any) -> None:  # Python's own hook, with the interrupt coming while it prints
        os.kill(os.getpid(), signal.SIGINT)
        seen.append(type(unraisable.exc_value).__name__)

    monkeypatch.setattr(sys, "__unraisablehook__", prints)
    saved = signal.signal(signal.SIGINT, rank.interrupt_once)
    returned = False
    try:
        with pytest.raises(KeyboardInterrupt):
            if printed == "KeyboardInterrupt":
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # as interrupt_once left it, raising in the finalizer
                rank._unraisablehook(SimpleNamespace(exc_value=KeyboardInterrupt()))
            else:
                rank._unraisablehook(SimpleNamespace(exc_value=ValueError("in a finalizer")))
            returned = True
            time.sleep(5)
        assert returned and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert seen == ([] if printed == "KeyboardInterrupt" else ["ValueError"])
    finally:
        signal.signal(signal.SIGINT, saved)


def test_the_kernels_interrupts_are_counted_while_held_and_raised_again_after() -> None:
    import signal
    import time

    from accel_magic.launch.interrupts import Interrupts

    # a kernel's own handler, whatever started these tests (a shell's background job starts with SIGINT ignored)
    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        held = Interrupts.hold()
        try:
            assert Interrupts.hold() is held  # a hold within a hold is the same one
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # not raised
            assert held.count == 1 and held.stop.is_set() and not held.again.is_set()
            held.release()
            assert signal.getsignal(signal.SIGINT) is held  # the outer hold is still in place
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert held.count == 2 and held.again.is_set()
        finally:
            held.release()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGINT, outside)


def test_stop_kills_a_process_that_ignores_sigterm_at_once_when_hurried() -> None:
    import threading
    import time

    import psutil

    from accel_magic.launch.processes import stop

    code = "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(flush=True)\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"\n"  # SIGTERM is ignored from here on
    hurry = threading.Event()
    threading.Timer(0.3, hurry.set).start()
    started = time.monotonic()
    proc = psutil.Process(child.pid)
    stop([proc], grace=30, hurry=hurry)
    assert time.monotonic() - started < 10  # not the 30 s grace
    assert proc.returncode == -9 and not psutil.pid_exists(child.pid)  # killed, and reaped


class _Relay:
    """A TCP relay in front of node 0's store that can hold back what the node sends, for as long as a test likes:
    the node's store call then stays in flight, whatever the machine's load."""

    def __init__(self, port: int) -> None:
        import threading

        self.port_behind = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.holding, self.arrived, self.released = threading.Event(), threading.Event(), threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                node, _ = self.listener.accept()
            except OSError:  # closed
                return
            store = socket.create_connection(("127.0.0.1", self.port_behind))
            threading.Thread(target=self._pipe, args=(node, store, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(store, node, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_node: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if from_node and self.holding.is_set():
                    self.arrived.set()
                    self.released.wait(30)
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def test_a_fork_waits_for_a_store_call_of_the_kernel_in_flight() -> None:
    """Across machines the kernel talks to the others' store while its agent still forks ranks; a rank forked in
    the middle of a store call would inherit the C++ locks the call holds. Node 0's store is a real TCP store; a
    relay in front of it holds back a `poll`'s request for a second, and this process forks while it waits."""
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from accel_magic.launch.elastic import Nodes
    from accel_magic.launch.peers import Peers

    served = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    relay = _Relay(served.port)
    try:
        peers = Peers(Nodes(count=2, rank=1), relay.port, "fork-test")
        peers.join()
        assert peers.store is not None and not peers.failure
        relay.holding.set()
        polled = threading.Thread(target=peers.poll)
        polled.start()
        assert relay.arrived.wait(30), "the poll never reached node 0's store"
        in_flight = time.monotonic()
        threading.Timer(1.0, relay.released.set).start()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        forked = time.monotonic() - in_flight
        os.waitpid(pid, 0)
        polled.join(30)
        assert not polled.is_alive() and not peers.failure
        assert forked >= 1.0, f"the fork went ahead {forked:.2f} s in, while the store call was in flight"
        relay.holding.clear()
        peers.close()
    finally:
        relay.released.set()
        relay.listener.close()


def test_the_ranks_preload_is_what_ddp_imports_on_cpu_and_nothing_where_a_gpu_is_seen() -> None:
    cpu = make_plan(Runtime(cpu_count=4, cpu_budget=4), Request(num_processes=2))
    gpus = Runtime(
        cpu_count=4, cpu_budget=4, gpus=(GPU(0, "Tesla T4", 15360, (7, 5)), GPU(1, "Tesla T4", 15360, (7, 5)))
    )
    on_gpus = make_plan(gpus, Request(num_processes=2))
    in_kernel = make_plan(Runtime(cpu_count=4, cpu_budget=4), Request(num_processes=1))
    assert (cpu.launch, on_gpus.launch, on_gpus.device, in_kernel.launch) == ("fork", "fork", "cuda", "kernel")
    body: Any = None  # what the ranks run plays no part here
    assert describe(body, cpu, filename="", port=None).ranks.preload == PRELOAD
    assert "torch._dynamo" in PRELOAD
    assert describe(body, on_gpus, filename="", port=None).ranks.preload == ()
    assert describe(body, in_kernel, filename="", port=None).ranks.preload == ()


def test_across_machines_a_ranks_own_failure_is_told_to_the_others_though_its_end_was_not_seen() -> None:
    """The agent may reap a failed rank and end the launch before the kernel's thread looks at the rank's end:
    the failure it recorded is still told to the other nodes through node 0's store (a real TCP store)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from accel_magic.launch import _exchange
    from accel_magic.launch.elastic import Nodes
    from accel_magic.launch.peers import Peers
    from accel_magic.launch.relay import Pipes, Relay
    from accel_magic.launch.workdir import Workdir

    served = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    pipes, workdir = Pipes.open(1), Workdir()
    relay = Relay(pipes, lambda *_: None, lambda _: None, first_rank=1)
    try:
        peers = Peers(Nodes(count=2, rank=1), served.port, "tell-test")
        relay.started[1] = os.getpid()  # it said hello; its end was never seen
        _exchange(peers, relay, workdir, list, None)
        assert not peers.told  # still running, no failure recorded
        workdir.write("error", 1, RankFailure(1, 1, "exception", "ValueError: bad batch", when=1.0))
        _exchange(peers, relay, workdir, list, None)
        assert peers.told and served.get(peers.key) == b"rank 1: ValueError: bad batch"
        peers.close()
    finally:
        relay.close()
        pipes.close()
        workdir.remove()
