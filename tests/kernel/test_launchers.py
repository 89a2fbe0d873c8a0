"""notebook_launcher cells in a real kernel: accel_magic's drop-in, and accelerate's own after %accel_setup."""

from __future__ import annotations

import inspect
import re

import pytest

SETUP = "%load_ext accel_magic"

TRAINING_FUNCTION = """
import os, torch
from accelerate import Accelerator

def training_function(scale):
    accelerator = Accelerator()
    state = accelerator.state
    print(f"rank {accelerator.process_index}: {state.distributed_type} world={accelerator.num_processes} "
          f"threads={torch.get_num_threads()}")
    total = accelerator.reduce(torch.tensor([float(accelerator.process_index + 1)]), reduction="sum")
    return {"total": total * scale, "rank": accelerator.process_index}
"""

CLEAN = """
import psutil
me = psutil.Process()
print('children', me.children(recursive=True))
"""


def test_the_drop_in_has_accelerates_signature() -> None:
    import accelerate

    from accel_magic import notebook_launcher

    ours, theirs = inspect.signature(notebook_launcher), inspect.signature(accelerate.notebook_launcher)
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]


def test_the_drop_in_forms_one_gloo_group_returns_rank_0s_value_and_leaves_the_kernel_clean(kernel_run) -> None:
    cells = kernel_run(
        TRAINING_FUNCTION,
        "from accel_magic import notebook_launcher\n"
        "result = notebook_launcher(training_function, args=(10,), num_processes=2)\n"
        "print('returned', result)",
        "second = notebook_launcher(training_function, (1,), 2)\nprint('again', second['total'].item())",
        CLEAN,
    )
    out = cells.text(1)
    assert "rank 0: DistributedType.MULTI_CPU world=2 threads=1" in out, out
    assert "[rank 1] rank 1: DistributedType.MULTI_CPU world=2 threads=1" in out, out
    assert "returned {'total': tensor([30.]), 'rank': 0}" in out
    assert "again 3.0" in cells.text(2)  # a fresh port for every launch: the second one works too
    assert cells.text(3).strip() == "children []"


def test_the_drop_in_names_the_failing_rank_and_the_next_launch_works(kernel_run) -> None:
    cells = kernel_run(
        TRAINING_FUNCTION,
        "from accel_magic import notebook_launcher\n"
        "def fails():\n"
        "    accelerator = Accelerator()\n"
        "    if accelerator.process_index == 1:\n"
        "        raise ValueError('bad batch')\n"
        "    accelerator.wait_for_everyone()\n"
        "notebook_launcher(fails, num_processes=2)",
        "print(notebook_launcher(training_function, (1,), num_processes=2)['rank'])",
        allow_errors=True,
    )
    (error,) = [o for o in cells.outputs(1) if o["output_type"] == "error"]
    assert error["ename"] == "LaunchError"
    assert error["evalue"] == "rank 1 raised ValueError: bad batch; the other ranks were stopped."
    assert "raise ValueError('bad batch')" in "\n".join(error["traceback"])
    assert cells.text(2).strip().endswith("0")


FLAKY = """
import os
from accelerate import Accelerator

def flaky(good_from):
    accelerator = Accelerator()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if accelerator.process_index == 1 and restart < good_from:
        raise RuntimeError(f"not yet ({restart})")
    accelerator.wait_for_everyone()
    return restart
"""


def test_the_drop_in_restarts_failed_ranks_and_returns_the_value_of_the_run_that_succeeded(kernel_run) -> None:
    cells = kernel_run(
        FLAKY + "from accel_magic import notebook_launcher",
        "print('returned', notebook_launcher(flaky, (2,), num_processes=2, max_restarts=3))",
        "notebook_launcher(flaky, (5,), num_processes=2, max_restarts=1)",
        allow_errors=True,
    )
    lines = [line for line in cells.text(1).splitlines() if line.startswith("Restarting")]
    assert lines == [
        "Restarting the 2 ranks (1 of 3): rank 1 raised RuntimeError: not yet (0); the other ranks were stopped.",
        "Restarting the 2 ranks (2 of 3): rank 1 raised RuntimeError: not yet (1); the other ranks were stopped.",
    ], cells.text(1)
    assert "returned 2" in cells.text(1)
    out = cells.text(2)
    assert "Restarting the 2 ranks (1 of 1): rank 1 raised RuntimeError: not yet (0)" in out, out
    (error,) = [o for o in cells.outputs(2) if o["output_type"] == "error"]
    assert error["ename"] == "LaunchError" and error["evalue"].startswith("rank 1 raised RuntimeError: not yet (1)")


