"""Whatever the code builds first in a rank (accelerate's `PartialState()` or `Accelerator()`, Hugging Face's
`TrainingArguments`, or nothing before its own torch.distributed calls), every rank of every kind of launch is in
the launch's one group: the distributed type, `num_processes` and its own `process_index`, and
`main_process_first()` lets rank 0 through first."""

from __future__ import annotations

import re

import pytest
from ports import free_port

FIRSTS = ("PartialState", "Accelerator", "TrainingArguments", "nothing")

# `report(first, log)` builds `first`, then says what accelerate's state and torch.distributed see; inside
# main_process_first() rank 0 waits 0.5 s before it writes its index to `log`, so a rank that is alone (its own
# main process) writes before it.
REPORT = """
import os, tempfile, time
import torch.distributed as dist

def report(first, log):
    if first == "PartialState":
        from accelerate import PartialState
        PartialState()
    elif first == "Accelerator":
        from accelerate import Accelerator
        Accelerator()
    elif first == "TrainingArguments":
        from transformers import TrainingArguments
        TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[])
    torch_says = f"torch rank {dist.get_rank()} of {dist.get_world_size()}"
    from accelerate import Accelerator, PartialState
    state = PartialState()
    with state.main_process_first():
        if state.is_main_process:
            time.sleep(0.5)
        with open(log, "a") as f:
            f.write(f"{state.process_index} ")
    accelerator = Accelerator()
    print(f"{first} first: {accelerator.distributed_type} num_processes={accelerator.num_processes} "
          f"process_index={accelerator.process_index} ({torch_says})")

"""
LOGS = f"logs = {{first: os.path.join(tempfile.mkdtemp(), 'order') for first in {FIRSTS!r}}}"

ORDERS = "print({first: open(path).read().split() for first, path in logs.items()})"


def check(out: str, orders: str, ranks: range = range(2)) -> None:
    """Every first object: each rank MULTI_CPU with the launch's size and its own index, rank 0 through
    main_process_first() before the others."""
    size = len(ranks)
    for first in FIRSTS:
        for rank in ranks:
            assert re.search(
                rf"{first} first: DistributedType\.MULTI_CPU num_processes={size} process_index={rank} "
                rf"\(torch rank {rank} of {size}\)",
                out,
            ), (first, rank, out)
    seen = eval(orders)  # {first: [process indexes in the order they passed main_process_first]}
    for first in FIRSTS:
        assert seen[first][0] == str(ranks[0]) and sorted(seen[first]) == sorted(map(str, ranks)), (first, seen)


def test_the_drop_in(kernel_run) -> None:
    launches = "\n".join(f"notebook_launcher(report, ({f!r}, logs[{f!r}]), num_processes=2)" for f in FIRSTS)
    cells = kernel_run(REPORT + LOGS, "from accel_magic import notebook_launcher\n" + launches, ORDERS)
    check(cells.text(1), cells.text(2))


def test_accelerates_own_launcher_after_setup(kernel_run) -> None:
    launches = "\n".join(f"notebook_launcher(report, ({f!r}, logs[{f!r}]), num_processes=2)" for f in FIRSTS)
    cells = kernel_run(
        "%load_ext accel_magic",
        "%accel_setup --quiet",
        REPORT + LOGS,
        "from accelerate import notebook_launcher\n" + launches,
        ORDERS,
    )
    out = cells.text(3)
    check(out, cells.text(4))
    for first in FIRSTS:  # whole lines, the other rank's marked as in training cells
        assert re.search(rf"^\[rank 1\] {first} first: DistributedType", out, re.MULTILINE), out


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_training_cells(kernel_run, background: bool) -> None:
    option = " --background" if background else ""
    cells = [f"%%accel_train -n 2{option}\nreport({f!r}, logs[{f!r}])" for f in FIRSTS]
    if background:  # a background job's lines are its own, in `accel_result.output` once it ended
        cells = [x for c in cells for x in (c, "%accel_wait\nprint(accel_result.output)")]
    ran = kernel_run("%load_ext accel_magic", REPORT + LOGS, *cells, ORDERS)
    out = "".join(ran.text(i) for i in range(2, 2 + len(cells)))
    check(out, ran.text(2 + len(cells)))


def test_the_drop_in_across_two_kernels(live_kernels, tmp_path) -> None:
    """Two kernels stand in for two machines (the rendezvous on loopback); every first object, each launch four
    ranks, each kernel its own two."""
    kernels = [live_kernels(), live_kernels()]
    for kernel in kernels:
        kernel.text(REPORT + "from accel_magic import notebook_launcher")
    for first in FIRSTS:
        port = free_port()
        log = tmp_path / f"{first}.order"
        ids = [
            k.send(
                f"notebook_launcher(report, ({first!r}, {str(log)!r}), num_processes=2, num_nodes=2, node_rank={r}, "
                f"master_addr='127.0.0.1', use_port='{port}', rdzv_conf={{'timeout': 60}})"
            )
            for r, k in enumerate(kernels)
        ]
        texts = ["".join(o.get("text", "") for o in k.collect(i, 120)[1]) for k, i in zip(kernels, ids, strict=True)]
        for node, text in enumerate(texts):
            for rank in (2 * node, 2 * node + 1):
                assert re.search(
                    rf"{first} first: DistributedType\.MULTI_CPU num_processes=4 process_index={rank} "
                    rf"\(torch rank {rank} of 4\)",
                    text,
                ), (first, rank, text)
        order = log.read_text().split()
        assert order[0] == "0" and sorted(order) == ["0", "1", "2", "3"], (first, order)
