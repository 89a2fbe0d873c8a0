"""Hostile input to both magics: every option with wrong types, out-of-range values, duplicates and unknown
flags, and hostile cells. Each ends in one clear sentence and loses nothing in the namespace."""

from __future__ import annotations

import ast
import pathlib

import pytest
from IPython import get_ipython
from IPython.core.error import UsageError

SETUP_LINES = [
    ("-n", ["", "0", "-1", "abc", "1.5", "99999999999999999999x"]),
    ("--num-processes", ["0", "two"]),
    ("--mixed-precision", ["fp17", "1", "''"]),
    ("--strategy", ["zero3", "DDP2"]),
    ("--name", ["1abc", "class", "a-b", "''"]),
]
TRAIN_LINES = [
    ("-n", ["0", "-1", "abc"]),
    ("--mixed-precision", ["int4"]),
    ("--timeout", ["-1", "0", "abc", "nan", "inf"]),
    ("--port", ["0", "70000", "-5", "http"]),
    ("--max-return-mb", ["0", "-3", "lots"]),
    ("--max-restarts", ["-1", "two", "1.5"]),
    ("--return", ["not_bound", "x,,y_unbound"]),
    ("--result", ["1abc", "class", "''", "keep"]),
]
SETUP_CASES = [(f"{opt} {val}".strip(), "accel_setup") for opt, vals in SETUP_LINES for val in vals]
SETUP_CASES += [
    ("--bogus", "accel_setup"),
    ("positional", "accel_setup"),
    ("-n 2 -n 3", "accel_setup"),
    ("-n 2 --num-processes 3", "accel_setup"),
    ("--cpu --cpu", "accel_setup"),
    ("--strategy fsdp --strict", "accel_setup"),
    ("--mixed-precision fp16 --strict", "accel_setup"),
    ("--name keep", "accel_setup"),
    ("--strategy", "accel_setup"),
]
TRAIN_CASES = [(f"{opt} {val}", "accel_train") for opt, vals in TRAIN_LINES for val in vals]
TRAIN_CASES += [
    ("-n 2 --bogus", "accel_train"),
    ("--timeout 5 --timeout 6", "accel_train"),
    ("--no-return --return x", "accel_train"),
    ("--strategy fsdp", "accel_train"),  # a setup-only option
    ("-n 2 --port", "accel_train"),
    ("--nodes 0", "accel_train"),
    ("--nodes two", "accel_train"),
    ("--nodes 2", "accel_train"),  # no --node-rank or --rdzv-endpoint
    ("--nodes 2 --node-rank 0", "accel_train"),
    ("--nodes 2 --node-rank 2 --rdzv-endpoint 127.0.0.1:29500", "accel_train"),
    ("--nodes 2 --node-rank -1 --rdzv-endpoint 127.0.0.1:29500", "accel_train"),
    ("--nodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1", "accel_train"),
    ("--nodes 2 --node-rank 0 --rdzv-endpoint :29500", "accel_train"),
    ("--nodes 2 --node-rank 0 --rdzv-endpoint host:99999", "accel_train"),
    ("--nodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29500 --port 29501", "accel_train"),
    ("--node-rank 1 --rdzv-endpoint 127.0.0.1:29500", "accel_train"),  # no --nodes
    ("--nodes 2 --node-rank 0 --rdzv-endpoint 127.0.0.1:29500 --max-restarts 1", "accel_train"),
]


@pytest.fixture
def ip():
    shell = get_ipython()
    shell.run_line_magic("load_ext", "accel_magic")
    shell.user_ns["keep"] = ["precious", {"nested": 1}]
    yield shell
    shell.run_line_magic("unload_ext", "accel_magic")
    for name in ("keep", "accelerator", "x"):
        shell.user_ns.pop(name, None)


def assert_one_sentence(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message, message
    assert message.rstrip().endswith("."), message


@pytest.mark.parametrize(
    ("line", "magic"), SETUP_CASES + TRAIN_CASES, ids=[f"%{m} {line}" for line, m in SETUP_CASES + TRAIN_CASES]
)
def test_bad_option_is_one_sentence_and_loses_nothing(ip, line: str, magic: str) -> None:
    before = dict(ip.user_ns)
    with pytest.raises(UsageError) as info:
        if magic == "accel_setup":
            ip.run_line_magic(magic, line)
        else:
            ip.run_cell_magic(magic, line, "x = 1\ny = 2")
    assert_one_sentence(str(info.value))
    assert ip.user_ns == before


CELLS = [
    ("a syntax error", "x = = 1"),
    ("an unclosed bracket at the end", "x = [1,\n"),
    ("only comments", "# one\n# two"),
    ("only blank lines", "\n\n   \n"),
    ("a NUL character", "x = 1\x00"),
    ("a lone surrogate", "x = '\udcff'"),
    ("top-level await", "import asyncio\nawait asyncio.sleep(0)"),
    ("a bad magic inside", "%this_magic_does_not_exist\nx = 1"),
]


@pytest.mark.parametrize("cell", [c[1] for c in CELLS], ids=[c[0] for c in CELLS])
def test_hostile_cell_is_one_sentence_and_loses_nothing(ip, cell: str) -> None:
    before = dict(ip.user_ns)
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("accel_train", "-n 2", cell)
    assert_one_sentence(str(info.value))
    assert ip.user_ns == before


def test_a_megabyte_cell_runs(ip) -> None:
    ip.run_cell_magic("accel_train", "-n 2 --return x", "x = 0\n" + "x += 1\n" * 150_000)
    assert ip.user_ns["x"] == 150_000


def test_no_shell_is_ever_invoked_with_text() -> None:
    """The package starts processes only with argument lists: no shell=True, os.system or os.popen."""
    package = pathlib.Path(__file__).parents[2] / "accel_magic"
    offenders = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "shell" and isinstance(node.value, ast.Constant):
                offenders.append(f"{path.name}:{node.value.lineno} shell={node.value.value}")
            if isinstance(node, ast.Attribute) and node.attr in ("system", "popen", "getoutput", "getstatusoutput"):
                offenders.append(f"{path.name}:{node.lineno} {node.attr}")
    assert offenders == []


def test_panel_shows_no_environment_secrets(ip, monkeypatch: pytest.MonkeyPatch) -> None:
    from accel_magic.panel import panel_bundle

    monkeypatch.setenv("HF_TOKEN", "hf_verysecret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws_verysecret")
    plan = ip.run_line_magic("accel_setup", "--quiet")
    bundle = panel_bundle(plan)
    assert "verysecret" not in bundle["text/plain"] + bundle["text/html"] + repr(plan.to_dict())


@pytest.mark.parametrize("line", ["", "extra", "--bogus"])
def test_accel_wait_without_a_background_launch_or_with_arguments_is_one_sentence(ip, line: str) -> None:
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("accel_wait", line)
    assert_one_sentence(str(info.value))
    assert ("No background launch" in str(info.value)) == (line == "")


def test_a_background_launch_in_a_terminal_shell_runs_without_a_widget_and_accel_wait_applies(ip, capsys) -> None:
    ip.run_cell_magic("accel_train", "-n 2 --background", "x = 41 + accelerator.num_processes // 2\nprint('hi')")
    job = ip.user_ns["accel_result"]
    assert job.view is None and job.status in ("running", "done")
    ip.run_line_magic("accel_wait", "")
    assert ip.user_ns["x"] == 42 and "[rank 1] hi" in job.output
    assert "Background launch (accel_result): 2 ranks done in" in capsys.readouterr().out
    ip.user_ns.pop("accel_result")
