"""Every rank's output to callbacks in the kernel: fds 1 and 2 assembled into whole lines, and rank 0's kernel
messages (displays, widgets) framed through a pipe and published on the kernel's IOPub.

Private APIs of ipykernel, used here only:
- `kernel.session.send(stream, msg_or_type, ...)` and `kernel.iopub_socket` (ipykernel 4 and later): in a rank
  the session's `send` is replaced so rank 0's messages go into its pipe (a forked child's sends are dropped by
  the session's fork check); in the kernel they publish what arrives. Fallback: without a kernel (terminal
  IPython) a rank's displays are dropped and its printed text still arrives.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import pickle
import selectors
import struct
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Pipes", "frame", "Frames", "RankLines", "Relay", "capture_kernel_messages", "publish_kernel_message"]

_HEADER = struct.Struct("!I")


@dataclass
class Pipes:
    """Per rank, (read end, write end) of its stdout, its stderr, and its message pipe: a hello with its pid,
    and on rank 0 its kernel messages."""

    out: list[tuple[int, int]]
    err: list[tuple[int, int]]
    msg: list[tuple[int, int]]

    @classmethod
    def open(cls, nprocs: int) -> Pipes:
        return cls(*([os.pipe() for _ in range(nprocs)] for _ in range(3)))

    def all_fds(self) -> list[int]:
        return [fd for pair in self.out + self.err + self.msg for fd in pair]

    def close(self) -> None:
        for fd in self.all_fds():
            with contextlib.suppress(OSError):
                os.close(fd)


def frame(obj: Any) -> bytes:
    """One message on a pipe: its length, then its pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


class Frames:
    """Decodes the frames of one pipe from chunks cut anywhere; a frame that cannot be unpickled is dropped."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> Iterator[Any]:
        self.buffer += data
        while len(self.buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + size:
                break
            body = self.buffer[_HEADER.size : _HEADER.size + size]
            self.buffer = self.buffer[_HEADER.size + size :]
            try:
                yield pickle.loads(body)
            except Exception:
                continue


def _last_segment(line: str) -> str:
    """What a terminal would show of a line that carriage returns overwrite."""
    return line.rstrip("\r").rsplit("\r", 1)[-1]


class RankLines:
    """Assembles the bytes each rank writes to fds 1 and 2 into whole lines, so ranks never interleave
    mid-line. Rank 0 passes through as is (a carriage-return progress bar stays live); lines from other
    ranks are marked with the rank and keep only their last carriage-return segment."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, str], str] = {}
        self._decoders: dict[tuple[int, str], Any] = {}

    def feed(self, rank: int, stream: str, data: bytes) -> str:
        key = (rank, stream)
        decoder = self._decoders.setdefault(key, codecs.getincrementaldecoder("utf-8")("replace"))
        text = (self._partial.pop(key, "") + decoder.decode(data)).replace("\r\n", "\n")
        if rank == 0:
            cut = max(text.rfind("\n"), text.rfind("\r")) + 1
        else:
            cut = text.rfind("\n") + 1
        ready, rest = text[:cut], text[cut:]
        if rest:
            self._partial[key] = rest
        if rank == 0 or not ready:
            return ready
        return "".join(f"[rank {rank}] {_last_segment(line)}\n" for line in ready.split("\n")[:-1])

    def flush(self) -> list[tuple[int, str, str]]:
        """What is left without a line end, once the ranks have ended."""
        for key, decoder in self._decoders.items():  # a character cut off at the end shows as U+FFFD
            tail = decoder.decode(b"", final=True)
            if tail:
                self._partial[key] = self._partial.get(key, "") + tail
        left = []
        for (rank, stream), text in list(self._partial.items()):
            del self._partial[(rank, stream)]
            left.append((rank, stream, f"{text}\n" if rank == 0 else f"[rank {rank}] {_last_segment(text)}\n"))
        return left


