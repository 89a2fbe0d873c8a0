"""%%accel_train in a real ipykernel: one test per behaviour a notebook user sees."""

from __future__ import annotations

import re
import time

import pytest

SETUP = "%load_ext accel_magic"

MLP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
w_before = [p.detach().clone() for p in model.parameters()]
model_id = id(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
opt_id = id(opt)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
dl = torch.utils.data.DataLoader(data, batch_size=8)
dl_id = id(dl)
"""

TRAIN = """%%accel_train -n 2
import torch.nn.functional as F
state = accelerator.state
print(f"rank {accelerator.process_index}: {state.distributed_type} backend={state.backend} "
      f"world={accelerator.num_processes} threads={torch.get_num_threads()}")
model, opt, dl = accelerator.prepare(model, opt, dl)
for x, y in dl:
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = accelerator.gather(flat[None])
same_weights = bool(torch.equal(gathered[0], gathered[1]))
rank0_weights = gathered[0].clone()
final_loss = loss.item()
"""


def test_ranks_form_one_gloo_group_train_ddp_and_results_come_back(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        MLP,
        TRAIN,
        "print(id(model) == model_id, type(model).__name__, id(opt) == opt_id, id(dl) == dl_id)\n"
        "flat_nb = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
        "print(same_weights, torch.equal(flat_nb, rank0_weights), not torch.equal(flat_nb[:8], w_before[0].flatten()))\n"
        "print(len(opt.state) > 0, type(dl).__name__, isinstance(final_loss, float))\n"
        "print(type(accel_result).__name__, accel_result.ok, sorted(accel_result.exitcodes.items()))",
    )
    out = cells.text(2)
    assert "rank 0: DistributedType.MULTI_CPU backend=gloo world=2 threads=1" in out
    assert "[rank 1] rank 1: DistributedType.MULTI_CPU backend=gloo world=2 threads=1" in out
    assert "OMP_NUM_THREADS/MKL_NUM_THREADS unset" not in out  # threads were set before accelerate looked
    lines = cells.text(3).split("\n")
    assert lines[0] == "True Sequential True True"  # the notebook's own objects, unwrapped
    assert lines[1] == "True True True"  # identical weights on both ranks, loaded into the notebook's model
    assert lines[2] == "True DataLoader True"  # optimizer state back; the notebook's dataloader as it was
    assert lines[3] == "LaunchOutcome True [(0, 0), (1, 0)]"


@pytest.mark.own_kernel  # what the kernel imported before is what this is about
def test_the_ranks_inherit_what_ddp_imports_from_the_kernel_once_a_launchs_ranks_imported_it(kernel_run) -> None:
    # DDP and accelerate's prepare import torch._dynamo and DTensor (hundreds of modules) in each rank; once a
    # launch's ranks did, the kernel imports them before the next launch forks, and no rank imports them itself;
    # a launch whose ranks never imported them (x = 1) leaves the kernel without them
    step = (
        "%%accel_train -n 2\nimport sys, torch\nbefore = set(sys.modules)\n"
        "model = accelerator.prepare(torch.nn.Linear(4, 4))\nmodel(torch.ones(2, 4)).sum().backward()\n"
        "new = sorted(set(sys.modules) - before)\nprint(len(new), new[:5], flush=True)"
    )
    kernel_has = "import sys\nprint('torch._dynamo' in sys.modules)"
    cells = kernel_run(SETUP, "%%accel_train -n 2\nx = 1", kernel_has, step, kernel_has, step, step, kernel_has)
    imported = [
        [int(n) for n in re.findall(r"^(?:\[rank 1\] )?(\d+) \[", cells.text(cell), re.MULTILINE)] for cell in (3, 5, 6)
    ]
    assert cells.text(2).strip() == "False"
    assert len(imported[0]) == 2 and min(imported[0]) > 100, cells.text(3)  # 440 to 880 here
    assert cells.text(4).strip() == "False"
    for counts, cell in zip(imported[1:], (5, 6), strict=True):
        assert len(counts) == 2 and max(counts) < 20, cells.text(cell)
    assert cells.text(7).strip() == "True"


def test_cell_sees_notebook_variables_and_runs_magics_and_shell_lines(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "greeting = 'hello'",
        "%%accel_train -n 2\n"
        "print(greeting, accelerator.process_index)\n"
        "!echo from-a-subprocess\n"
        "%env ACCEL_TEST_FLAG=1\n"
        "import os; flag = os.environ['ACCEL_TEST_FLAG']",
        "print(flag, 'ACCEL_TEST_FLAG' in __import__('os').environ)",
    )
    out = cells.text(2)
    assert "hello 0\n" in out and "[rank 1] hello 1\n" in out
    assert "from-a-subprocess\n" in out and "[rank 1] from-a-subprocess\n" in out
    assert cells.text(3).strip() == "1 False"  # the value came back; the rank's environment did not


def test_output_from_both_ranks_is_marked_and_never_interleaved_mid_line(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%%accel_train -n 2 --no-return\n"
        "import sys, os\n"
        "r = accelerator.process_index\n"
        "for i in range(300):\n"
        "    print(f'r{r}-line-{i}-' + 'x' * 200)\n"
        "    if i % 50 == 0:\n"
        "        os.write(2, f'r{r}-fd2-{i}\\n'.encode())\n"
        "print('no newline at the end from', r, end='')",
    )
    out = cells.text(1)
    pattern = re.compile(r"^(\[rank 1\] r1|r0)-(line-\d+-x{200}|fd2-\d+)$")
    body = [line for line in out.split("\n") if line and not line.startswith("accel_train:")]
    tails = [line for line in body if "no newline" in line]
    assert sorted(tails) == ["[rank 1] no newline at the end from 1", "no newline at the end from 0"]
    bad = [line for line in body if not pattern.match(line) and line not in tails]
    assert not bad, bad[:3]
    assert sum(1 for line in body if line.startswith("[rank 1] r1-line")) == 300
    assert sum(1 for line in body if line.startswith("r0-line")) == 300


def test_accelerator_print_prints_once_and_rank0_carriage_returns_pass_through(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%%accel_train -n 2\n"
        "accelerator.print('once')\n"
        "import sys\n"
        "if accelerator.is_main_process:\n"
        "    for i in range(3):\n"
        "        sys.stderr.write(f'\\rprogress {i}')\n"
        "    sys.stderr.write('\\n')",
    )
    out = cells.text(1)
    assert out.count("once") == 1
    assert "\rprogress 0\rprogress 1\rprogress 2\n" in out


def test_tqdm_auto_bar_on_rank0_shows_as_a_widget(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%%accel_train -n 2\nfrom tqdm.auto import tqdm\nfor _ in tqdm(range(5), disable=not accelerator.is_main_process):\n"
        "    pass",
    )
    views = [o for o in cells.outputs(1) if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1  # rank 0's bar, forwarded; rank 1 disabled its own
    # Every update of the bar reached the kernel's widgets: the bar drawn full, 5/5 beside it.
    state = cells.nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    models = [(m["model_name"], m["state"]) for m in state.values()]
    bars = [m for name, m in models if name == "FloatProgressModel"]
    assert [(m["value"], m["max"], m["bar_style"]) for m in bars] == [(5, 5, "success")], models
    assert any("5/5" in m["value"] for name, m in models if name == "HTMLModel"), models


def test_return_options_and_unpicklable_names(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "import torch",
        "%%accel_train -n 2 --return a,net\na = 1\nb = 2\nnet = torch.nn.Linear(2, 2)\n",
        "print(a, 'b' in dir(), type(net).__name__, net.weight.device)",
        "%%accel_train -n 2\nimport threading\nlock = threading.Lock()\nc = 3",
        "print(c, 'lock' in dir())",
        "%%accel_train -n 2 --no-return\nd = 4",
        "print('d' in dir(), accel_result.ok)",
    )
    assert cells.text(3).strip() == "1 False Linear cpu"
    assert "Not brought back to the notebook: lock (TypeError: cannot pickle '_thread.lock' object)." in cells.text(4)
    assert cells.text(5).strip() == "3 False"
    assert cells.text(7).strip() == "False True"


def test_result_over_the_limit_names_the_biggest_and_changes_nothing(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "import torch\nsmall = 'kept'",
        "%%accel_train -n 2 --max-return-mb 1\nbig = torch.zeros(1_000_000)\nsmall = 'changed'",
        "print(small, 'big' in dir())",
        allow_errors=True,
    )
    (error,) = [o for o in cells.outputs(2) if o["output_type"] == "error"]
    assert error["ename"] == "LaunchError"
    assert "over the 1 MB limit (biggest: big 3.8 MB" in error["evalue"]
    assert cells.text(3).strip() == "kept False"


def test_parent_state_does_not_block_or_isolate_the_ranks(kernel_run) -> None:
    report = "%%accel_train -n 2 --no-return\nprint('world', accelerator.num_processes, accelerator.distributed_type)"
    cells = kernel_run(
        SETUP,
        "%accel_setup --quiet",
        report,
        "%%accel_train -n 1\nimport os\nkernel_pid = os.getpid()",
        report,
        "from accelerate import PartialState\nPartialState(cpu=True)",
        report,
        "print(kernel_pid == __import__('os').getpid(), accelerator.device, accelerator.num_processes)",
    )
    for i in (2, 4, 6):
        assert "world 2 DistributedType.MULTI_CPU" in cells.text(i), cells.text(i)
    assert cells.text(7).strip() == "True cpu 1"  # -n 1 ran in the kernel; the notebook's accelerator works


def test_fake_colab_cpu_runtime_still_runs_the_ranks_asked_for(kernel_run) -> None:
    """notebook_launcher runs in-process on Colab without GPUs; the fake Colab environment below is probed
    as Colab, and -n 2 still gives a world of 2."""
    cells = kernel_run(
        SETUP,
        "%env COLAB_RELEASE_TAG=fake-colab\n%env COLAB_GPU=",
        "plan = %accel_setup --quiet\nprint(plan.runtime.platform)",
        "%%accel_train -n 2 --no-return\nprint('world', accelerator.num_processes)",
    )
    assert cells.text(2).strip() == "colab"
    assert "world 2" in cells.text(3)


FAILURES = [
    (
        "rank 0 raises",
        "if accelerator.process_index == 0:\n    raise KeyError('zero')",
        "rank 0 raised KeyError: 'zero'",
    ),
    (
        "rank 1 raises",
        "if accelerator.process_index == 1:\n    raise ValueError('one')",
        "rank 1 raised ValueError: one",
    ),
    (
        "rank 1 calls sys.exit",
        "import sys\nif accelerator.process_index == 1:\n    sys.exit(3)",
        "rank 1 called sys.exit(3)",
    ),
    (
        "rank 1 calls os._exit",
        "import os\nif accelerator.process_index == 1:\n    os._exit(1)",
        "rank 1 called os._exit(1)",
    ),
]


def test_failure_names_the_root_rank_then_the_next_launch_works(kernel_run) -> None:
    """Each failure in turn in one kernel: the launch after it works, and nothing the notebook had is lost."""
    launches = [
        (
            "keep = 'before'",
            f"%%accel_train -n 2\nkeep = 'changed'\n{body}\naccelerator.wait_for_everyone()",
            "%%accel_train -n 2\nafter = accelerator.num_processes",
            "print(keep, after)",
        )
        for _, body, _ in FAILURES
    ]
    cells = kernel_run(SETUP, *(cell for launch in launches for cell in launch), allow_errors=True)
    for number, (name, body, headline) in enumerate(FAILURES):
        failed = 2 + 4 * number
        (error,) = [o for o in cells.outputs(failed) if o["output_type"] == "error"]
        assert error["ename"] == "LaunchError", name
        assert error["evalue"].startswith(headline), (name, error["evalue"])
        assert error["evalue"].endswith("; the other ranks were stopped."), (name, error["evalue"])
        tb = "\n".join(error["traceback"])
        if "raise" in body:
            assert "Cell line 3" in tb and "elastic" not in tb, name
        assert "ChildFailedError" not in cells.text(failed), name
        assert cells.text(failed + 2).strip() == "before 2", name


# accel_magic's own machinery failing inside a rank, provoked by injected faults (stand-ins for a bug): before the
# cell, torch refuses the thread count the rank sets up; after it, packing the results fails.
MACHINERY_FAULTS = [
    (
        "set-up fails before the cell",
        "import torch\n"
        "def refuse(n):\n    raise RuntimeError('injected set-up fault')\n"
        "torch.set_num_threads, real_set_num_threads = refuse, torch.set_num_threads",
        r"accel_magic failed inside rank [01] before the cell ran: RuntimeError: injected set-up fault",
        "torch.set_num_threads = real_set_num_threads",
    ),
    (
        "result writing fails after the cell",
        "import accel_magic.results as accel_results\n"
        "def broken(*args, **kwargs):\n    raise TypeError('injected packing fault')\n"
        "accel_results.pack_results, real_pack_results = broken, accel_results.pack_results",
        r"accel_magic failed inside rank 0 after the cell ran: TypeError: injected packing fault",
        "accel_results.pack_results = real_pack_results",
    ),
]


@pytest.mark.parametrize(
    ("inject", "headline", "heal"), [f[1:] for f in MACHINERY_FAULTS], ids=[f[0] for f in MACHINERY_FAULTS]
)
def test_a_failure_of_accel_magic_inside_a_rank_is_reported_as_a_bug_with_its_traceback(
    kernel_run, inject: str, headline: str, heal: str
) -> None:
    cells = kernel_run(
        SETUP,
        "keep = 'before'",
        inject,
        "%%accel_train -n 2\nkeep = 'changed'\naccelerator.wait_for_everyone()",
        heal,
        "%%accel_train -n 2\nafter = accelerator.num_processes",
        "print(keep, after)",
        allow_errors=True,
    )
    (error,) = [o for o in cells.outputs(3) if o["output_type"] == "error"]
    assert error["ename"] == "LaunchError"
    assert re.match(headline, error["evalue"]), error["evalue"]  # both ranks fail at set-up: either may be first
    assert "This is a bug in accel_magic" in error["evalue"] and "without raising" not in error["evalue"]
    tb = "\n".join(error["traceback"])
    assert "Traceback (most recent call last)" in tb and "accel_magic" in tb  # our own frames: the bug's place
    assert re.search(r"versions: python 3\.\d+\.\d+, torch \d", tb), tb
    assert cells.text(6).strip() == "before 2"


FIRST_TRY_FAILS = """%%accel_train -n 2 --max-restarts 2{}
import os
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if accelerator.process_index == 1 and restart == 0:
    raise ValueError("first try")
accelerator.wait_for_everyone()
"""
RESTARTED = "Restarting the 2 ranks (1 of 2): rank 1 raised ValueError: first try; the other ranks were stopped."


def test_max_restarts_starts_every_rank_again_and_the_results_are_the_run_that_succeeded(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        FIRST_TRY_FAILS.format(""),
        "print('foreground', restart, accel_result.restarts)",
        FIRST_TRY_FAILS.format(" --background"),
        "%accel_wait\nprint('background', restart, accel_result.outcome.restarts)\nprint(accel_result.output)",
    )
    assert [line for line in cells.text(1).splitlines() if line.startswith("Restart")] == [RESTARTED]
    assert "foreground 1 1" in cells.text(2)
    assert "background 1 1" in cells.text(4) and RESTARTED in cells.text(4), cells.text(4)


def test_syntax_error_is_reported_before_any_process_starts(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "import psutil",
        "%%accel_train -n 2\nx = 1\ny = (\n",
        "print(psutil.Process().children())",
        allow_errors=True,
    )
    assert (
        cells.text(2)
        == "UsageError: Syntax error at cell line 2 (y = (): '(' was never closed; nothing was launched.\n"
    )
    assert cells.text(3).strip() == "[]"


def test_skipped_collective_ends_after_the_timeout(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "import time\nt0 = time.time()",
        "%%accel_train -n 2 --timeout 3\nimport time, torch\n"
        "if accelerator.process_index == 1:\n    time.sleep(30)  # alive, but never joins the all-reduce\n"
        "else:\n    accelerator.reduce(torch.ones(1))",
        "print(round(time.time() - t0))",
        allow_errors=True,
    )
    (error,) = [o for o in cells.outputs(2) if o["output_type"] == "error"]
    assert error["evalue"].startswith("rank 0: a collective waited more than 3 s (--timeout)")
    assert int(cells.text(3)) < 12


def test_interrupt_stops_every_rank_within_seconds(live_kernel) -> None:
    live_kernel.execute(SETUP)
    live_kernel.execute("import psutil, os")
    msg_id = live_kernel.send(
        "%%accel_train -n 2\nimport time\nwhile True:\n    try:\n        time.sleep(0.1)\n"
        "    except Exception:\n        pass  # a loop that swallows exceptions"
    )
    time.sleep(4)
    start = time.monotonic()
    live_kernel.km.interrupt_kernel()
    reply, outputs = live_kernel.collect(msg_id, timeout=30)
    took = time.monotonic() - start
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt"
    assert took < 5, took
    assert "SignalException" not in str(outputs)
    assert live_kernel.text("print(psutil.Process().children(recursive=True))").strip() == "[]"
    assert "world 2" in live_kernel.text("%%accel_train -n 2 --no-return\nprint('world', accelerator.num_processes)")


# Cell line 3 (the magic's line is not the cell's) is where rank 0 is when the interrupt comes; the loop is on one
# line, as the interrupt lands in the sleep or at the loop's jump, by which of the rank's threads the signal reaches.
LOOP_ON_RANK_0 = "%%accel_train -n 2\nimport time\nprint('ready', flush=True)\nwhile True: time.sleep(0.05)\n"


def interrupt_when_ready(kernel, code: str) -> tuple[dict, list[dict], float]:
    """Run a cell, interrupt it once rank 0 printed 'ready' (as the stop button does), and return the reply, the
    outputs and how long the cell took to end after the interrupt."""
    msg_id = kernel.send(code)
    outputs = []
    while "ready" not in "".join(o.get("text", "") for o in outputs).splitlines():  # rank 1's reads [rank 1] ready
        msg = kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            outputs.append({"output_type": "stream", **msg["content"]})
    time.sleep(0.5)  # rank 0 is past its print, in the loop
    start = time.monotonic()
    kernel.km.interrupt_kernel()
    reply, rest = kernel.collect(msg_id, timeout=30)
    return reply, outputs + rest, time.monotonic() - start


def test_an_interrupt_ends_with_one_line_naming_each_ranks_cell_line_and_none_of_our_frames(
    live_kernel, two_ranks_stopped
) -> None:
    live_kernel.execute(SETUP)
    live_kernel.execute("import psutil")
    reply, outputs, took = interrupt_when_ready(live_kernel, LOOP_ON_RANK_0)
    (error,) = [o for o in outputs if o["output_type"] == "error"]
    message = two_ranks_stopped("3")
    assert (reply["status"], reply["ename"]) == ("error", "KeyboardInterrupt")
    assert re.fullmatch(message, reply["evalue"]) and error["evalue"] == reply["evalue"], reply["evalue"]
    assert len(error["traceback"]) == 1 and "\n" not in error["traceback"][0], error["traceback"]
    assert re.sub(r"\x1b\[[0-9;]*m", "", error["traceback"][0]) == f"KeyboardInterrupt: {error['evalue']}"
    assert took < 5, took
    assert live_kernel.text("print(psutil.Process().children(recursive=True))").strip() == "[]"


def test_accel_result_says_interrupted_or_failed_after_every_launch_that_ran(live_kernel) -> None:
    live_kernel.execute(SETUP)
    show = "print(repr(accel_result).split(':')[0])"
    interrupt_when_ready(live_kernel, LOOP_ON_RANK_0)  # the kernel's first launch
    assert live_kernel.text(show).strip() == "<accel_train interrupted"
    live_kernel.execute("%%accel_train -n 2\nx = 1")
    assert live_kernel.text(show).strip() == "<accel_train ok"
    interrupt_when_ready(live_kernel, LOOP_ON_RANK_0)  # never the earlier launch's "ok"
    assert live_kernel.text(show).strip() == "<accel_train interrupted"
    reply, _ = live_kernel.execute("%%accel_train -n 2\nraise ValueError('x')")
    assert reply["ename"] == "LaunchError"
    assert live_kernel.text(show).strip() == "<accel_train failed"
    reply, _ = live_kernel.execute("%%accel_train -n 0\nx = 2")  # refused before it starts: not a launch
    assert reply["ename"] == "UsageError"
    assert live_kernel.text(show).strip() == "<accel_train failed"
    assert live_kernel.text(
        "%%accel_train -n 2\nx = accelerator.num_processes\naccelerator.print('world', x)"
    ).strip() == (
        "accel_train: 2 processes on cpu (gloo, gradients in shared memory), 1 thread each; collective timeout 900 s\n"
        "world 2"
    )
    assert live_kernel.text(show).strip() == "<accel_train ok"


def plain(outputs: list[dict]) -> str:
    """A cell's outputs as text, in full and without colours: what an assertion message shows."""

    def text(o: dict) -> str:
        return "\n".join(o.get("traceback", [])) or o.get("text") or str(o.get("data"))

    return "\n".join(f"[{o['output_type']}]\n" + re.sub(r"\x1b\[[0-9;]*m", "", text(o)) for o in outputs)


def one_line_error(reply: dict, outputs: list[dict]) -> str:
    """The message of the one error a cell ended with, after checking it is one line and none of our frames."""
    (error,) = [o for o in outputs if o["output_type"] == "error"]
    assert (reply["status"], reply["ename"], error["ename"]) == ("error", "KeyboardInterrupt", "KeyboardInterrupt")
    assert len(error["traceback"]) == 1 and "\n" not in error["traceback"][0], error["traceback"]
    assert re.sub(r"\x1b\[[0-9;]*m", "", error["traceback"][0]) == f"KeyboardInterrupt: {error['evalue']}"
    return error["evalue"]


LEFT_BEHIND = (
    "import glob, os, psutil, tempfile\n"
    "print(repr(accel_result).split(':')[0], psutil.Process().children(recursive=True),"
    " glob.glob(tempfile.gettempdir() + '/accel_magic-*') + glob.glob(tempfile.gettempdir() + '/torchelastic_*'))"
)


def test_a_second_interrupt_while_the_ranks_are_stopped_still_ends_in_one_line(live_kernel, two_ranks_stopped) -> None:
    live_kernel.execute(SETUP)
    # Ranks that outlive the first interrupt: they catch it and ignore SIGTERM, so the kernel stops them with
    # SIGTERM after their second of grace, and SIGKILL two seconds later; the second interrupt comes in between.
    stubborn = (
        "%%accel_train -n 2\nimport signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\nwhile True:\n    try:\n        time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n        pass\n"
    )
    msg_id = live_kernel.send(stubborn)
    while True:  # until rank 0 is in its loop
        msg = live_kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and "ready" in msg["content"].get("text", "").split("\n"):
            break
    time.sleep(0.5)
    live_kernel.km.interrupt_kernel()
    time.sleep(1.5)
    live_kernel.km.interrupt_kernel()
    reply, outputs = live_kernel.collect(msg_id, timeout=30)
    # killed: no rank recorded where it was, and the line names where each was when last looked at
    assert re.fullmatch(two_ranks_stopped(r"\d"), one_line_error(reply, outputs))
    assert live_kernel.text(LEFT_BEHIND).strip() == "<accel_train interrupted [] []"
    again = live_kernel.text("%%accel_train -n 2 --no-return\naccelerator.print('world', accelerator.num_processes)")
    assert again.strip().endswith("world 2")  # the next launch works


@pytest.mark.fresh_kernel  # the first launch imports torch before it forks
def test_an_interrupt_right_after_the_cell_starts_stops_the_launch_in_one_line(
    live_kernel, tmp_path, two_ranks_stopped
) -> None:
    live_kernel.execute(SETUP)
    live_kernel.execute(f"marks = {str(tmp_path)!r}")
    cell = (
        "%%accel_train -n 2\nimport os, time\nopen(os.path.join(marks, f'ran-{accelerator.process_index}'), 'w').close()\n"
        "print('ready', flush=True)\nfor _ in range(600): time.sleep(0.05)\n"
    )
    ran = "the 2 ranks were stopped|" + two_ranks_stopped(r"\d", starting=True)
    before = "the launch was stopped before its ranks started"
    # The first launch of a kernel imports torch before it forks (seconds); later ones start within a second. An
    # interrupt at any of these moments ends the cell in one line, leaves nothing behind, and sets accel_result;
    # one that comes before IPython called the magic is IPython's own, with none of our frames, and one that comes
    # before ipykernel called IPython's run_cell ends the request with no reply and no output, as ipykernel does.
    seen = []
    for delay in (0.3, 0.0, 0.02, 0.1, 0.2):
        live_kernel.execute("accel_result = None")
        msg_id = live_kernel.start(cell)
        time.sleep(delay)
        live_kernel.km.interrupt_kernel()
        reply, outputs = live_kernel.collect_any(msg_id, timeout=60)
        if reply is None:  # ipykernel's own: the interrupt came before it called IPython's run_cell
            assert outputs == [] and live_kernel.value("accel_result is None") == "True", outputs
            assert list(tmp_path.iterdir()) == []
            seen.append("before IPython ran the cell")
            continue
        errors = [o for o in outputs if o["output_type"] == "error"]
        assert len(errors) == 1, f"after {delay} s:\n" + plain(outputs)
        (error,) = errors
        if len(error["traceback"]) > 1:  # IPython's own traceback: the interrupt came before the magic ran
            untouched = live_kernel.value("accel_result is None")
            assert untouched == "True" and "accel_magic" not in "".join(error["traceback"]), error["traceback"]
            seen.append("before the magic ran")
            continue
        message = one_line_error(reply, outputs)
        assert re.fullmatch(f"{before}|{ran}", message), message
        assert live_kernel.text(LEFT_BEHIND).strip() == "<accel_train interrupted [] []"
        marks = sorted(p.name for p in tmp_path.iterdir())
        if message == before:
            assert marks == [] and "ready" not in str(outputs)  # no rank ran the cell
        for mark in tmp_path.iterdir():
            mark.unlink()
        seen.append(message)
    assert seen[0] == before, seen  # torch was still being imported: nothing was forked


def test_an_interrupt_that_comes_while_a_rank_finalizes_an_object_still_stops_it_where_its_cell_is(
    live_kernel, two_ranks_stopped
) -> None:
    # Python cannot raise in a finalizer: it prints the exception and goes on. pyzmq's Frame.__del__, run in a rank
    # on frames inherited from the kernel, checks for signals, as this finalizer's sleep does; an interrupt that
    # came there was printed twice (rank 0's as an IPython error of the cell) and lost, and the ranks ran on until
    # the kernel killed them.
    live_kernel.execute(SETUP)
    cell = (
        "%%accel_train -n 2\nimport time\nclass Finalized:\n    def __del__(self):\n"
        "        print('finalizing', flush=True)\n        time.sleep(30)\nFinalized()\n"
        "for _ in range(600): time.sleep(0.05)\n"
    )
    msg_id = live_kernel.send(cell)
    finalizing = set()
    while len(finalizing) < 2:  # both ranks in the finalizer
        msg = live_kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id:
            finalizing.update(line for line in msg["content"].get("text", "").split("\n") if "finalizing" in line)
    live_kernel.km.interrupt_kernel()
    reply, outputs = live_kernel.collect(msg_id, timeout=30)
    printed = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    assert "Exception ignored" not in printed, plain(outputs)
    assert re.fullmatch(two_ranks_stopped("7"), one_line_error(reply, outputs))  # the loop after the finalizer
    ended = live_kernel.text("print(sorted((f.rank, f.kind, f.summary) for f in accel_result.failures))")
    assert ended.strip() == "[(0, 'exception', 'KeyboardInterrupt'), (1, 'exception', 'KeyboardInterrupt')]"


def test_an_interrupt_while_results_are_applied_leaves_each_name_applied_in_full_or_as_it_was(live_kernel) -> None:
    live_kernel.execute(SETUP)
    live_kernel.execute(
        "import time\nclass Slow:\n    def __init__(self):\n        self.v = 0\n"
        "    def state_dict(self):\n        return {'v': self.v}\n"
        "    def load_state_dict(self, state):\n        print('loading', flush=True)\n        time.sleep(1.5)\n"
        "        self.v = state['v']\nslow = Slow()\nafter = 'old'"
    )
    cell = "%%accel_train -n 2\naccelerator.register_for_checkpointing(slow)\nslow.v = 5\nfirst = slow\nafter = 'new'"
    msg_id = live_kernel.send(cell)
    while True:  # until the kernel loads the first name's state
        msg = live_kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and "loading" in msg["content"].get("text", "").split("\n"):
            break
    live_kernel.km.interrupt_kernel()
    reply, outputs = live_kernel.collect(msg_id, timeout=30)
    assert one_line_error(reply, outputs) == (
        "the 2 ranks had ended, and the interrupt came while their results were applied (applied first; left as they "
        "were: after)"
    )
    assert live_kernel.text("print(slow.v, first is slow, after)").strip() == "5 True old"
    assert live_kernel.text(
        "print(repr(accel_result).split(':')[0], [n for n, _ in accel_result.skipped])"
    ).strip() == ("<accel_train interrupted ['after']")
    assert live_kernel.text(LEFT_BEHIND).strip() == "<accel_train interrupted [] []"


def test_accel_result_of_a_cell_run_in_the_kernel_says_failed_or_interrupted(live_kernel) -> None:
    live_kernel.execute(SETUP)
    show = "print(repr(accel_result).split(';')[0])"
    live_kernel.execute("%%accel_train -n 1\nraise ValueError('x')")
    assert live_kernel.text(show).strip() == "<accel_train failed: 1 processes, wall time " + (
        live_kernel.text("print(f'{accel_result.wall_time:.2f} s')").strip()
    )
    assert live_kernel.text("print(accel_result.failures[0].summary)").strip() == "ValueError: x"
    _, outputs, _ = interrupt_when_ready(live_kernel, LOOP_ON_RANK_0.replace("-n 2", "-n 1"))
    assert [o["ename"] for o in outputs if o["output_type"] == "error"] == ["KeyboardInterrupt"]  # IPython's own
    assert live_kernel.text(show).startswith("<accel_train interrupted: 1 processes")
    live_kernel.execute("%%accel_train -n 1\nx = 1")
    assert live_kernel.text(show).startswith("<accel_train ok: 1 processes")


def test_nothing_is_left_behind_after_good_and_bad_launches(kernel_run) -> None:
    snapshot = (
        "import os, glob, signal, psutil, tempfile, time\n"
        "def snapshot():\n"
        "    time.sleep(0.2)\n"
        "    me = psutil.Process()\n"
        "    return (sorted(os.environ.items()),\n"
        "            [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGINT)],\n"
        "            sorted(c.laddr for c in (getattr(me, 'net_connections', None) or me.connections)() if c.status == 'LISTEN'),\n"
        "            me.children(recursive=True),\n"
        "            sorted(glob.glob(tempfile.gettempdir() + '/torchelastic_*') + glob.glob(tempfile.gettempdir() + '/accel_magic-*')))\n"
    )
    cells = kernel_run(
        SETUP,
        snapshot + "before = snapshot()",
        "%%accel_train -n 2\nx = 1",
        "%%accel_train -n 2\nif accelerator.process_index == 1:\n    raise RuntimeError('bad')\naccelerator.wait_for_everyone()",
        "after = snapshot()\nfor a, b, what in zip(before, after, ['env', 'signals', 'listening', 'children', 'tmp']):\n"
        "    print(what, a == b, '' if a == b else (a, b))",
        allow_errors=True,
    )
    assert cells.text(4).split("\n")[:5] == [
        "env True ",
        "signals True ",
        "listening True ",
        "children True ",
        "tmp True ",
    ]


def test_mixed_precision_bf16_autocasts_and_fp16_is_downgraded(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%%accel_train -n 2 --mixed-precision bf16\nimport torch\nwith accelerator.autocast():\n"
        "    y = torch.nn.Linear(4, 4)(torch.randn(2, 4))\nprint('dtype', y.dtype, accelerator.mixed_precision)",
        "%%accel_train -n 2 --mixed-precision fp16\nprint('mp', accelerator.mixed_precision)",
    )
    out = cells.text(1)
    assert "dtype torch.bfloat16 bf16" in out and "[rank 1] dtype torch.bfloat16 bf16" in out
    out = cells.text(2)
    assert "note: fp16 has no effect on the CPU" in out and "mp no" in out


BAD = [
    ("zero processes", "-n 0", "x = 1", "-n/--num-processes must be a whole number of at least 1, not '0'."),
    (
        "processes not a number",
        "-n abc",
        "x = 1",
        "-n/--num-processes must be a whole number of at least 1, not 'abc'.",
    ),
    ("negative timeout", "-n 2 --timeout -1", "x = 1", "--timeout must be a number of seconds or megabytes above 0"),
    ("port out of range", "-n 2 --port 70000", "x = 1", "--port must be a whole number from 1 to 65535, not '70000'."),
    ("empty cell", "-n 2", "", "the cell body is empty"),  # IPython says it before the magic runs
    ("only comments", "-n 2", "# nothing\n   # here", "The cell is empty"),
    ("return of an unbound name", "-n 2 --return y", "x = 1", "--return names y, which the cell never binds"),
    ("unknown flag", "-n 2 --bogus", "x = 1", "unrecognized arguments: --bogus"),
]


def test_bad_input_is_one_sentence_and_loses_nothing(kernel_run) -> None:
    """Each bad line in one kernel, as a user would type them one after another (the shell layer checks every
    option's bad values; this checks what the front end shows of them)."""
    cells = [SETUP, "x = 'mine'"]
    for _, line, body, _ in BAD:
        cells += [f"%%accel_train {line}\n{body}", "print(x)"]
    nb = kernel_run(*cells, allow_errors=True)
    for i, (name, _, _, says) in enumerate(BAD):
        text = nb.text(2 + 2 * i)
        assert text.startswith("UsageError: ") and says in text and text.count("\n") == 1, (name, text)
        assert nb.text(3 + 2 * i).strip() == "mine", name


def test_port_in_use_is_refused(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\nport = s.getsockname()[1]",
        "%%accel_train -n 2 --port $port\nx = 1",
        allow_errors=True,
    )
    assert re.fullmatch(
        r"UsageError: Port \d+ is in use: choose another with --port, or leave --port out\.\n", cells.text(2)
    )


def test_defaults_come_from_config_then_setup_and_own_accelerator_works(kernel_run) -> None:
    cells = kernel_run(
        SETUP,
        "%config AccelMagics.num_processes = 2",
        "%%accel_train --no-return\nprint('world', accelerator.num_processes)",
        "%config AccelMagics.num_processes = None\n%accel_setup --quiet -n 2",
        "%%accel_train\nfrom accelerate import Accelerator\nmine = Accelerator()\nprint('own', mine.num_processes, mine.distributed_type)\nimport torch\n"
        "net = mine.prepare(torch.nn.Linear(3, 1))",
        "print(type(net).__name__, net.weight.device)",
    )
    assert "world 2" in cells.text(2)  # %config, without %accel_setup: it set itself up
    assert "own 2 DistributedType.MULTI_CPU" in cells.text(4)  # %accel_setup -n 2, and the cell's own Accelerator
    assert cells.text(5).strip() == "Linear cpu"  # a model prepared in the cell comes back unwrapped


def test_output_arrives_while_the_ranks_run(live_kernel) -> None:
    live_kernel.execute(SETUP)
    msg_id = live_kernel.send(
        "%%accel_train -n 2 --no-return\nimport time\nprint('start', accelerator.process_index)\ntime.sleep(3)\nprint('end')"
    )
    arrivals = {}
    while True:
        msg = live_kernel.kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            for word in ("start 0", "[rank 1] start 1", "end"):
                if word in msg["content"]["text"]:
                    arrivals.setdefault(word, time.monotonic())
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            done = time.monotonic()
            break
    assert done - arrivals["start 0"] > 2 and done - arrivals["[rank 1] start 1"] > 2
    assert done - arrivals["end"] < 2
