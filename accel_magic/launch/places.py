"""Where each rank is while the launch runs, and whether its ranks can still meet. A thread in every rank samples
the stack of the thread that runs the cell a few times a second: the cell line, and the collective it waits in.
Each rank writes its place into its own slot of a map that the kernel shares with the ranks (made before they
fork); the kernel reads every slot and says when every rank still running waits, for a while, in a collective that
the others are not in (another operation, or another count of collectives so far), or in one while a rank has
finished the cell: such ranks can never meet, and waiting for the timeout (900 s by default) tells nothing more.

Private API of torch, used here only:
- `ProcessGroup._get_sequence_number_for_group()` (torch 1.9 and later, gloo and NCCL) of
  `distributed_c10d._get_default_group()`: how many collectives the rank's default group has started, DDP's
  gradient all-reduces included. Fallback: the counts are not compared,
  the operations still are.

Relied on, not an API: the collectives' Python functions live in `torch/distributed/distributed_c10d.py`, and
on CPU, DDP's gradient all-reduce is waited for at the end of `backward`, in the thread that called it; a test
that mismatches each of them fails when that moves.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

__all__ = ["Place", "Places", "Sampler", "where", "stuck", "place_words"]

SLOT = 512  # bytes per rank: a seqlock counter, a length, the pickled place
EVERY = 0.2  # seconds between two samples in a rank
STEADY = 1.0  # seconds a rank must wait in the same collective before the kernel counts it as waiting there
BUSY = 0.2  # share of a second a thread may compute and still count as waiting (DDP's backward, gloo's waits)

_HEADER = struct.Struct("QI")  # counter (odd while written), length
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_DISTRIBUTED = (os.path.join("torch", "distributed", ""), os.path.join("torch", "nn", "parallel", "distributed.py"))
_BACKWARD = (os.path.join("torch", "autograd", ""), os.path.join("torch", "_tensor.py"))
_SHM = os.path.join("accel_magic", "launch", "shm.py")
_RANK = os.path.join("accel_magic", "launch", "rank.py")  # the rank's program: nothing outside it is the cell's
DDP_AVERAGE = "DDP's gradient all-reduce"
NOT_COLLECTIVES = ("destroy_process_group",)  # of torch.distributed's functions: its own ending, no meeting

State = Literal["cell", "waits", "done"]


@dataclass(frozen=True)
class Place:
    """Where a rank was when it last looked: in its cell (`line`, 0 when not known), waiting in collective `op`
    (called from the cell as `called`; `seq`, the group's count of collectives, -1 unknown) since `since`
    (time.monotonic, the same clock in every process), or done with the cell."""

    state: State = "cell"
    line: int = 0
    op: str = ""
    called: str = ""
    seq: int = -1
    since: float = 0.0

    def words(self, source: str = "") -> str:
        """ "in all_gather at cell line 3", "at cell line 5", "in gather (all_gather_into_tensor)"; with `source`
        (what holds a launched function: "train's cell"), "at line 5 of train's cell"."""
        if self.state == "done":
            return "had finished the cell"
        at = (f"at line {self.line} of {source}" if source else f"at cell line {self.line}") if self.line else ""
        if not self.op:
            return at
        op = self.op if self.called in ("", self.op) else f"{self.called} ({self.op})"
        return f"in {op} {at}".rstrip()


def where(frame: FrameType | None, cell_filename: str) -> tuple[int, str, str, bool]:
    """From a thread's innermost frame: the cell line it is at (0: none), the collective it is in ("" when none),
    the call of the cell that leads there, and whether that is only a collective when the thread computes
    nothing (DDP's backward, DDP's own calls into the group)."""
    line, op, called, idle_only = 0, "", "", False
    inner = ""  # the function called by the frame being looked at
    while frame is not None:
        code = frame.f_code
        name, filename = code.co_name, code.co_filename
        if filename.endswith(_RANK):
            break
        if filename == cell_filename and cell_filename:
            if not line:
                line, called = frame.f_lineno, inner
        elif not line:
            if filename.endswith(_C10D):
                if not name.startswith("_") and name not in NOT_COLLECTIVES:
                    op, idle_only = name, False  # the outermost: all_gather_object, not the all_gather it calls
            elif not op and filename.endswith(_SHM) and name == "wait":
                op = DDP_AVERAGE
            elif not op and any(part in filename for part in _DISTRIBUTED):
                op, idle_only = f"DistributedDataParallel's {name.lstrip('_')}", True
            elif not op and any(part in filename for part in _BACKWARD) and "backward" in name:
                op, idle_only = DDP_AVERAGE, True
        inner = name
        frame = frame.f_back
    if called in ("wrapper", "<module>") or not called.isidentifier():
        called = ""
    return line, op, called, idle_only


def _sequence_number() -> int:
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    return -1


class Places:
    """The map of every rank's place: made in the kernel before the ranks fork, written by each rank in its own
    slot, read by the kernel."""

    def __init__(self, nprocs: int) -> None:
        self.map = mmap.mmap(-1, SLOT * nprocs)
        self.nprocs = nprocs

    def write(self, local: int, place: Place) -> None:
        data = pickle.dumps(place, protocol=pickle.HIGHEST_PROTOCOL)[: SLOT - _HEADER.size]
        base = local * SLOT
        (counter, _) = _HEADER.unpack_from(self.map, base)
        _HEADER.pack_into(self.map, base, counter + 1, 0)  # odd: being written
        self.map[base + _HEADER.size : base + _HEADER.size + len(data)] = data
        _HEADER.pack_into(self.map, base, counter + 2, len(data))

    def read(self, local: int) -> Place | None:
        base = local * SLOT
        for _ in range(100):
            counter, size = _HEADER.unpack_from(self.map, base)
            if counter == 0:
                return None
            data = self.map[base + _HEADER.size : base + _HEADER.size + size]
            if counter % 2 == 0 and _HEADER.unpack_from(self.map, base)[0] == counter:
                with contextlib.suppress(Exception):
                    return pickle.loads(data)
                return None
            time.sleep(0.0001)
        return None

    def all(self, first_rank: int = 0) -> dict[int, Place]:
        """Every rank's place (by its rank in the whole group), for the ranks that wrote one."""
        places = {first_rank + local: self.read(local) for local in range(self.nprocs)}
        return {rank: place for rank, place in places.items() if place is not None}

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.map.close()


class Sampler:
    """In a rank: a daemon thread that writes where the thread running the cell is, every EVERY seconds, until
    `finish` (the cell ended well: "done") or `stop` (it failed: the last place stays)."""

    def __init__(self, places: Places, local: int, cell_filename: str) -> None:
        self.places, self.local, self.cell_filename = places, local, cell_filename
        self.target = threading.get_ident()
        self.clock = time.pthread_getcpuclockid(self.target)
        self.stopped = threading.Event()
        self.key: tuple[Any, ...] = ()
        self.since = self.cpu = self.last = 0.0
        self.known = False  # a place with a cell line or a collective was written
        self.thread = threading.Thread(target=self._run, name="accel_magic-places", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(EVERY):
            try:
                self.sample()
            except Exception:  # the place is a help, never a failure of the rank
                return

    def sample(self) -> Place:
        frame = sys._current_frames().get(self.target)
        line, op, called, idle_only = where(frame, self.cell_filename)
        del frame
        now, cpu = time.monotonic(), time.clock_gettime(self.clock)
        key = (line, op, called, _sequence_number() if op else -1)
        busy = idle_only and cpu - self.cpu > BUSY * max(now - self.last, 1e-3)
        if key != self.key or busy:
            self.key, self.since = key, now
        self.cpu, self.last = cpu, now
        place = Place("waits" if op and not busy else "cell", line, op, called, key[3], self.since)
        # Nowhere (no cell line, no collective) once it was somewhere: the thread left the cell (an exception on
        # its way out, before `stop`), so the last place stays.
        left = not line and not op and self.known
        if not self.stopped.is_set() and not left:
            self.places.write(self.local, place)
        self.known = self.known or bool(line or op)
        return place

    def stop(self) -> None:
        self.stopped.set()

    def finish(self) -> None:
        self.stopped.set()
        self.places.write(self.local, Place("done"))


PLURAL = {"was": "were", "waits": "wait"}


def place_words(places: dict[int, Place], verb: str = "was", source: str = "") -> str:
    """ "rank 0 was in all_gather at cell line 3, rank 1 in barrier at cell line 5": each rank's place (ranks at
    the same place together: "ranks 0 and 1 were at cell line 3"), the verb after the first, the ranks that
    finished the cell last; a rank without a place is left out."""
    groups: dict[str, list[int]] = {}
    for rank, place in sorted(places.items(), key=lambda item: (item[1].state == "done", item[0])):
        if place.words(source):
            groups.setdefault(place.words(source), []).append(rank)
    parts = []
    for words, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
        if words == "had finished the cell" or parts:
            parts.append(f"{who} {words}")
        else:
            parts.append(f"{who} {verb if len(ranks) == 1 else PLURAL.get(verb, verb)} {words}")
    return ", ".join(parts)


def stuck(places: dict[int, Place], running: set[int], now: float, steady: float = STEADY) -> str:
    """When the ranks in `running` (started, not ended) can never meet: each has waited `steady` seconds in a
    collective or has finished the cell, at least one waits, and they are not all in the same collective (the
    same operation at the same count), or one has finished. The words that name each rank's place; "" else."""
    if not running or any(r not in places for r in running):
        return ""
    mine = {r: places[r] for r in sorted(running)}
    waiting = {r: p for r, p in mine.items() if p.state == "waits" and now - p.since >= steady}
    finished = {r: p for r, p in mine.items() if p.state == "done"}
    if not waiting or len(waiting) + len(finished) < len(mine):
        return ""
    if not finished and len({(p.op, p.seq) for p in waiting.values()}) == 1:
        return ""
    same_op = len({p.op for p in waiting.values()}) == 1 and len(waiting) > 1
    shown = {
        rank: Place(p.state, p.line, f"{p.op} (collective {p.seq})", p.called) if same_op and p.seq >= 0 else p
        for rank, p in waiting.items()  # the same operation: the counts tell the ranks apart
    }
    words = place_words(shown, "waits")
    if finished:
        ranks = " and ".join(str(r) for r in finished)
        words += f", and rank{'s' if len(finished) > 1 else ''} {ranks} had finished the cell"
    return words