def test_a_failure_of_the_drop_in_is_torch_elastics_child_failed_error_carrying_the_ranks_exception(
    kernel_run,
) -> None:
    cells = kernel_run(
        FLAKY + "from accel_magic import notebook_launcher",
        "from torch.distributed.elastic.multiprocessing.errors import ChildFailedError\n"
        "try:\n"
        "    notebook_launcher(flaky, (1,), num_processes=2)\n"
        "except ChildFailedError as err:\n"
        "    rank, failure = err.get_first_failure()\n"
        "    print('caught', type(err).__name__, rank, failure.message, '|', err)",
    )
    assert (
        "caught LaunchError 1 RuntimeError: not yet (0) | rank 1 raised RuntimeError: not yet (0); the other ranks "
        "were stopped." in cells.text(1)
    ), cells.text(1)


# What the drop-in refuses, and the sentence that says so: each call in a cell of one kernel, which must keep
# everything the notebook had.
CANNOT_HONOUR = [
    ("master_addr='10.0.0.2'", r"master_addr='10.0.0.2' is for a launch across machines: add num_nodes=M"),
    ("num_nodes=2, node_rank=2", r"node_rank must be below num_nodes \(2\): give each node a rank from 0 to 1\."),
    ("num_nodes=2, rdzv_backend='etcd'", r"rdzv_backend must be 'static' or 'c10d', not 'etcd'"),
    ("num_nodes=2, rdzv_conf={'join_timeout': 5}", r"rdzv_conf takes only 'timeout' .* not join_timeout"),
    (
        "num_nodes=2, node_rank=1, rdzv_conf={'rank': 0}",
        r"^rdzv_conf=\{'rank': 0\} is not read \(accelerate numbers the nodes by node_rank, here 1\): give this "
        r"node's rank as node_rank and leave 'rank' out of rdzv_conf\.$",
    ),
    ("max_restarts=-1", r"^max_restarts must be a whole number of at least 0, not -1\.$"),
    (
        "num_nodes=2, rdzv_endpoint='127.0.0.1:29400', max_restarts=1",
        r"^Restarts are for ranks on one machine: leave max_restarts at 0 across machines, or train on one\.$",
    ),
    ("log_line_prefix_template='${rank}: '", r"log_line_prefix_template is not supported"),
    ("num_processes=0", r"num_processes must be a whole number of at least 1, not 0\."),
    ("num_processes=2, mixed_precision='fp17'", r"mixed"),
    ("num_processes=2, use_port='http'", r"use_port must be a port number from 1 to 65535, not 'http'\."),
]


def test_what_the_drop_in_cannot_honour_is_one_sentence(kernel_run) -> None:
    cells = kernel_run(
        "from accel_magic import notebook_launcher\nkeep = 'mine'",
        *(f"notebook_launcher(print, {call})" for call, _ in CANNOT_HONOUR),
        "print(keep)",
        allow_errors=True,
    )
    for number, (call, says) in enumerate(CANNOT_HONOUR, start=1):
        (error,) = [o for o in cells.outputs(number) if o["output_type"] == "error"]
        assert error["ename"] == "LauncherError" and re.search(says, error["evalue"]), (call, error)
        assert len(error["traceback"]) == 1, call  # one sentence, no traceback
    assert cells.text(len(CANNOT_HONOUR) + 1).strip() == "mine"


def test_the_drop_in_uses_the_port_it_is_given_and_refuses_one_in_use(kernel_run) -> None:
    cells = kernel_run(
        TRAINING_FUNCTION,
        "import socket\nfrom accel_magic import notebook_launcher\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "print(notebook_launcher(training_function, (1,), 2, use_port=str(port))['rank'])",
        "busy = socket.socket(); busy.bind(('127.0.0.1', 0)); busy.listen()\n"
        "notebook_launcher(training_function, (1,), 2, use_port=str(busy.getsockname()[1]))",
        allow_errors=True,
    )
    assert cells.text(1).strip().endswith("0")
    assert re.search(
        r"TrainError: Port \d+ is in use: choose another with use_port, or leave use_port out\.", cells.text(2)
    )


