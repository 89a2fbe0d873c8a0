"""Ranks that can never meet, in a real ipykernel: the launch ends within seconds of it (not at the collective
timeout) with one sentence naming each rank's collective and cell line; waits that will end are left alone; an
interrupt, a timeout and a background job name each rank's place; accelerate's join_uneven_inputs works on CPU
ranks, as accelerate's own test script checks it."""

from __future__ import annotations

import re
import time

SETUP = "%load_ext accel_magic\nimport torch\nimport torch.distributed as dist\nkeep = 'before'"
TRAIN = "%%accel_train -n 2 --timeout 60"
GLOO = "%%accel_train -n 2 --timeout 60 --allreduce gloo"
NEVER_MEET = "every rank must reach the same collectives in the same order; nothing was brought back."
# DDP's steps, one more on rank 0: rank 1 goes on to the barrier while rank 0 waits in its gradients' all-reduce.
UNEVEN_STEPS = """model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
for step in range(3 if accelerator.is_main_process else 2):
    model(torch.ones(2, 4)).sum().backward()
accelerator.wait_for_everyone()"""
HAND_OFF = "import accel_magic.launch.shm as shm; shm.HAND_OFF = 'always'"  # the ranks average in their own thread

# (how the cell is launched, its body, the sentence it ends with, before NEVER_MEET)
MISMATCHES = [
    (TRAIN, "t = torch.ones(2)\nif accelerator.is_main_process:\n    accelerator.gather(t)\nelse:\n"
     "    accelerator.wait_for_everyone()",
     "rank 0 waits in gather \\((all_gather_into_tensor|all_gather)\\) at cell line 3, "
     "rank 1 in wait_for_everyone \\(barrier\\) at cell line 5"),
    (TRAIN, "if accelerator.process_index == 0:\n    dist.barrier()",
     "rank 0 waits in barrier at cell line 2, and rank 1 had finished the cell"),
    (TRAIN, "for batch in range(3 if accelerator.is_main_process else 2):\n"
     "    accelerator.gather_for_metrics(torch.ones(1))\naccelerator.wait_for_everyone()",
     "rank 0 waits in gather_for_metrics \\((all_gather_into_tensor|all_gather)\\) at cell line 2, "
     "rank 1 in wait_for_everyone \\(barrier\\) at cell line 3"),
    (TRAIN, "from accelerate.utils import broadcast\nt = torch.ones(2)\nif accelerator.is_main_process:\n"
     "    accelerator.reduce(t)\nelse:\n    broadcast(t)",
     "rank 0 waits in reduce \\(all_reduce\\) at cell line 4, rank 1 in broadcast at cell line 6"),
    (TRAIN, "t = torch.ones(2)\nif accelerator.is_main_process:\n    accelerator.pad_across_processes(t)\nelse:\n"
     "    dist.barrier()",
     "rank 0 waits in pad_across_processes \\((all_gather_into_tensor|all_gather)\\) at cell line 3, "
     "rank 1 in barrier at cell line 5"),
    (TRAIN, "if accelerator.is_main_process:\n    dist.all_gather_object([None, None], 1)\nelse:\n"
     "    dist.broadcast_object_list([1], src=1)",
     "rank 0 waits in all_gather_object at cell line 2, rank 1 in broadcast_object_list at cell line 4"),
    (GLOO, UNEVEN_STEPS,
     "rank 0 waits in backward \\(DDP's gradient all-reduce\\) at cell line 3, "
     "rank 1 in wait_for_everyone \\(barrier\\) at cell line 4"),
    (TRAIN, UNEVEN_STEPS,
     "rank 0 waits in backward \\(DDP's gradient all-reduce\\) at cell line 3, "
     "rank 1 in wait_for_everyone \\(barrier\\) at cell line 4"),
    (TRAIN, f"{HAND_OFF}\n{UNEVEN_STEPS}",
     "rank 0 waits in backward \\(DDP's gradient all-reduce\\) at cell line 4, "
     "rank 1 in wait_for_everyone \\(barrier\\) at cell line 5"),
]  # fmt: skip


def test_ranks_that_can_never_meet_end_at_once_naming_each_ranks_collective_and_line(kernel_run) -> None:
    launches = [(f"{magic}\nkeep = 'changed'\n{body}", "print(keep)")
                for magic, body, _ in MISMATCHES]  # fmt: skip
    after = "%%accel_train -n 2\nafter = accelerator.num_processes"
    cells = kernel_run(SETUP, *(cell for launch in launches for cell in launch), after, "print(after)",
                       allow_errors=True, timeout=600)  # fmt: skip
    for number, (_, body, words) in enumerate(MISMATCHES):
        cell = 1 + 2 * number
        (error,) = [o for o in cells.outputs(cell) if o["output_type"] == "error"]
        assert error["ename"] == "LaunchError", body
        # one line each (the body's line numbers count from the `keep` line, which is cell line 1)
        assert re.fullmatch(f"{shifted(words)}: {re.escape(NEVER_MEET)}", error["evalue"]), (body, error["evalue"])
        assert len(error["traceback"]) == 1, error["traceback"]
        assert cells.text(cell + 1).strip() == "before", body  # nothing changed
    assert cells.text(len(cells.nb.cells) - 1).strip() == "2"  # the next launch works


def shifted(words: str) -> str:
    """The cell lines of `words` one further on: the launched cell starts with a line of its own."""
    return re.sub(r"cell line (\d+)", lambda m: f"cell line {int(m[1]) + 1}", words)


