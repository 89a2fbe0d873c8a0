"""%accel_setup in a real ipykernel, as JupyterLab, Colab or VS Code run it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from accel_magic.runtime import cpu_budget


def test_setup_in_a_real_kernel_builds_cpu_accelerator_and_shows_one_panel(kernel_run) -> None:
    cells = kernel_run(
        "%load_ext accel_magic",
        "%accel_setup",
        "print(accelerator.distributed_type.value, accelerator.device.type)",
        "import torch; print('cuda initialized:', torch.cuda.is_initialized())",
    )
    outputs = cells.outputs(1)
    assert [o["output_type"] for o in outputs] == ["display_data"], outputs  # one panel, no Out[n]
    data = outputs[0]["data"]
    assert set(data) == {"text/plain", "text/html"}  # no widget view: a reopened notebook shows the same panel
    text = data["text/plain"]
    expected_budget = cpu_budget(os.environ, Path("/"), len(os.sched_getaffinity(0)))
    assert text.startswith("accel_magic: CPU · in the kernel · "), text
    for line in ("runs in          Jupyter", "device           cpu", "backend          gloo"):
        assert line in text, text
    assert re.search(rf"CPUs             {expected_budget}\b", text), text
    assert "<details" in data["text/html"] and "CPU · in the kernel" in data["text/html"]
    assert cells.text(2).strip() == "NO cpu"
    assert cells.text(3).strip() == "cuda initialized: False"


def test_assigned_setup_shows_the_panel_once_and_the_plan_shows_again_later(kernel_run) -> None:
    cells = kernel_run("%load_ext accel_magic", "plan = %accel_setup", "plan", "p2 = %accel_setup --quiet")
    assert [o["output_type"] for o in cells.outputs(1)] == ["display_data"]
    assert [o["output_type"] for o in cells.outputs(2)] == ["display_data"]
    assert "backend          gloo" in cells.outputs(2)[0]["data"]["text/plain"]
    assert cells.outputs(3) == []


def test_bad_input_in_a_kernel_is_one_line_without_traceback(kernel_run) -> None:
    cells = kernel_run(
        "%load_ext accel_magic", "keep = [1, 2]", "%accel_setup --name keep", "print(keep)", allow_errors=True
    )
    (err,) = cells.outputs(2)  # IPython shows a UsageError as one stderr line, without a traceback
    assert (err["output_type"], err["name"]) == ("stream", "stderr")
    expected = "`keep` already holds a list: pass --force to replace it, or choose another --name."
    assert err["text"] == f"UsageError: {expected}\n"
    assert cells.text(3).strip() == "[1, 2]"


def test_the_notebooks_accelerator_is_an_accelerator_to_completion_inspection_and_help_before_it_is_built(
    live_kernel,
) -> None:
    k = live_kernel
    k.execute("%load_ext accel_magic\n%accel_setup --quiet")
    msg_id = k.kc.complete("accelerator.prep", len("accelerator.prep"))
    reply = k.kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert "accelerator.prepare" in reply["content"]["matches"] or "prepare" in reply["content"]["matches"], reply
    msg_id = k.kc.inspect("accelerator", len("accelerator"))  # accelerator? in the notebook
    reply = k.kc.get_shell_msg(timeout=60)
    assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["found"], reply
    assert "Creates an instance of an accelerator" in reply["content"]["data"]["text/plain"]
    out = k.text(
        "import accelerate, io, contextlib\n"
        "with contextlib.redirect_stdout(io.StringIO()) as page:\n"
        "    help(accelerator)\n"
        "print(isinstance(accelerator, accelerate.Accelerator), 'prepare' in dir(accelerator), accelerator.built,\n"
        "      'Creates an instance of an accelerator' in page.getvalue())"
    )
    assert out.split() == ["True", "True", "False", "True"], out
    assert k.text("print(accelerator.device, accelerator.built)").split() == ["cpu", "True"]
