"""`%%accel_train --background` in a real kernel: the cell returns while the ranks train, other cells run
meanwhile, Stop and failures show in the job, results come in at the next cell (never over a name rebound
meanwhile), one background launch at a time, and a kernel that shuts down or restarts leaves nothing."""

from __future__ import annotations

import glob
import os
import re
import signal
import time

import psutil
import pytest

SETUP = """%load_ext accel_magic
import glob, os, tempfile, psutil, time, torch
def leftovers():
    me = psutil.Process()
    return (me.children(recursive=True),
            [c.laddr for c in (getattr(me, 'net_connections', None) or me.connections)() if c.status == 'LISTEN'],
            sorted(glob.glob(tempfile.gettempdir() + '/torchelastic_*') + glob.glob(tempfile.gettempdir() + '/accel_magic-*')
                   + glob.glob(f'/dev/shm/accel_magic-{os.getpid()}-*')))
before = leftovers()  # the kernel's own sockets
def settled(within=10.0):
    # what the launches left behind: no child, no other listening socket, no folder
    end = time.monotonic() + within
    while leftovers() != before and time.monotonic() < end:
        time.sleep(0.1)
    now = leftovers()
    return now[0], sorted(set(now[1]) - set(before[1])), sorted(set(now[2]) - set(before[2]))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

# The ranks train a model for a little over `seconds`, and note when their loop began and ended.
TRAIN = """%%accel_train -n 2 --background
import time, torch
model, opt = accelerator.prepare(model, opt)
began = time.time()
for step in range(int({seconds} / 0.05)):  # as many steps in every rank: each one averages the gradients
    loss = model(torch.ones(8, 4)).pow(2).mean()
    accelerator.backward(loss)
    opt.step(); opt.zero_grad()
    print("loss", float(loss), flush=True)
    time.sleep(0.05)
span = (began, time.time())
"""

LONG = """%%accel_train -n 2 --background
import time
for step in range(10_000):
    time.sleep(0.01)
    print("step", step, flush=True)