def test_accelerates_own_launcher_works_after_setup_even_when_the_notebooks_accelerator_was_used(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%accel_setup --quiet",
        TRAINING_FUNCTION + "from accelerate import notebook_launcher\nprint(accelerator.device)",
        "notebook_launcher(training_function, args=(1,), num_processes=2)",
        "print(accelerator.device, accelerator.num_processes, type(notebook_launcher).__module__)",
    )
    out = cells.text(3)
    assert "DistributedType.MULTI_CPU world=2" in out, out  # one gloo group, not two ranks training alone
    assert cells.text(4).split()[:2] == ["cpu", "1"]  # the notebook's accelerator works as before


def test_accelerates_launcher_imported_before_setup_still_works_after_it(kernel_run) -> None:
    cells = kernel_run(
        TRAINING_FUNCTION + "from accelerate import notebook_launcher",
        SETUP,
        "%accel_setup --quiet",
        "notebook_launcher(training_function, args=(1,), num_processes=2)",
    )
    assert "To launch a multi-device training" not in cells.text(3)
    assert re.search(r"rank 0: DistributedType\.\w+ world=\d", cells.text(3)), cells.text(3)


def test_a_launcher_imported_before_setup_that_refuses_says_in_one_sentence_what_to_do(kernel_run) -> None:
    cells = kernel_run(
        TRAINING_FUNCTION + "from accelerate import notebook_launcher",
        SETUP,
        "%accel_setup --quiet\nprint(accelerator.device)",
        "notebook_launcher(training_function, args=(1,), num_processes=2)",
        "from accelerate import notebook_launcher\nnotebook_launcher(training_function, args=(1,), num_processes=2)",
        "int('not a number')",
        allow_errors=True,
    )
    (error,) = [o for o in cells.outputs(3) if o["output_type"] == "error"]
    assert error["ename"] == "ValueError" and len(error["traceback"]) == 1, error
    assert "run `from accelerate import notebook_launcher` again after %accel_setup" in error["traceback"][0]
    assert "DistributedType.MULTI_CPU world=2" in cells.text(4)  # imported again: the launch works
    (plain,) = [o for o in cells.outputs(5) if o["output_type"] == "error"]
    assert len(plain["traceback"]) > 1 and "invalid literal" in plain["evalue"]  # other ValueErrors as always


def test_unload_gives_accelerate_its_own_launcher_back(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%accel_setup --quiet",
        "import accelerate, accelerate.launchers\nwrapped = accelerate.notebook_launcher\n"
        "print(hasattr(wrapped, '__wrapped__'))",
        "%unload_ext accel_magic",
        "print(accelerate.notebook_launcher is wrapped.__wrapped__ is accelerate.launchers.notebook_launcher)",
    )
    assert cells.text(2).strip() == "True"
    assert cells.text(4).strip() == "True"


SCHEDULED = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1))
data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 2))
dl = torch.utils.data.DataLoader(data, batch_size=4)
class Counter:
    def __init__(self): self.seen = 0
    def state_dict(self): return {"seen": self.seen}
    def load_state_dict(self, state): self.seen = state["seen"]
counter = Counter()
"""

TRAIN_TWO_STEPS = """%%accel_train -n 2
def train():
    m, o, d, s = accelerator.prepare(model, opt, dl, sched)
    accelerator.register_for_checkpointing(counter)
    for step, (x, y) in enumerate(d):
        if step == 2:
            break
        accelerator.backward(((m(x) - y) ** 2).mean())
        o.step(); s.step(); o.zero_grad()
        counter.seen += 1
    return s.scheduler.last_epoch, o.param_groups[0]["lr"]
