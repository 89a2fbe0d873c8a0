"""PyTorch's own distributed code, as its tutorials write it, in a real ipykernel: a training cell's own
init_process_group adopts the launch's group."""

from __future__ import annotations

import re
import socket
import time

from ports import free_port

SETUP = "%load_ext accel_magic"

# PyTorch's "Getting Started with Distributed Data Parallel", on CPU: the model stays on the CPU (no .to(rank),
# no device_ids), the rest as the tutorial writes it.
TUTORIAL = """
import os
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    torch.manual_seed(rank)  # each rank starts from other weights: DDP makes them rank 0's
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(weights) for _ in range(world_size)]
    dist.all_gather(gathered, weights)
    print(f"rank {rank}: same weights on every rank: {all(torch.equal(g, weights) for g in gathered)}")
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")
"""

NOTE = (
    "accel_magic: init_process_group joined the launch's process group (gloo, 2 ranks) rather than making a second one"
)


def test_the_ddp_tutorials_setup_adopts_the_launchs_group_and_the_next_launch_works(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        TUTORIAL,
        '%%accel_train -n 2\ndemo_basic(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))\n'
        "still_up = dist.is_initialized()",
        "%%accel_train -n 2\nprint('world', dist.get_world_size(), 'rank', dist.get_rank())",
        "print(still_up, accel_result.ok)",
    )
    out = cells.text(2)
    assert out.count(NOTE) == 1 and "[rank 1] " + NOTE not in out  # one line, from rank 0
    for rank, prefix in ((0, ""), (1, "[rank 1] ")):
        assert f"{prefix}Running basic DDP example on rank {rank}.\n" in out
        assert f"{prefix}rank {rank}: same weights on every rank: True\n" in out
        assert f"{prefix}Finished running basic DDP example on rank {rank}.\n" in out
    assert "world 2 rank 0\n" in cells.text(3) and "[rank 1] world 2 rank 1\n" in cells.text(3)
    assert cells.text(4).strip() == "False True"  # destroy_process_group ended the group, as in a script


COLLECTIVES = """%%accel_train -n 2
import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group

init_process_group(backend="gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
sent = torch.tensor([10.0 * rank])
dist.broadcast(sent, src=1)
summed = torch.tensor([rank + 1.0])
dist.reduce(summed, dst=0)
part = torch.zeros(1)
dist.scatter(part, [torch.tensor([5.0]), torch.tensor([7.0])] if rank == 0 else None, src=0)
pair = dist.new_group([0, 1])
ones = torch.ones(1)
dist.all_reduce(ones, group=pair)
print(f"rank {rank} of {world}: {total.item()} {sent.item()} {summed.item()} {part.item()} {ones.item()}")
destroy_process_group()
try:
    dist.get_rank()
except ValueError as err:
    print("after destroy:", type(err).__name__)
"""


def test_collectives_new_group_and_refusals_of_arguments_that_disagree(kernel_run) -> None:
    refused = {
        'init_process_group("gloo", world_size=4)': "init_process_group(world_size=4) does not match: this "
        "launch's process group has 2 ranks on gloo and this process is rank {rank}; leave world_size out or pass 2",
        'init_process_group("nccl")': "init_process_group(backend='nccl') does not match: this launch's process "
        "group has 2 ranks on gloo and this process is rank {rank}; leave backend out or pass 'gloo'",
        'init_process_group(rank=1 - int(os.environ["RANK"]))': "init_process_group(rank={other}) does not match: "
        "this launch's process group has 2 ranks on gloo and this process is rank {rank}; leave rank out or pass "
        "int(os.environ['RANK'])",
    }
    bad = [f"%%accel_train -n 2\nimport os\nfrom torch.distributed import init_process_group\n{c}" for c in refused]
    cells = kernel_run(SETUP, "kept = 'yes'", COLLECTIVES, *bad, "print(kept)", allow_errors=True)
    out = cells.text(2)
    assert NOTE in out
    assert "rank 0 of 2: 3.0 10.0 3.0 5.0 2.0\n" in out
    assert "[rank 1] rank 1 of 2: 3.0 10.0 2.0 7.0 2.0\n" in out  # reduce leaves rank 1's own value
    assert "after destroy: ValueError\n" in out and "[rank 1] after destroy: ValueError\n" in out
    for i, sentence in enumerate(refused.values(), start=3):
        (error,) = [o for o in cells.outputs(i) if o["output_type"] == "error"]
        assert error["ename"] == "LaunchError"
        assert any(sentence.format(rank=r, other=1 - r) in error["evalue"] for r in (0, 1)), error["evalue"]
    assert cells.text(6).strip() == "yes"