class Relay:
    """Reads every rank's pipes in the kernel's main thread, and watches each rank's process (from its hello)
    to learn how and when it ended before anyone reaps it. Ranks are named in the whole group: this node's
    pipes belong to ranks `first_rank` on, and the first of them sends the kernel messages."""

    def __init__(
        self,
        pipes: Pipes,
        on_text: Callable[[int, str, str], None],
        on_message: Callable[[dict[str, Any]], None],
        first_rank: int = 0,
    ):
        self.lines = RankLines()
        self.on_text, self.on_message = on_text, on_message
        self.first_rank = first_rank
        self.sel = selectors.DefaultSelector()
        for stream, ends in (("stdout", pipes.out), ("stderr", pipes.err), ("msg", pipes.msg)):
            for rank, (r, _) in enumerate(ends, start=first_rank):
                os.set_blocking(r, False)
                self.sel.register(r, selectors.EVENT_READ, (rank, stream))
        self.frames: dict[int, Frames] = {}
        self.started: dict[int, int] = {}  # rank -> pid, from its hello (its process runs the rank's program)
        self.ended: dict[int, tuple[int, float]] = {}  # rank -> (exit code or -signal, when it ended)
        self.closed = False

    @property
    def greeted(self) -> bool:
        """A rank said hello: the rendezvous is done."""
        return bool(self.started)

    def watch(self, rank: int, pid: int) -> bool:
        """Wake when the rank's process ends, to read how and when before anyone reaps it."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):  # no pidfd here, or already reaped
            return False
        self.sel.register(pidfd, selectors.EVENT_READ, (rank, "exit"))
        return True

    def _ended(self, rank: int, pidfd: int) -> None:
        self.sel.unregister(pidfd)
        with contextlib.suppress(OSError):
            info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            if info is not None:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                self.ended.setdefault(rank, (code, time.time()))
        os.close(pidfd)

    def poll(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            rank, stream = key.data
            if stream == "exit":
                self._ended(rank, key.fd)
                continue
            try:
                data = os.read(key.fd, 1 << 16)
            except BlockingIOError:
                continue
            if not data:
                self.sel.unregister(key.fd)
                continue
            if stream == "msg":
                self._messages(rank, data)
            else:
                text = self.lines.feed(rank, stream, data)
                if text:
                    self.on_text(rank, stream, text)

    def _messages(self, rank: int, data: bytes) -> None:
        for message in self.frames.setdefault(rank, Frames()).feed(data):
            if not isinstance(message, dict):
                continue
            if "hello" in message:
                self.started[rank] = message["hello"]
                self.watch(rank, message["hello"])
            elif rank == self.first_rank:
                with contextlib.suppress(Exception):
                    self.on_message(message)

    def close_watches(self) -> None:
        for key in list(self.sel.get_map().values()):
            if key.data[1] == "exit":
                self.sel.unregister(key.fd)
                os.close(key.fd)

    def drain(self) -> None:
        self.close_watches()
        for _ in range(1000):
            if not self.sel.get_map() or not self.sel.select(0):
                break
            self.poll(0)
        for rank, stream, text in self.lines.flush():
            self.on_text(rank, stream, text)
        self.close()

    def close(self) -> None:
        """Release the pidfds and the selector (once; after drain, or on any way out of a launch)."""
        if not self.closed:
            self.closed = True
            self.close_watches()
            self.sel.close()


def _kernel() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return getattr(get_ipython(), "kernel", None)


def capture_kernel_messages(rank: int, msg_fd: int) -> None:
    """In a rank, the kernel's session cannot send (fork check, dead IOPub thread). The IOPub messages
    (displays, widgets such as tqdm.auto bars) of the node's first rank (`rank` is LOCAL_RANK) go to the kernel
    through its message pipe; other ranks' are dropped."""
    kernel = _kernel()
    session = getattr(kernel, "session", None)
    if session is None:
        return
    iopub = getattr(kernel, "iopub_socket", None)

    def send(
        stream: Any,
        msg_or_type: Any,
        content: Any = None,
        parent: Any = None,
        ident: Any = None,
        buffers: Any = None,
        track: bool = False,
        header: Any = None,
        metadata: Any = None,
    ) -> Any:
        if rank != 0 or stream is not iopub:
            return None
        message = {
            "msg_or_type": msg_or_type,
            "content": content,
            "parent": parent,
            "ident": ident,
            "buffers": [bytes(b) for b in buffers or []],
            "header": header,
            "metadata": metadata,
        }
        with contextlib.suppress(Exception):
            os.write(msg_fd, frame(message))
        return None

    session.send = send


def publish_kernel_message(message: dict[str, Any], flush: bool = True) -> None:
    """In the kernel, publish on IOPub a display or widget message that rank 0 sent, so `display()` and
    `tqdm.auto` bars from the rank appear in the cell. `flush`: what the ranks printed to the cell shows first."""
    kernel = _kernel()
    if kernel is None:
        return
    for stream in (sys.stdout, sys.stderr) if flush else ():
        with contextlib.suppress(AttributeError, ValueError):
            stream.flush()
    message = dict(message)
    kernel.session.send(kernel.iopub_socket, message.pop("msg_or_type"), **message)