rank_epoch, rank_lr = train()
accelerator.print("ranks", rank_epoch, rank_lr)
"""


def test_schedulers_optimizers_models_and_registered_objects_come_back_and_go_on_in_the_next_cell(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        SCHEDULED + "w0 = model.weight.detach().clone()",
        TRAIN_TWO_STEPS,
        "print(sched.last_epoch == rank_epoch, opt.param_groups[0]['lr'] == rank_lr == sched.get_last_lr()[0],"
        " counter.seen, not torch.equal(model.weight, w0))\nfirst = sched.last_epoch",
        TRAIN_TWO_STEPS,
        "print(sched.last_epoch == rank_epoch == 2 * first, opt.param_groups[0]['lr'] == rank_lr, counter.seen)",
    )
    assert cells.text(3).strip() == "True True 2 True", cells.text(2) + cells.text(3)
    assert cells.text(5).strip() == "True True 4", cells.text(4) + cells.text(5)


def test_interrupting_the_drop_in_stops_every_rank_within_seconds(live_kernel, two_ranks_stopped) -> None:
    import time

    live_kernel.execute("import psutil\nfrom accel_magic import notebook_launcher")
    live_kernel.execute(
        "def forever():\n    import time\n    from accelerate import Accelerator\n    Accelerator()\n"
        "    print('ready', flush=True)\n    while True: time.sleep(0.1)"
    )
    msg_id = live_kernel.send("notebook_launcher(forever, num_processes=2)")
    while True:  # until rank 0 is in its loop
        msg = live_kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and "ready" in msg["content"].get("text", "").split("\n"):
            break
    time.sleep(0.5)  # rank 0 is past its print, in the loop
    start = time.monotonic()
    live_kernel.km.interrupt_kernel()
    reply, outputs = live_kernel.collect(msg_id, timeout=30)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - start < 5
    (error,) = [o for o in outputs if o["output_type"] == "error"]
    assert re.fullmatch(two_ranks_stopped("6", "line {} of forever's cell"), error["evalue"]), error["evalue"]
    assert len(error["traceback"]) == 1, error["traceback"]
    assert live_kernel.text("print(psutil.Process().children(recursive=True))").strip() == "[]"


@pytest.mark.fresh_kernel  # the first launch imports torch before it forks
def test_interrupting_the_drop_in_as_it_starts_ends_in_one_line_and_leaves_nothing(
    live_kernel, two_ranks_stopped
) -> None:
    import time

    live_kernel.execute("import psutil\nfrom accel_magic import notebook_launcher")
    live_kernel.execute(
        "def forever():\n    import time\n    print('ready', flush=True)\n    for _ in range(600): time.sleep(0.05)"
    )
    # The first launch of a kernel imports torch before it forks (seconds): an interrupt then stops it before any
    # rank started. Later launches fork at once, and an interrupt soon after the call lands before or after (or,
    # very soon, before the cell called notebook_launcher at all).
    seen = []
    for delay in (0.3, 0.02, 0.2):
        msg_id = live_kernel.start("notebook_launcher(forever, num_processes=2)")
        time.sleep(delay)
        live_kernel.km.interrupt_kernel()
        reply, outputs = live_kernel.collect(msg_id, timeout=60)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
        (error,) = [o for o in outputs if o["output_type"] == "error"]
        if len(error["traceback"]) > 1:  # it came before the cell called notebook_launcher: IPython's own
            assert "accel_magic" not in "".join(error["traceback"]), error["traceback"]
            seen.append("before the call")
            continue
        assert re.fullmatch(
            r"the launch was stopped before its ranks started|the 2 ranks were stopped|"
            + two_ranks_stopped(r"\d", "line {} of forever's cell", starting=True),
            error["evalue"],
        ), error["evalue"]
        if error["evalue"].startswith("the launch"):
            assert "ready" not in str(outputs)
        assert live_kernel.text("print(psutil.Process().children(recursive=True))").strip() == "[]"
        seen.append(error["evalue"])
    assert seen[0] == "the launch was stopped before its ranks started", seen


FORK_WHILE_A_THREAD_WRITES = """
import os, sys, threading, time
held = threading.Event()

def flushing():  # as the kernel's IOPub thread holds it while it flushes, or its reader of the process's stdout
    with sys.stdout._buffer_lock:
        held.set()
        time.sleep(1.0)

threading.Thread(target=flushing).start()
held.wait()
pid = os.fork()  # as accelerate's own launcher, a DataLoader worker or multiprocessing forks
if pid == 0:
    print("the child prints")
    os._exit(0)
deadline = time.monotonic() + 20
while not (ended := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
    time.sleep(0.05)
if not ended[0]:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print("the child ended" if ended[0] else "the child hung at its first print")
"""


def test_a_fork_while_a_kernel_thread_writes_to_the_output_gives_a_child_that_can_print(kernel_run) -> None:
    cells = kernel_run(SETUP, FORK_WHILE_A_THREAD_WRITES)
    assert "the child ended" in cells.text(1), cells.text(1)
