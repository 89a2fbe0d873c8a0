"""accelerate's own notebook tests (`accelerate/test_utils/scripts/test_notebook.py`, from the installed wheel) in a
real kernel, with their `notebook_launcher` rebound to accel_magic's drop-in and 2 processes: every test passes
but `test_mixed_precision`, and every rank of their launches is in one MULTI_CPU group. `test_fault_tolerant`'s
function takes from its queue atomically here: as written, two processes can both see one item left and one of
them then waits for ever, whichever launcher runs them."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import accelerate

SUITE = Path(accelerate.__file__).parent / "test_utils" / "scripts" / "test_notebook.py"
TESTS = [
    node.name
    for node in ast.parse(SUITE.read_text()).body
    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
]
# fp16 on CPU: accelerate labels it fp16 and trains in fp32; the plan says `no` instead (README, "Mixed precision").
EXPECTED_TO_FAIL = {"test_mixed_precision"}

LOAD = """
import os, unittest
from queue import Empty
os.environ["ACCELERATE_NUM_PROCESSES"] = "2"
import accelerate.test_utils.scripts.test_notebook as suite
from accel_magic import notebook_launcher
suite.notebook_launcher = notebook_launcher

def tough_nut_function(queue):
    # test_fault_tolerant's function checks queue.empty(), then calls queue.get(): two processes can both pass the
    # check for the last item, and one then waits for ever (under accelerate's launcher too). The same, atomic.
    try:
        trial = queue.get_nowait()
    except Empty:
        return
    if trial > 0:
        queue.put(trial - 1)
        raise RuntimeError("The nut hasn't cracked yet! Try again.")
    print(f"PartialState:\\n{suite.PartialState()}")

suite.tough_nut_function = tough_nut_function
print(suite.NUM_PROCESSES)
"""

RUN = """
try:
    suite.{0}()
except unittest.SkipTest as err:
    print("RESULT skipped", err)
except BaseException as err:
    print("RESULT failed", type(err).__name__, str(err).splitlines()[0])
else:
    print("RESULT passed")
"""


def test_accelerates_notebook_tests_pass_against_the_drop_in_with_every_rank_in_one_group(kernel_run) -> None:
    assert "test_can_initialize" in TESTS and "test_fault_tolerant" in TESTS and "test_monitoring" in TESTS
    cells = kernel_run(LOAD, *(RUN.format(name) for name in TESTS), timeout=600)
    assert cells.text(0).strip() == "2"
    results = {name: cells.text(i + 1) for i, name in enumerate(TESTS)}
    for name, out in results.items():
        (result,) = re.findall(r"^RESULT .*", out, re.MULTILINE)
        if name in EXPECTED_TO_FAIL:
            assert re.match(r"RESULT failed LaunchError rank \d raised AssertionError", result), (name, out)
        elif name == "test_problematic_imports" and importlib.util.find_spec("bitsandbytes") is None:
            assert result.startswith("RESULT skipped"), (name, out)  # it needs bitsandbytes
        else:
            assert result == "RESULT passed", (name, out)
    # The launches that always print accelerate's state (test_fault_tolerant's last run may print nothing: its
    # ranks race for the queue): both ranks in one gloo group, each with its own index.
    for name in ("test_can_initialize", "test_static_rdzv_backend", "test_c10d_rdzv_backend"):
        if name not in results:
            continue
        out = results[name]
        for rank in (0, 1):
            prefix = r"\[rank 1\] " if rank else ""
            assert re.search(rf"^{prefix}Distributed environment: (DistributedType\.)?MULTI_CPU", out, re.M), out
            assert re.search(rf"^{prefix}Num processes: 2$", out, re.MULTILINE), (name, out)
            assert re.search(rf"^{prefix}Process index: {rank}$", out, re.MULTILINE), (name, out)
    assert "Restarting the 2 ranks (1 of 3): rank " in results["test_fault_tolerant"]
