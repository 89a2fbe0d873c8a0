"""The launch's shared-memory gradient averaging: CPU ranks on one machine average DDP's gradient buckets in a
segment under /dev/shm, synchronised by flags in that segment, instead of through gloo (which stays for every
other collective).

The segment is one file that the ranks map: a header page with each rank's pid, then one region per gradient
bucket, made when the bucket is first seen (all ranks agree on its place with one gloo all-reduce, once). A region
is a page of flags, one per rank, the bucket's average, then each rank's copy of the bucket. A rank copies each
bucket divided by the world size into its copy as DDP hands it over and raises its flag. After the step's last
bucket it waits for the others' flags and sums the copies in rank order, so every rank gets the same bits (and, for
two ranks, the bits gloo gives): a bucket of a MiB or more in parts, each rank its own part of the average, which
every rank then reads once the others raised their flags again; a smaller one whole, by each rank, one wait fewer.
A waiting rank spins, a millisecond when every rank has CPUs of its own and briefly when ranks outnumber them or
the machine has more runnable threads than CPUs (another program is busy: /proc/loadavg, looked at ten times a
second), then sleeps in the kernel on the flag it waits for (a futex, which the rank that raises a flag wakes;
with no futex, short sleeps with backoff), so a waiting rank takes no CPU from a busy machine; it watches its
peers' processes, and gives up after the collective timeout with an error the rank's classifier files as
collateral or as a timeout. The kernel removes the segment with the launch's folder (Workdir.remove), whatever
happened to the ranks.

While another program has been busy within the last second (the ranks' threads have CPUs enough, yet the training
thread waited for one over a quarter of the time, at two looks in a row), a rank hands a step's posting, waiting and
summing to an averaging thread of its own, and its training thread sleeps until DDP's futures are set, as gloo's
threads do. Where the CPUs are shared between sessions first (Linux's autogroup), that keeps the ranks' share of
them: on 2 CPUs with two busy programs each in a session of its own, the bench MLP's training thread waited for a
CPU 4.0 to 4.8 s of a 7 to 8.3 s loop when it averaged itself, 1.4 to 2.1 s of a 4.3 to 5.5 s loop when its
averaging thread did. On a quiet machine the hand-over would cost a few percent, so there the training thread
averages itself.

Private API of torch, used here only:
- `DistributedDataParallel._get_ddp_logging_data()` (torch 1.9 and later) and its "comm_hook" key, which
  register_comm_hook and the builtin hooks set: whether a model already has a communication hook when its first
  forward starts, since DDP takes one hook per model. Fallback: none; a test fails when it moves.

Relied on, not an API: DDP reads a hook's result through views made at offsets from the start of the result's
storage (reducer.cpp, populate_bucket_views_out; torch 2.9 to 2.13, the stacks tested), so a bucket's average in
the segment is a tensor of its own map. A test that trains a model whose bucket is summed in parts fails when that
moves.

Patched, not private: `DistributedDataParallel.__init__` (torch 1.x and later) is wrapped in a rank, to watch
each model built there, and the instance's `register_comm_hook`, so that a hook the cell registers after the
first forward replaces ours instead of failing.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

__all__ = ["ENV", "PEER_ENDED", "Segment", "Region", "install", "watch", "has_comm_hook", "alive", "spin"]

ENV = "ACCEL_MAGIC_ALLREDUCE"  # "shm" in a rank's environment: average gradients in the launch's segment
# Words of the error a rank raises when a peer ended while it waited: the rank's classifier files it as collateral.
PEER_ENDED = "ended while this rank waited for its gradients"
PAGE = mmap.PAGESIZE
LINE = 16  # int32 flags between two ranks' flags: a cache line each, so a rank's writes never touch another's
SPIN = 50e-6  # seconds a waiting rank checks the flags without pause before it sleeps, when ranks outnumber CPUs
SPIN_OWN_CPUS = 0.001  # the same when every rank has CPUs of its own: a flag is seen at once, no CPU is taken
SPLIT = 1 << 20  # bytes: a bucket this large or larger is summed in parts, each rank its own
LONGEST_SLEEP = 0.0002  # seconds: the backoff's cap, the most a rank can oversleep a peer's flag
TIMER_SLACK_NS = 1000  # a rank's sleeps end within a microsecond of their time, not Linux's default 50
PR_SET_TIMERSLACK = 29  # prctl option (linux/prctl.h)
WATCH_EVERY = 0.005  # seconds between two looks at the peers' processes while waiting (a /proc read each)
LOOK_EVERY = 0.1  # seconds between two looks at how many threads the machine has runnable
WAITED = 0.25  # share of the time between two looks that the training thread may wait for a CPU on a quiet machine
BUSY_FOR = 1.0  # seconds a rank counts another program as busy after it last saw one
# Who averages a step's buckets: the averaging thread while another program is busy ("busy"), or always, or never.
HAND_OFF: Literal["busy", "always", "never"] = "busy"
SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())  # Linux's syscall number (asm/unistd.h)
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # shared between processes: not the _PRIVATE variants


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """Linux's futex on an int32 of a shared map: sleep while it holds a value, and wake its sleepers."""

    def __init__(self) -> None:
        self.syscall = ctypes.CDLL(None, use_errno=True).syscall
        self.syscall.restype = ctypes.c_long
        self.timeout = _Timespec(0, int(WATCH_EVERY * 1e9))

    @staticmethod
    def available() -> bool:
        return sys.platform == "linux" and SYS_FUTEX is not None

    def wait(self, address: int, value: int) -> None:
        """Until the int32 at `address` is woken, no longer holds `value`, or WATCH_EVERY seconds passed."""
        self.syscall(SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAIT, ctypes.c_int(value), ctypes.byref(self.timeout),
                     None, 0)  # fmt: skip

    def wake(self, address: int) -> None:
        self.syscall(SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAKE, ctypes.c_int(2**31 - 1), None, None, 0)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, which the kernel has not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