def test_the_ddp_tutorial_as_written_runs_through_mp_spawn_and_torch_is_untouched_elsewhere(kernel_run) -> None:
    """The tutorial's run_demo, a function of the notebook spawned with torch's default start method (which
    pickles it by a name its processes do not have); a spawn imported before %load_ext is wrapped too, torch's
    own functions are in the ranks and the spawned processes, and %unload_ext puts them back."""
    tutorial = TUTORIAL.replace('"12355"', f'"{free_port()}"')
    cells = kernel_run(
        "import torch.multiprocessing as mp\nfrom torch.multiprocessing import spawn as imported_early",
        SETUP,
        tutorial,
        "def run_demo(demo_fn, world_size):\n    mp.spawn(demo_fn, args=(world_size,), nprocs=world_size, join=True)",
        "run_demo(demo_basic, 2)",
        "def report(i, tag):\n    print(tag, i, getattr(mp.spawn, '_accel_magic', False))\n"
        "out = mp.start_processes(report, args=('spawned',), nprocs=2, start_method='fork')\n"
        "print('returned', out, getattr(imported_early, '_accel_magic', False))",
        "%%accel_train -n 2 --no-return\nprint('rank', getattr(mp.spawn, '_accel_magic', False))",
        "%unload_ext accel_magic\nimport torch\n"
        "print(mp.spawn is torch.multiprocessing.spawn.__wrapped__ if hasattr(mp.spawn, '__wrapped__') else 'own',"
        " getattr(imported_early, '_accel_magic', False))",
    )
    out = cells.text(4)
    assert "torch.multiprocessing.spawn: 2 processes forked by accel_magic" in out
    for rank, prefix in ((0, ""), (1, "[rank 1] ")):
        assert f"{prefix}Running basic DDP example on rank {rank}.\n" in out
        assert f"{prefix}rank {rank}: same weights on every rank: True\n" in out
        assert f"{prefix}Finished running basic DDP example on rank {rank}.\n" in out
    assert NOTE not in out  # the function made its own group
    assert "spawned 0 False\n" in cells.text(5) and "[rank 1] spawned 1 False\n" in cells.text(5)
    assert "returned None True\n" in cells.text(5)
    assert "rank False\n" in cells.text(6) and "[rank 1] rank False\n" in cells.text(6)
    assert cells.text(7).strip() == "own False"


FAILING = """
import os
import torch.distributed as dist
import torch.multiprocessing as mp


def fail_on_one(i, port):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=i, world_size=2)
    dist.barrier()
    if i == 1:
        raise ValueError("process one gives up")
    dist.barrier()
"""


def test_a_failure_is_torchs_exception_naming_the_process_and_line_and_bad_calls_are_refused(kernel_run) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        cells = kernel_run(
            SETUP,
            FAILING,
            f"mp.spawn(fail_on_one, args=({free_port()},), nprocs=2)",
            f"try:\n    mp.spawn(fail_on_one, args=({free_port()},), nprocs=2)\n"
            "except mp.ProcessRaisedException as err:\n"
            "    print('caught', err.error_index, err.error_pid > 0, 'process one gives up' in str(err))",
            f"mp.spawn(fail_on_one, args=({port},), nprocs=2)",
            "mp.spawn(fail_on_one, args=(0,), nprocs=2, join=False)",
            "mp.spawn(fail_on_one, args=(0,), nprocs=0)",
            "def die(i):\n    if i == 1:\n        os._exit(3)\n    import time\n    time.sleep(60)\n"
            "try:\n    mp.start_processes(die, nprocs=2, start_method='forkserver')\n"
            "except mp.ProcessExitedException as err:\n    print('exited', err.error_index, err.exit_code)",
            "import psutil\nprint('kernel fine', psutil.Process().children(recursive=True))",
            allow_errors=True,
        )
    finally:
        taken.close()
    (error,) = [o for o in cells.outputs(2) if o["output_type"] == "error"]
    assert error["ename"] == "LaunchError"
    assert "rank 1 raised ValueError: process one gives up; the other ranks were stopped." in error["evalue"]
    assert "Cell line 11, in fail_on_one" in "\n".join(error["traceback"])
    assert "caught 1 True True\n" in cells.text(3)
    assert f"MASTER_PORT {port} is taken on this machine" in cells.text(4)
    assert "set os.environ['MASTER_PORT'] to a free port, such as" in cells.text(4)
    assert "spawn(join=False) is not supported here" in cells.text(5)
    assert "nprocs must be a whole number of at least 1, not 0." in cells.text(6)
    assert cells.text(7).endswith(
        "forked by accel_magic, 1 thread each; the function makes its own process group\nexited 1 3\n"
    )
    assert cells.text(8).strip() == "kernel fine []"


def test_interrupting_mp_spawn_stops_every_process_in_one_line_and_leaves_nothing(
    live_kernel, two_ranks_stopped
) -> None:
    live_kernel.execute(SETUP)
    live_kernel.execute("import psutil\nimport torch.multiprocessing as mp")
    live_kernel.execute(
        "def forever(i):\n    import time\n    print('ready', i, flush=True)\n    while True:\n        time.sleep(0.1)"
    )
    msg_id = live_kernel.send("mp.spawn(forever, nprocs=2)")
    while True:  # until process 0 is in its loop
        msg = live_kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and "ready 0" in msg["content"].get("text", "").split("\n"):
            break
    time.sleep(0.5)
    start = time.monotonic()
    live_kernel.km.interrupt_kernel()
    reply, outputs = live_kernel.collect(msg_id, timeout=30)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - start < 5
    (error,) = [o for o in outputs if o["output_type"] == "error"]
    assert re.fullmatch(two_ranks_stopped("5", "line {} of forever's cell"), error["evalue"]), error["evalue"]
    assert len(error["traceback"]) == 1, error["traceback"]
    assert live_kernel.text("print(psutil.Process().children(recursive=True))").strip() == "[]"