def test_waits_that_will_end_are_left_alone(kernel_run) -> None:
    # Rank 0 evaluates (computes) for 3 s while rank 1 waits at a barrier; then, for two DDP steps, rank 1
    # computes 1.3 s more than rank 0 in each, which waits in its gradients' all-reduce meanwhile; then rank 1
    # sleeps before each of two all-reduces that rank 0 waits in. Each wait is longer than places.STEADY (1 s).
    cell = """%%accel_train -n 2 --timeout 60
import time
def compute(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.randn(64, 64) @ torch.randn(64, 64)
if accelerator.is_main_process:
    compute(3)
accelerator.wait_for_everyone()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
for step in range(2):
    if not accelerator.is_main_process:
        compute(1.3)
    model(torch.ones(2, 4)).sum().backward()
for step in range(2):
    if not accelerator.is_main_process:
        time.sleep(1.3)
    dist.all_reduce(torch.ones(1))
met = True"""
    cells = kernel_run(SETUP, cell, "print(met)", timeout=300)
    assert cells.text(2).strip() == "True"


def test_an_interrupt_a_timeout_and_a_background_job_name_each_ranks_place(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP)
    # rank 0 waits at a barrier while rank 1 computes: nothing to flag, and the interrupt names both places
    msg_id = k.send(
        "%%accel_train -n 2\nimport time\nif accelerator.is_main_process:\n    dist.barrier()\nelse:\n"
        "    print('ready', flush=True)\n    while True: time.sleep(0.05)"
    )
    wait_for_text(k, msg_id, "[rank 1] ready")
    time.sleep(2)  # rank 0's place is sampled
    k.km.interrupt_kernel()
    reply, _ = k.collect(msg_id, timeout=30)
    assert (reply["ename"], reply["evalue"]) == (
        "KeyboardInterrupt",
        "the 2 ranks were stopped (rank 0 was in barrier at cell line 3, rank 1 at cell line 6)",
    )
    # the same, until the collective timeout
    timed_out = k.text(
        "try:\n    get_ipython().run_cell_magic('accel_train', '-n 2 --timeout 3', 'import time\\n"
        "if accelerator.is_main_process:\\n    dist.barrier()\\nelse:\\n    time.sleep(8)')\n"
        "except Exception as err:\n    print(err.headline)",
        timeout=60,
    )
    headline = timed_out.splitlines()[-1]
    assert headline.startswith("rank 0: a collective waited more than 3 s (--timeout)"), timed_out
    assert headline.endswith(
        "; rank 0 was in barrier at cell line 3, rank 1 at cell line 5); the other ranks were stopped."
    )
    # in the background: the job's places while it runs, and its error once stopped
    k.execute(
        "%%accel_train -n 2 --background\nimport time\nif accelerator.is_main_process:\n    dist.barrier()\n"
        "else:\n    while True: time.sleep(0.05)"
    )
    deadline = time.monotonic() + 60
    places, both = "", "{0: 'in barrier at cell line 3', 1: 'at cell line 5'}"
    while places.strip() != both and time.monotonic() < deadline:  # each rank's place once its sampler wrote it
        time.sleep(0.3)
        places = k.text("print(accel_result.places)")
    assert places.strip() == both, places
    table = ""  # the job's table shows the same places at its next refresh (jobs.REFRESH: half a second later)
    while "in barrier at cell line 3" not in table and time.monotonic() < deadline:
        time.sleep(0.3)
        table = k.text("print(accel_result.view.table.value)")
    assert "<td" in table and "in barrier at cell line 3" in table, table
    k.execute("accel_result.stop()")
    told, error = k.text("print(accel_result.error)").strip().splitlines()  # the first: the end, told at this cell
    assert told.startswith("Background launch (accel_result): the 2 ranks were stopped (rank 0 was in barrier")
    assert error == "the 2 ranks were stopped (rank 0 was in barrier at cell line 3, rank 1 at cell line 5)"


def wait_for_text(kernel, msg_id: str, line: str) -> None:
    while True:
        msg = kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and line in msg["content"].get("text", "").split("\n"):
            return


def test_accelerates_join_uneven_inputs_works_on_cpu_ranks_as_its_own_test_script_checks(kernel_run) -> None:
    tests = (
        "test_can_join_uneven_inputs",
        "test_join_can_override_even_batches",
        "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches",
    )
    script = "from accelerate.test_utils.scripts import test_distributed_data_loop as script\n"
    script += "".join(f"script.{name}()\nprint('passed', {name!r})\n" for name in tests)
    # uneven batches without even_batches: every rank ends with the same weights, as torch's Join gives
    uneven = """%%accel_train -n 2 --no-return
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset
accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
data = TensorDataset(torch.randn(5, 3), torch.randn(5, 1))
model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data))
steps = 0
with accelerator.join_uneven_inputs([model]):
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
same = bool((accelerator.gather(weights[None]) == weights).all())
counts = accelerator.gather(torch.tensor([steps])).tolist()
accelerator.print(same, counts)"""
    cells = kernel_run(SETUP, f"%%accel_train -n 2 --no-return\n{script}", uneven, timeout=300)
    passed = re.findall(r"^passed (\w+)$", cells.text(1), re.MULTILINE)  # rank 0's
    assert passed == list(tests), cells.text(1)
    assert cells.text(2).strip().endswith("True [3, 2]"), cells.text(2)