"""


def alive(pids: list[int]) -> list[int]:
    """Those of the processes still running (a zombie has ended; its parent just has not reaped it)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_for(kernel, expression: str, within: float = 60.0) -> None:
    """Poll the kernel (each poll is a cell of its own) until the expression is true."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if kernel.text(f"print(bool({expression}))").strip().endswith("True"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{expression} still false after {within} s")


def test_the_cell_returns_at_once_and_a_foreground_cell_computes_while_the_ranks_train(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP + "mine = id(model)\nweights = model.weight.detach().clone()")
    reply, outputs = k.execute(TRAIN.format(seconds=3))
    assert reply["status"] == "ok"
    assert "2 processes on cpu (gloo" in outputs[0]["text"] and "in the background" in outputs[0]["text"]
    widget = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widget) == 1 and "VBox" in widget[0]["data"]["text/plain"]
    assert k.text("print(accel_result.status, sorted(accel_result.pids))").startswith("running [0, 1]")

    # A foreground cell while they train: its own output only, none of theirs.
    wait_for(k, "accel_result.last_line[1].startswith('loss')")
    fg = "f0 = time.time()\nwhile time.time() - f0 < 1:\n    x = sum(i * i for i in range(10_000))\nf1 = time.time()\n"
    fg += "print('foreground done')"
    reply, outputs = k.execute(fg)
    assert reply["status"] == "ok"
    assert [o.get("text") for o in outputs] == ["foreground done\n"]
    assert k.text("print(accel_result.status)").strip() == "running"

    k.execute("accel_result.wait()")
    text = k.text("print(span[0] < f1 and f0 < span[1], id(model) == mine, not torch.equal(model.weight, weights))")
    assert re.match(r"Background launch \(accel_result\): 2 ranks done in [\d.]+ s; applied .*model", text), text
    assert text.strip().endswith("True True True"), text  # overlapped; trained state in the notebook's own model
    out = k.text("print(accel_result.output.count('[rank 1] loss') > 3, accel_result.last_line)")
    assert out.startswith("True {0: 'loss ") and "1: 'loss " in out
    assert k.text("print(settled())").strip() == "([], [], [])"


def test_a_name_rebound_meanwhile_is_kept_and_the_launchs_value_is_in_the_job(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP + "span = 'mine'")
    k.execute(TRAIN.format(seconds=1.5))
    k.execute("span = 'rebound while it ran'\nmodel = 'mine too'")
    _, outputs = k.execute("accel_result.wait(); print('waited')")
    text = k.text("print(span, model, type(accel_result.results['span']).__name__, sorted(accel_result.results))")
    assert (
        "not applied: " in text
        and "span (rebound in the notebook since the launch started; the launch's is accel_result.results['span'])"
        in text
    )
    assert "model (rebound" in text
    assert text.strip().endswith("rebound while it ran mine too tuple ['model', 'span']")


def test_stop_ends_every_rank_and_says_where_each_rank_was(live_kernel, two_ranks_stopped) -> None:
    k = live_kernel
    k.execute(SETUP)
    k.execute(LONG)
    # both ranks in the cell (rank 1 may print its first step before rank 0 leaves its setup, where a stop would
    # find it: the line then names rank 1 alone, as in the foreground)
    wait_for(k, "all(accel_result.last_line.get(r, '').startswith('step') for r in (0, 1))")
    pids = eval(k.text("print(list(accel_result.pids.values()))"))
    started = time.monotonic()
    k.execute("accel_result.view.stop_button.click()")  # what the widget's Stop does in the kernel
    k.execute("accel_result.wait(30)")
    print(f"stopped in {time.monotonic() - started:.2f} s")
    assert not alive(pids)
    text = k.text("print(accel_result.status, accel_result.rank_states)\nprint(accel_result.error)")
    told, status, error = text.splitlines()  # the first: the one line at the first cell after the end
    stopped = two_ranks_stopped("[234]")
    why = k.text(  # what the line was made of: each rank's last place, how it ended, the line its record names
        "o = accel_result.outcome\nprint(o.places, o.ended, [(f.rank, f.kind, f.exitcode, f.traceback[-120:]) "
        "for f in o.failures])"
    )
    assert re.fullmatch(rf"Background launch \(accel_result\): {stopped}; nothing was applied\.", told), (told, why)
    assert status == "stopped {0: 'stopped', 1: 'stopped'}"
    assert re.fullmatch(stopped, error), error
    head = k.text("print(accel_result.view.head.value)")
    assert "STOPPED" in head and "the 2 ranks were stopped" in head
    assert k.text("print(settled())").strip() == "([], [], [])"


def test_a_failure_names_the_rank_and_the_cell_line_in_the_job_and_the_widget(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP + "accelerator_note = 'kept'")
    body = (
        "%%accel_train -n 2 --background\nimport time\ntime.sleep(0.5)\nif accelerator.process_index == 1:\n"
        "    raise ValueError('bad batch')\naccelerator.wait_for_everyone()\nresult = 1\n"
    )
    k.execute(body)
    k.execute("accel_result.wait(60)")
    text = k.text("print(accel_result.status, accel_result.rank_states[1])\nprint(accel_result.error)")
    assert "failed: rank 1 raised ValueError: bad batch" in text.splitlines()[0]  # the next cell's one line
    assert "failed failed" in text and "rank 1 raised ValueError: bad batch; the other ranks were stopped." in text
    details = k.text("print(accel_result.details)")
    assert "Cell line 4" in details and "ValueError: bad batch" in details
    head = k.text("print(accel_result.view.head.value)")
    assert "FAILED" in head and "Cell line 4" in head
    assert k.text("print('result' in globals(), accelerator_note)").strip() == "False kept"
    reply, outputs = k.execute("%accel_wait")  # the failure was already told: the wait only repeats the line
    assert reply["status"] == "ok" and "failed: rank 1 raised ValueError" in outputs[0]["text"]


def test_accel_wait_applies_at_once_and_a_second_launch_is_refused_while_one_runs(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP + "import os")
    k.execute(TRAIN.format(seconds=2))
    reply, outputs = k.execute(TRAIN.format(seconds=1))
    assert reply["status"] == "error"
    assert reply["evalue"] == (
        "A background launch is still running (accel_result): wait for it with %accel_wait or stop it with "
        "accel_result.stop(), then launch again; nothing was launched."
    )
    reply, _ = k.execute("%%accel_train -n 2\nx = 1")
    assert reply["status"] == "error" and reply["evalue"].startswith("A background launch is still running")
    reply, _ = k.execute("from accel_magic import notebook_launcher\nnotebook_launcher(print, num_processes=2)")
    assert reply["status"] == "error" and reply["evalue"].startswith("A background launch is still running")
    assert reply["traceback"] == [f"\x1b[0;31mTrainError\x1b[0m: {reply['evalue']}"]  # one line, no frames
    k.execute("os.environ['SET_WHILE_IT_RAN'] = 'yes'")
    reply, outputs = k.execute("%accel_wait\nprint(type(model).__name__, span[1] > span[0])")
    assert reply["status"] == "ok"
    text = "".join(o.get("text", "") for o in outputs)
    assert re.match(r"Background launch \(accel_result\): 2 ranks done in [\d.]+ s; applied .*\.\nLinear True\n", text)
    # Applied once: the next cell says nothing more, and the environment set meanwhile is still there.
    assert k.text("print(os.environ.get('SET_WHILE_IT_RAN'), [k for k in os.environ if k.startswith('TORCHELASTIC')])"
                  ).strip() == "yes []"  # fmt: skip
    reply, outputs = k.execute("%accel_wait")
    assert "2 ranks done" in outputs[0]["text"]


def test_an_interrupt_stops_the_foreground_cell_only(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP)
    k.execute(LONG)
    wait_for(k, "accel_result.status == 'running'")
    msg_id = k.send("time.sleep(30)")
    time.sleep(1.0)
    k.km.interrupt_kernel()
    reply, _ = k.collect(msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert k.text("print(accel_result.status, accel_result.rank_states)").startswith(
        "running {0: 'running', 1: 'running'}"
    )
    k.execute("accel_result.stop()")
    assert k.text("print(accel_result.status, settled())").strip().endswith("stopped ([], [], [])")


def test_one_process_runs_in_the_background_and_rank_0s_bar_goes_into_the_widget(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP)
    cell = "%%accel_train -n 1 --background\nfrom tqdm.auto import tqdm\nfrom IPython.display import HTML, display\n"
    cell += "for i in tqdm(range(20)):\n    pass\ndisplay(HTML('<b>from rank 0</b>'))\nn = i"
    reply, _ = k.execute(cell)
    assert reply["status"] == "ok"
    k.execute("accel_result.wait(60)")
    view = "accel_result.view"
    text = k.text(f"print(n, len({view}.displays.children), {view}._made[0].value)\nprint({view}.displays.children)")
    bar, html = eval(text.strip().splitlines()[-1])
    assert text.strip().splitlines()[-2].endswith("19 2 <b>from rank 0</b>"), text
    assert bar.startswith("IPY_MODEL_") and html.startswith("IPY_MODEL_")  # rank 0's bar by its model; the HTML


@pytest.mark.parametrize("how", ["shutdown", "restart", "unload", "kill"])
def test_a_kernel_that_ends_or_an_unloaded_extension_leaves_nothing_running(live_kernel, private_tmpdir, how) -> None:
    """A kernel killed outright (SIGKILL) cannot clean up: its ranks still end with it, its files stay."""
    k = live_kernel
    kernels = f"/dev/shm/accel_magic-{k.km.provisioner.process.pid}-*.grads"  # this kernel's launches' segments
    k.execute(SETUP)
    k.execute(TRAIN.format(seconds=600))  # a DDP model: its gradients go through a shared-memory segment
    wait_for(k, "accel_result.last_line[1].startswith('loss')")
    pids = eval(k.text("print(list(accel_result.pids.values()))"))
    assert len(pids) == 2 and glob.glob(os.path.join(private_tmpdir, "accel_magic-*"))
    ours = set(glob.glob(kernels))
    assert len(ours) == 1
    if how == "unload":
        k.execute("%unload_ext accel_magic")
        assert k.text("print(settled())").strip() == "([], [], [])"
    elif how == "restart":
        k.km.restart_kernel()
    elif how == "kill":
        os.kill(int(k.text("print(os.getpid())")), signal.SIGKILL)
    else:
        k.km.shutdown_kernel()
    end = time.monotonic() + 10
    while alive(pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not alive(pids)
    if how == "kill":
        for path in ours:  # nothing could remove it
            os.remove(path)
        return
    assert not glob.glob(os.path.join(private_tmpdir, "accel_magic-*"))
    assert not glob.glob(os.path.join(private_tmpdir, "torchelastic_*"))
    assert not glob.glob(kernels)


def test_a_short_cells_results_are_never_lost_whether_it_ended_before_returning_or_after(live_kernel) -> None:
    k = live_kernel
    k.execute(SETUP)
    reply, _ = k.execute("%%accel_train -n 2 --background\nquick = 7")
    assert reply["status"] == "ok"
    k.execute("accel_result.wait(60)")
    assert k.text("print(quick, accel_result.status, accel_result.applied)").strip().endswith("7 done True")


def test_a_launch_that_ends_before_its_ranks_run_fails_in_its_own_cell(live_kernel) -> None:
    """The other node never comes: the rendezvous ends the launch before any rank ran, while the cell waits."""
    k = live_kernel
    k.execute(SETUP)
    port = k.text("import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1]); s.close()")
    line = f"-n 1 --background --nodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:{port.strip()} --timeout 3"
    reply, _ = k.execute(f"%%accel_train {line}\nx = 1")
    assert reply["status"] == "error" and reply["ename"] == "LaunchError"
    assert reply["evalue"].startswith("this node could not form one group with the other 1 node at 127.0.0.1:")
    assert k.text("print(accel_result.status, accel_result.applied, 'x' in globals(), settled())").strip() == (
        "failed True False ([], [], [])"
    )
