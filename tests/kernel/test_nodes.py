"""Several machines from notebooks: kernels that each run `%%accel_train --nodes 2 --node-rank R --rdzv-endpoint`
train as one group. Two kernels on this machine stand in for two machines (the rendezvous on loopback); each
cell is started without waiting for the other."""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil
import pytest
from ports import free_port

SETUP = """\
%load_ext accel_magic
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

WHERE = """\
from accel_magic import notebook_launcher
def where():
    from accelerate import Accelerator, PartialState
    with PartialState().main_process_first():  # built first, as Hugging Face's examples do
        a = Accelerator()
    return a.process_index, a.num_processes, a.local_process_index
"""


@pytest.fixture
def two_kernels(live_kernels):
    """Two kernels, each with accel_magic loaded and the same seeded model and optimizer."""
    kernels = [live_kernels(), live_kernels()]
    for kernel in kernels:
        kernel.text(SETUP)
    return kernels


def train_on(kernels: list[Any], options: str, body: str, timeout: float = 120,
             node0_after: float = 0.0) -> list[tuple[dict, str, float]]:  # fmt: skip
    """Start the same cell on every kernel, node rank = its index, node 0 last (`node0_after` seconds after the
    others); each kernel's reply, text, and seconds from the first start to that cell's own end (each kernel is
    read in a thread of its own, so one cell's end is not seen late while another is still running)."""
    cell = "%%accel_train " + options + "\n" + body
    started = time.monotonic()
    ids = {r: k.send(cell.replace("{R}", str(r))) for r, k in reversed(list(enumerate(kernels))) if r}
    time.sleep(node0_after)
    ids[0] = kernels[0].send(cell.replace("{R}", "0"))

    def ended(r: int) -> tuple[dict, str, float]:
        reply, outputs = kernels[r].collect(ids[r], timeout)
        took = time.monotonic() - started
        text = "".join(
            o.get("text", "") or o.get("data", {}).get("text/plain", "") or "\n".join(o.get("traceback", []))
            for o in outputs
        )
        return reply, re.sub(r"\x1b\[[0-9;]*m", "", text), took

    with ThreadPoolExecutor(len(kernels)) as pool:
        return list(pool.map(ended, range(len(kernels))))


def no_children(kernel: Any) -> str:
    """The kernel's child processes. psutil 5.9 (Colab's) can raise while a process it lists goes away: asked
    again then; any other error is shown as the answer."""
    cell = (
        "import psutil, time\nfor _ in range(20):\n    try:\n        kids = psutil.Process().children(recursive=True)\n"
        "        break\n    except psutil.Error as err:\n        kids = repr(err)\n        time.sleep(0.1)\nprint(kids)"
    )
    reply, outputs = kernel.execute(cell)
    if reply["status"] != "ok":
        return f"{reply['ename']}: {reply['evalue']}"
    return "".join(o.get("text", "") for o in outputs).strip()


def test_two_kernels_train_as_one_group_of_four_ranks_and_end_with_identical_weights(two_kernels) -> None:
    port = free_port()
    body = """\
model, opt = accelerator.prepare(model, opt)
torch.manual_seed(accelerator.process_index)  # every rank its own data
for _ in range(5):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
print(f"rank {accelerator.process_index} of {accelerator.num_processes}, local {accelerator.local_process_index}")
whose = accelerator.process_index  # each kernel gets this back from its own node's first rank
"""
    options = f"-n 2 --nodes 2 --node-rank {{R}} --rdzv-endpoint 127.0.0.1:{port}"
    results = train_on(two_kernels, options, body, node0_after=3)  # node 1 waits for node 0, quietly
    for reply, text, _ in results:
        assert reply["status"] == "ok", text
        assert "c10d" not in text and "Traceback" not in text, text
    node0, node1 = (text for _, text, _ in results)
    assert "node 0 of 2 (ranks 0-1 of 4, rendezvous at 127.0.0.1:" in node0
    assert re.search(r"^rank 0 of 4, local 0$", node0, re.M) and "[rank 1] rank 1 of 4, local 1" in node0
    assert "node 1 of 2 (ranks 2-3 of 4" in node1
    assert "[rank 2] rank 2 of 4, local 0" in node1 and "[rank 3] rank 3 of 4, local 1" in node1
    assert "rank 0 of 4" not in node1  # each kernel shows its own ranks only
    weights = [k.text("print(type(model).__name__, model.weight.tolist(), model.bias.tolist())") for k in two_kernels]
    assert weights[0].startswith("Linear [[") and weights[0] == weights[1]
    untrained = two_kernels[0].text(
        "torch.manual_seed(0); print(type(model).__name__, torch.nn.Linear(8, 2).weight.tolist())"
    )
    assert untrained.split(" [[")[1] not in weights[0]  # the weights did change
    for kernel, first in zip(two_kernels, (0, 2), strict=True):  # node 0's kernel: rank 0's; node 1's: rank 2's
        assert no_children(kernel) == "[]"
        assert kernel.text("print(accel_result.ok, accel_result.first_rank, whose)").strip() == f"True {first} {first}"


def test_a_raise_on_node_1_ends_both_cells_within_seconds_and_node_1_names_the_rank_and_line(two_kernels) -> None:
    port = free_port()
    body = """\
import time
model, opt = accelerator.prepare(model, opt)
accelerator.wait_for_everyone()
if accelerator.process_index == 1:
    raise ValueError("bad batch on node 1")
time.sleep(120)  # the other rank would wait here long after node 1 failed
accelerator.wait_for_everyone()
"""
    results = train_on(two_kernels, f"-n 1 --nodes 2 --node-rank {{R}} --rdzv-endpoint 127.0.0.1:{port}", body)
    (reply0, node0, took0), (reply1, node1, took1) = results
    assert reply0["status"] == reply1["status"] == "error"
    assert "rank 1 raised ValueError: bad batch on node 1" in node1 and "Cell line 5" in node1
    assert "the launch failed on another node (rank 1: ValueError: bad batch on node 1)" in node0, node0
    assert "that node's cell names the rank and the line" in node0
    assert abs(took0 - took1) < 5, (took0, took1)  # node 0's cell ends soon after node 1's, not after its sleep
    assert max(took0, took1) < 60, (took0, took1)  # not the 120 s sleep, nor the 900 s collective timeout
    for kernel in two_kernels:
        assert no_children(kernel) == "[]"
        assert kernel.text("print(accel_result.ok)").strip() == "False"
    with socket.socket() as s:  # node 0's rendezvous store is gone
        s.bind(("127.0.0.1", port))


def test_a_node_that_never_arrives_ends_the_cell_after_the_rendezvous_timeout_in_one_sentence(live_kernel) -> None:
    live_kernel.text(SETUP)
    port = free_port()
    started = time.monotonic()
    reply, text, _ = train_on(
        [live_kernel], f"-n 1 --nodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:{port} --timeout 3", "print('never')"
    )[0]
    took = time.monotonic() - started
    assert reply["status"] == "error" and reply["ename"] == "LaunchError"
    error = text.split("LaunchError: ", 1)[1].strip()
    assert error == (
        f"this node could not form one group with the other 1 node at 127.0.0.1:{port} (1 of the 2 nodes joined "
        "within 3 s): start the cell on every node within 3 s (--timeout), each with its own --node-rank and the "
        "same --nodes and --rdzv-endpoint; nothing was trained."
    )
    assert "never" not in text and "c10d" not in text and "Timed out" not in text and "clients" not in text
    assert 3 <= took < 3 + 20, took  # the rendezvous timeout, and a loaded 2-core machine's slack
    assert no_children(live_kernel) == "[]"
    with socket.socket() as s:  # the rendezvous port is free again
        s.bind(("127.0.0.1", port))


def test_a_node_whose_node_0_never_answers_says_so_in_one_sentence_without_torchs_retries(live_kernel) -> None:
    live_kernel.text(SETUP)
    port = free_port()
    cell = f"%%accel_train -n 1 --nodes 2 --node-rank 1 --rdzv-endpoint 127.0.0.1:{port} --timeout 3\nprint('never')"
    _, outputs = live_kernel.execute(cell)
    text = "".join(o.get("text", "") or o.get("evalue", "") for o in outputs)
    assert "could not form one group with the other 1 node at 127.0.0.1:" in text, text
    assert "(node 0 did not answer within 3 s)" in text and "c10d" not in text and "never" not in text
    assert no_children(live_kernel) == "[]"


def test_a_drop_in_call_whose_node_0_never_answers_names_the_drop_ins_arguments(live_kernel) -> None:
    live_kernel.text(WHERE)
    port = free_port()
    reply, outputs = live_kernel.execute(
        f"notebook_launcher(where, num_processes=1, num_nodes=2, node_rank=1, rdzv_endpoint='127.0.0.1:{port}', "
        "rdzv_conf={'timeout': 3})"
    )
    assert reply["status"] == "error" and reply["ename"] == "LaunchError", outputs
    assert reply["evalue"] == (
        f"this node could not form one group with the other 1 node at 127.0.0.1:{port} (node 0 did not answer "
        "within 3 s): call notebook_launcher on every node within 3 s (rdzv_conf's 'timeout'), each with its own "
        "node_rank and the same num_nodes, rdzv_id and rdzv_endpoint (or master_addr and use_port); nothing was "
        "trained."
    )
    assert no_children(live_kernel) == "[]"


def test_the_rendezvous_listens_on_the_endpoints_address_only(live_kernel) -> None:
    live_kernel.text(SETUP)
    port = free_port()
    msg_id = live_kernel.send(
        f"%%accel_train -n 1 --nodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:{port} --timeout 4\nprint('never')"
    )
    time.sleep(2)  # node 0 now waits for node 1
    kernel = psutil.Process(live_kernel.km.provisioner.process.pid)
    # psutil before 6.0 (Colab's 5.9.5) calls it connections()
    connections = getattr(kernel, "net_connections", None) or kernel.connections
    addresses = {c.laddr for c in connections("inet") if c.status == psutil.CONN_LISTEN}
    live_kernel.collect(msg_id, 60)
    assert ("127.0.0.1", port) in addresses, addresses
    assert not any(a.port == port and a.ip != "127.0.0.1" for a in addresses), addresses


def test_the_drop_in_launcher_across_two_kernels_gives_each_its_first_ranks_value(two_kernels) -> None:
    port = free_port()
    for kernel in two_kernels:
        kernel.text(WHERE)
    ids = [
        k.send(
            f"print(notebook_launcher(where, num_processes=2, num_nodes=2, node_rank={r}, "
            f"master_addr='127.0.0.1', use_port='{port}', rdzv_backend='c10d', rdzv_conf={{'timeout': 60}}))"
        )
        for r, k in enumerate(two_kernels)
    ]
    texts = ["".join(o.get("text", "") for o in k.collect(i, 120)[1]) for k, i in zip(two_kernels, ids, strict=True)]
    assert texts[0].strip().endswith("(0, 4, 0)"), texts[0]
    assert texts[1].strip().endswith("(2, 4, 0)"), texts[1]


def test_the_drop_in_launcher_meets_at_the_rdzv_endpoint_under_the_rdzv_id_given(two_kernels) -> None:
    port = free_port()
    for kernel in two_kernels:
        kernel.text(WHERE)
    ids = [  # master_addr and use_port left as accelerate's defaults: the endpoint alone says where to meet
        k.send(
            f"print(notebook_launcher(where, num_processes=2, num_nodes=2, node_rank={r}, "
            f"rdzv_endpoint='127.0.0.1:{port}', rdzv_id='digits-run', rdzv_conf={{'timeout': 60, 'rank': {r}}}))"
        )
        for r, k in reversed(list(enumerate(two_kernels)))  # node 1 first: it waits for node 0
    ][::-1]
    texts = ["".join(o.get("text", "") for o in k.collect(i, 120)[1]) for k, i in zip(two_kernels, ids, strict=True)]
    for r, text in enumerate(texts):
        assert f"node {r} of 2 (ranks {2 * r}-{2 * r + 1} of 4, rendezvous at 127.0.0.1:{port})" in text, text
    assert texts[0].strip().endswith("(0, 4, 0)"), texts[0]  # node 0's kernel: rank 0's value
    assert texts[1].strip().endswith("(2, 4, 0)"), texts[1]  # node 1's kernel: rank 2's value
    for kernel in two_kernels:
        assert no_children(kernel) == "[]"