class Region:
    """One bucket's place in the segment: a flag per rank, the average, then a copy of the bucket per rank."""

    def __init__(self, fd: int, offset: int, world: int, nbytes: int, dtype: Any) -> None:
        import torch

        head, stride = _round_up(world * LINE * 4, PAGE), _round_up(nbytes, PAGE)
        self.map = mmap.mmap(fd, head + (world + 1) * stride, offset=offset)
        self.flags = memoryview(self.map)[:head].cast("i")
        self.address = ctypes.addressof(ctypes.c_int.from_buffer(self.map))  # of the flags: a futex each
        # The average is a tensor of its own, at the start of its own map: DDP takes views of a hook's result at
        # offsets counted from the start of the result's storage.
        self.average_map = mmap.mmap(fd, stride, offset=offset + head)
        self.average = torch.frombuffer(self.average_map, dtype=torch.uint8)[:nbytes].view(dtype)
        raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.copies = [raw[head + (r + 1) * stride :][:nbytes].view(dtype) for r in range(world)]
        numel = self.average.numel()
        bounds = [min(numel, _round_up(numel * r // world, 16)) for r in range(world)] + [numel]
        self.parts = [slice(bounds[r], bounds[r + 1]) for r in range(world)]  # which part of the sum each rank makes
        self.split = nbytes >= SPLIT
        self.step = 0

    @staticmethod
    def size(world: int, nbytes: int) -> int:
        return _round_up(world * LINE * 4, PAGE) + (world + 1) * _round_up(nbytes, PAGE)


class Segment:
    """This rank's view of the launch's segment, and the waiting on the other ranks' flags."""

    def __init__(
        self,
        path: str,
        rank: int,
        world: int,
        timeout: float,
        spin: float = SPIN,
        cpus: int | None = None,
        threads: int = 1,
    ) -> None:
        self.rank, self.world, self.timeout, self.spin = rank, world, timeout, spin
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.fits = world * threads <= self.cpus  # the ranks' threads have CPUs of their own
        self.looked, self.waited, self.crowded, self.others_before, self.busy_until = 0.0, 0.0, False, False, 0.0
        self.averaging: Averaging | None = None
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        header = _round_up(world * 8, PAGE)
        os.posix_fallocate(self.fd, 0, header)
        self.header = mmap.mmap(self.fd, header)
        self.pids = memoryview(self.header).cast("q")
        self.pids[rank] = os.getpid()
        self.parent = os.getppid()
        self.end = header  # where the next region goes: the same in every rank
        self.others = [r for r in range(world) if r != rank]
        self.told = False  # whether rank 0 said that a bucket goes through gloo
        self.futex = Futex() if Futex.available() else None

    def region(self, nbytes: int, dtype: Any) -> Region | None:
        """A new region at the end of the segment, or None when one of the ranks could not make room for it (a
        small /dev/shm) or the ranks disagree on it: then that bucket goes through gloo. A gloo collective, so
        every rank calls it for the same bucket at the same time."""
        import torch
        import torch.distributed as dist

        size = Region.size(self.world, nbytes)
        ok = 1
        try:
            os.posix_fallocate(self.fd, self.end, size)
        except OSError:
            ok = 0
        agreed = torch.tensor([ok, self.end, -self.end, size, -size], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        ok, low, high, small, big = agreed.tolist()
        self.end = -high + -big  # past the furthest rank's idea of it: the same in every rank
        if not ok or low != -high or small != -big:
            if self.rank == 0 and not self.told:
                self.told = True
                why = "/dev/shm has no room for them" if not ok else "the ranks' gradient buckets differ"
                sys.stderr.write(f"accel_magic: some gradients are averaged by gloo, not in shared memory: {why}.\n")
            return None
        return Region(self.fd, low, self.world, nbytes, dtype)

    def average(self, region: Region, buffer: Any) -> None:
        """Replace `buffer` (this rank's bucket) with the average of every rank's, in place."""
        step = self.post(region, buffer)
        self.reduce(region, buffer, step)
        average = self.collect(region, buffer, step)
        if average is not buffer:
            buffer.copy_(average)

    def post(self, region: Region, buffer: Any) -> int:
        """Put this rank's share of `buffer` (divided by the world size) in its copy and raise its flag; the step,
        for `reduce` and `collect`."""
        import torch

        step = region.step
        region.step += 1
        self.wait(region, 2 * step)  # every rank has summed the last step's copies: this rank's may be overwritten
        torch.div(buffer, self.world, out=region.copies[self.rank])
        self.raise_flag(region, 2 * step + 1)
        return step

    def reduce(self, region: Region, buffer: Any, step: int) -> None:
        """Once every rank has posted `step`: the sum of the copies in rank order, this rank's part of it into the
        region's average (a bucket in parts), or the whole into `buffer`."""
        import torch

        self.wait(region, 2 * step + 1)
        part = region.parts[self.rank] if region.split else slice(None)
        out = region.average[part] if region.split else buffer
        copies = [copy[part] for copy in region.copies]
        torch.add(copies[0], copies[1], out=out)
        for copy in copies[2:]:
            out.add_(copy)
        self.raise_flag(region, 2 * step + 2)

    def collect(self, region: Region, buffer: Any, step: int) -> Any:
        """The average of `step`: `buffer`, or for a bucket in parts, once every rank has made its part, the
        region's average, whose bits stay until this rank posts the region again (the others write the next one
        only after every rank posted it)."""
        if not region.split:
            return buffer
        self.wait(region, 2 * step + 2)
        return region.average

    def raise_flag(self, region: Region, value: int) -> None:
        """This rank's flag of `region` to `value`, and the ranks asleep on it woken."""
        region.flags[self.rank * LINE] = value
        if self.futex is not None:
            self.futex.wake(region.address + self.rank * LINE * 4)

    def wait(self, region: Region, target: int) -> None:
        """Until every other rank's flag reaches `target`; a peer that ended, a kernel that went away, or the
        collective timeout raise a RuntimeError instead."""
        flags = region.flags
        lines = [r * LINE for r in self.others]
        until = time.perf_counter() + self.spin_now()
        while not all(flags[i] >= target for i in lines):
            if time.perf_counter() > until:
                break
        else:
            return
        now = time.monotonic()
        deadline, watch, delay = now + self.timeout, now + WATCH_EVERY, 1e-5
        while True:
            late = next((i for i in lines if flags[i] < target), None)
            if late is None:
                return
            seen = flags[late]  # read once: the futex sleeps only while the flag still holds it
            if seen >= target:
                continue
            if self.futex is not None:
                self.futex.wait(region.address + late * 4, seen)
            else:
                time.sleep(delay)
                delay = min(delay * 2, LONGEST_SLEEP)
            now = time.monotonic()
            if now >= watch:
                watch = now + WATCH_EVERY
                self._watch(flags, target)
                if now >= deadline and flags[late] < target:
                    raise RuntimeError(
                        f"the shared-memory all-reduce timed out waiting {self.timeout:g} s for rank "
                        f"{late // LINE}'s gradients"
                    )

    def spin_now(self) -> float:
        """How long to spin now: briefly while the machine has more runnable threads than CPUs (a spinning rank
        would take a CPU that another program, or the peer it waits for, needs)."""
        if self.spin <= SPIN:
            return self.spin
        self.look()
        return SPIN if self.crowded else self.spin

    def hand_off(self) -> bool:
        """Whether this step's averaging goes to the averaging thread: while another program has been busy within
        the last BUSY_FOR seconds (HAND_OFF "busy")."""
        if HAND_OFF != "busy":
            return HAND_OFF == "always"
        self.look()
        return time.monotonic() < self.busy_until

    def look(self) -> None:
        """Every LOOK_EVERY seconds: whether the machine has more runnable threads than CPUs (crowded), and whether
        another program is busy: where the ranks' threads have CPUs enough, the training thread waited for one for
        more than WAITED of the time since the last look, and of the look before (not a passing thread)."""
        now = time.monotonic()
        if now >= self.looked + LOOK_EVERY:
            waited = run_queue_wait()
            others = self.fits and waited - self.waited > WAITED * (now - self.looked)
            if others and self.others_before:
                self.busy_until = now + BUSY_FOR
            self.looked, self.waited, self.others_before = now, waited, others
            self.crowded = runnable() > self.cpus

    def thread(self) -> Averaging:
        """The rank's averaging thread, started the first time it is needed."""
        if self.averaging is None:
            self.averaging = Averaging()
        return self.averaging

    def _watch(self, flags: memoryview, target: int) -> None:
        for r in self.others:
            pid = self.pids[r]
            if flags[r * LINE] < target and pid and not alive(pid):
                raise RuntimeError(f"rank {r} {PEER_ENDED} (shared-memory all-reduce): its process is gone")
        if os.getppid() != self.parent:
            raise RuntimeError(f"the kernel {PEER_ENDED} (shared-memory all-reduce): it is gone")


class Averaging:
    """A rank's averaging thread: runs what the training thread hands it, in order, while that thread sleeps
    until DDP's futures are set."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        threading.Thread(target=self.run, name="accel_magic-averaging", daemon=True).start()

    def put(self, task: Callable[[], None]) -> None:
        self.tasks.put(task)

    def run(self) -> None:
        while True:
            self.tasks.get()()


class Averager:
    """One DDP model's communication hook: its buckets' regions, and the hook the cell may register later."""

    def __init__(self, segment: Segment, process_group: Any) -> None:
        self.segment, self.process_group = segment, process_group
        self.regions: dict[tuple[int, int, Any], Region | None] = {}
        self.pending: list[tuple[Region, Any, int, Any]] = []  # posted this step, summed after the last bucket
        self.replacement: tuple[Callable[[Any, Any], Any], Any] | None = None
        self.handed: bool | None = None  # whether this step's buckets go to the averaging thread (None: no bucket yet)
        self.futures: list[Any] = []  # this step's, handed to the averaging thread
        self.error: BaseException | None = None  # what ended the averaging thread's work for this model

    def hook(self) -> Callable[[Any, Any], Any]:
        def shared_memory_average(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads annotations as types
            import torch
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            if self.replacement is not None:
                hook, state = self.replacement
                return hook(state, bucket)
            buffer = bucket.buffer()
            region = None
            if buffer.device.type == "cpu" and buffer.layout == torch.strided and buffer.is_contiguous():
                key = (bucket.index(), buffer.numel() * buffer.element_size(), buffer.dtype)
                if key not in self.regions:
                    self.regions[key] = self.segment.region(key[1], buffer.dtype)
                region = self.regions[key]
            if region is None:
                future = allreduce_hook(self.process_group, bucket)
            else:
                future = torch.futures.Future()
                if self.handed is None:
                    self.handed = self.segment.hand_off()
                if self.handed:
                    self.futures.append(future)
                    post = partial(self.post, region, buffer, future)
                    self.segment.thread().put(partial(self.handled, post, [future]))
                else:
                    self.post(region, buffer, future)
            if bucket.is_last():  # DDP waits for the futures only after this, the step's last bucket
                if self.handed:
                    self.segment.thread().put(partial(self.handled, self.collect, self.futures))
                    self.futures = []
                else:
                    self.collect()
                self.handed = None
            return future

        return shared_memory_average

    def post(self, region: Region, buffer: Any, future: Any) -> None:
        self.pending.append((region, buffer, self.segment.post(region, buffer), future))

    def collect(self) -> None:
        """Average every bucket posted this step: the ranks wait for each other at most twice a step, not for
        every bucket, and a rank that is ahead goes on computing its gradients meanwhile."""
        pending, self.pending = self.pending, []
        for region, buffer, step, _ in pending:
            self.segment.reduce(region, buffer, step)
        for region, buffer, step, future in pending:
            future.set_result(self.segment.collect(region, buffer, step))  # DDP copies it into the gradients

    def handled(self, task: Callable[[], None], futures: list[Any]) -> None:
        """`task` in the averaging thread; what it raises (or raised in an earlier task) fails `futures`, which
        DDP waits for: the training thread raises it."""
        if self.error is None:
            try:
                task()
                return
            except BaseException as err:
                self.error = err
        self.pending = []
        for future in futures:
            if not future.done():
                future.set_exception(self.error)


def runnable() -> int:
    """The threads the machine has runnable now, this one included (/proc/loadavg's fourth field); 0 unknown."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return 0


def run_queue_wait() -> float:
    """Seconds this process's main thread has waited for a CPU while runnable, since it started
    (/proc/self/schedstat's second field); 0 unknown."""
    try:
        with open("/proc/self/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def spin(world: int, threads: int, cpus: int) -> float:
    """How long a waiting rank spins before it sleeps: long enough to see a flag at once when every rank's
    threads have CPUs of their own, briefly when a spinning rank would take a CPU from one that computes."""
    return SPIN_OWN_CPUS if world * threads <= cpus else SPIN


def has_comm_hook(model: Any) -> bool:
    """Whether a DDP model has a communication hook (registered by the cell, by accelerate, or ours)."""
    return bool(model._get_ddp_logging_data().get("comm_hook"))


def watch(model: Any, segment: Segment) -> None:
    """Give a DDP model of the whole group our hook at its first forward, unless it has one by then; a hook the
    cell registers later takes the place of ours."""
    import torch.distributed as dist

    if model.process_group is not dist.group.WORLD:
        return
    averager = Averager(segment, model.process_group)
    registered = False

    def first_forward(module: Any, args: Any) -> None:
        nonlocal registered
        handle.remove()
        if not has_comm_hook(model):
            model.register_comm_hook(None, averager.hook())
            registered = True

    def register_comm_hook(state: Any, hook: Callable[[Any, Any], Any]) -> None:
        if not registered:
            return type(model).register_comm_hook(model, state, hook)
        averager.replacement = (hook, state)

    handle = model.register_forward_pre_hook(first_forward)
    model.register_comm_hook = register_comm_hook


def install(path: str, timeout: float, cpus: int | None = None) -> None:
    """In a rank, once its process group is up: every DistributedDataParallel model built from now on averages its
    gradients through the segment at `path`, waiting at most `timeout` seconds for the other ranks; `cpus` is
    the machine's CPU budget (by default the CPUs this process may run on), which tells whether a waiting rank
    may spin."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = dist.get_world_size()
    cpus = cpus or len(os.sched_getaffinity(0))
    threads = torch.get_num_threads()
    segment = Segment(path, dist.get_rank(), world, timeout, spin(world, threads, cpus), cpus, threads)
    with contextlib.suppress(Exception):  # short sleeps while waiting, without oversleeping a peer's flag
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0)
    original = DistributedDataParallel.__init__
    original = getattr(original, "__wrapped__", original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        watch(self, segment)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    DistributedDataParallel.__init__ = __init__  # type: ignore[method-assign]
