"""export.py: the names a cell needs, the earlier cells that define them, magics as Python, and the script,
SLURM file and commands it writes."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from accel_magic.cell import compile_cell
from accel_magic.export import (
    ExportError,
    Settings,
    commands,
    export_training_cell,
    last_training_cell,
    needed_names,
    script_paths,
)
from accel_magic.launch.rank import cell_traceback


def transform(raw: str) -> str:
    """What IPython's transform_cell makes of the magics these tests use (checked against the real one in
    tests/shell/test_export_magic.py)."""
    lines = raw.split("\n")
    if lines[0].startswith("%%"):
        name, _, options = lines[0][2:].partition(" ")
        return f"get_ipython().run_cell_magic({name!r}, {options!r}, {chr(10).join(lines[1:]) + chr(10)!r})\n"
    out = []
    for line in lines:
        indent = line[: len(line) - len(line.lstrip())]
        body = line.strip()
        assign = re.match(r"^(\w+) = ([%!])(.*)$", body)
        if assign:
            target, sign, rest = assign.groups()
            call = f"get_ipython().getoutput({rest!r})" if sign == "!" else _call(sign, rest)
            out.append(f"{indent}{target} = {call}")
        elif body[:1] in ("%", "!"):
            out.append(indent + _call(body[0], body[1:]))
        else:
            out.append(line)
    return "\n".join(out)


def _call(sign: str, rest: str) -> str:
    if sign == "!":
        return f"get_ipython().system({rest!r})"
    name, _, args = rest.partition(" ")
    return f"get_ipython().run_line_magic({name!r}, {args!r})"


def needed(source: str) -> set[str]:
    return set(needed_names(ast.parse(source)).needed)


def export(*cells: str, settings: Settings | None = None, tmp: Path | None = None, **kwargs):
    history = list(enumerate(cells, start=1))
    found = last_training_cell(history)
    assert found is not None
    script = str((tmp or Path("/tmp")) / kwargs.pop("script", "train.py"))
    return export_training_cell(history, transform, found[0], settings or Settings(), script=script, **kwargs)


def taken(result) -> list[int]:
    return [count for count, _ in result.cells]


# --- the names a cell needs ---


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("x = y + 1", {"y"}),
        ("x = 1\ny = x", set()),
        ("x = x + 1", {"x"}),
        ("x += 1", {"x"}),
        ("total = 0\ntotal += 1", set()),
        ("n: int = m", {"m", "int"}),
        ("(a := b) + a", {"b"}),
        ("for i in items:\n    last = i\nprint(last)", {"items", "print"}),
        ("for x, y in dl:\n    loss = f(x, y)\nloss.item()", {"dl", "f"}),
        ("while go():\n    step = 1", {"go"}),
        ("def f(a):\n    return a + model(b)", set()),
        ("def f():\n    return helper()\ndef helper():\n    return 1", set()),
        ("def f(a=default):\n    pass", {"default"}),
        ("@deco\ndef f():\n    pass", {"deco"}),
        ("g = lambda v: v * scale", set()),
        ("class C(Base):\n    size = n\n    def m(self):\n        return size", {"Base", "n"}),
        ("class C:\n    def m(self):\n        return C()", set()),
        ("sq = [v * k for v in values]", {"values", "k"}),
        ("sq = {v: w for v, w in pairs if v}", {"pairs"}),
        ("[v for v in range(3)]\nv", {"range", "v"}),
        ("import torch.nn as nn\nimport os.path\nnn, os", set()),
        ("from torch import nn\nnn", set()),
        ("try:\n    pass\nexcept ValueError as err:\n    print(err)", {"ValueError", "print"}),
        ("with open(p) as fh:\n    fh.read()", {"open", "p"}),
        ("if c:\n    z = 1\nelse:\n    w = z", {"c", "z"}),
        ("del gone", {"gone"}),
        ("match cmd:\n    case [a, *rest]:\n        a, rest\n    case {'k': v, **others}:\n        v, others", {"cmd"}),
        ("obj.attr = value\nitems[key] = 1", {"obj", "value", "items", "key"}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_cell_needs_what_it_loads_before_binding_it(source: str, expected: set[str]) -> None:
    assert needed(source) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(a):\n    return a + model(b)", {"model", "b"}),
        ("def f():\n    return helper()\ndef helper():\n    return 1", {"helper"}),
        ("g = lambda v: v * scale", {"scale"}),
        ("class C(Base):\n    size = n\n    def m(self):\n        return size", {"size"}),
        ("class C:\n    def m(self):\n        x = 1\n        return x, C", {"C"}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_names_used_inside_functions_are_deferred_to_when_they_are_called(source: str, expected: set[str]) -> None:
    assert set(needed_names(ast.parse(source)).deferred) == expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("torch.manual_seed(0)", {"torch"}),
        ("_ = torch.random.manual_seed(0)", {"torch"}),
        ("model.load_state_dict(state)", {"model"}),
        ('opt.param_groups[0]["lr"] = 0.5', {"opt"}),
        ("model.steps += 1\ndel cache.entry\nitems[0] = 1", {"model", "cache", "items"}),
        ("for m in models:\n    m.reset()", set()),
        ("print(model)\nmodel(x)\nf(model)\nx = model.weight", set()),
        ("data = []\ndata.append(1)", set()),
        ("def f():\n    model.reset()\ng = lambda: torch.manual_seed(1)", set()),
        ("[m.reset() for m in models]", set()),
        ("model.train()", {"model"}),
        ("opt.step()\nopt.zero_grad()", {"opt"}),
        ("model.cpu().eval()", {"model"}),
        ('model.to("cpu")\nx.add_(1)\nw.data.fill_(0)', {"model", "x", "w"}),
        ("logging.basicConfig(level=10)", {"logging"}),
        ("print(model.load_state_dict(state))", {"model"}),
        ("print(opt.step(), x.add_(1), log.pop())", {"opt", "x", "log"}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_cell_changes_objects_of_other_cells_through_calls_and_assignments(source: str, expected: set[str]) -> None:
    assert needed_names(ast.parse(source)).mutated == expected


@pytest.mark.parametrize(
    "source",
    [
        "print(torch.cuda.is_available())",
        "torch.cuda.device_count()",
        "torch.cuda.get_device_name(0)\ntorch.distributed.is_initialized()",
        "print(x.mean().item())",
        "print(model.weight.sum())",
        "sum(p.numel() for p in model.parameters())",
        "x.size(), x.dim(), x.norm(), x.max(), x.std().tolist()",
        "list(model.state_dict().keys())\nfor name, p in model.named_parameters():\n    pass",
        'print(f"{loss.item():.3f} on {torch.cuda.get_device_name(0)}", file=sys.stderr)',
        "display(model)\ndisplay(HTML(frame.to_html()))\nIPython.display.display(Markdown(notes.render()))",
        'logging.info("%s", model.extra_repr())\nlogger.warning(x.abs().max())\nlogging.getLogger(__name__).info(x)',
        "accelerator.print(model.weight.grad.clone())",
    ],
)
def test_showing_values_and_read_only_methods_change_nothing(source: str) -> None:
    assert needed_names(ast.parse(source)).mutated == frozenset()


def test_needed_names_keep_the_line_of_the_first_use() -> None:
    names = needed_names(ast.parse("a = 1\n\nb = c + a\nc = 2\nc"))
    assert names.needed == {"c": 3}
    assert names.bound >= {"a", "b", "c"}
    made = needed_names(ast.parse("def setup():\n    global made\n    made = 1\nsetup()\nmade"))
    assert "made" in made.bound  # so, with no earlier cell binding it, it is the cell's own


# --- which cells are taken ---


def test_the_last_training_cell_is_found_by_its_first_non_blank_line() -> None:
    history = [(1, "%%accel_train -n 2\nx = 1"), (2, "print(1)"), (3, "\n  %%accel_train --cpu\ny = 2"), (4, "z")]
    assert last_training_cell(history) == (3, "--cpu")
    assert last_training_cell([(1, "x = 1"), (2, "# %%accel_train\nx")]) is None


def test_cells_defining_what_the_training_cell_uses_are_taken_transitively_in_order(tmp_path: Path) -> None:
    result = export(
        "import torch",  # [1] used by [3]
        "print(torch.__version__)",  # [2] displays only
        "size = 4\nmodel = torch.nn.Linear(size, 1)",  # [3] used by [5]
        "unused = 5",  # [4]
        "%%accel_train -n 2\nmodel = accelerator.prepare(model)\nprint(model)",
        tmp=tmp_path,
    )
    assert taken(result) == [1, 3, 5]
    reasons = dict(result.cells)
    assert reasons[1] == "defines torch (used by [3])"
    assert reasons[3] == "defines model (used by [5])"
    assert reasons[5] == "the %%accel_train cell"


def test_the_latest_earlier_definition_wins_and_later_cells_are_ignored(tmp_path: Path) -> None:
    result = export("lr = 0.1", "lr = 0.01", "%%accel_train\nstep = lr", "lr = 5", tmp=tmp_path)
    assert taken(result) == [2, 3]
    assert "lr = 0.01" in result.script and "lr = 0.1\n" not in result.script and "lr = 5" not in result.script


def test_a_redefinition_that_uses_the_old_value_takes_both_cells(tmp_path: Path) -> None:
    result = export("lr = 0.1", "lr = lr / 10", "%%accel_train\nstep = lr", tmp=tmp_path)
    assert taken(result) == [1, 2, 3]


def test_an_earlier_training_cell_is_taken_as_its_body(tmp_path: Path) -> None:
    result = export(
        "def make():\n    return object()",
        "model = make()",
        "%%accel_train -n 2\nmodel = accelerator.prepare(model)\nepochs = 3",
        "%%accel_train -n 2\nfor _ in range(epochs):\n    model.step()",
        tmp=tmp_path,
    )
    assert taken(result) == [1, 2, 3, 4]
    assert dict(result.cells)[3] == "an earlier %%accel_train cell; defines epochs, model (used by [4])"
    assert not re.search(r"^\s*%%accel_train", result.script, re.M)
    cell3 = result.script.index("# --- cell [3]")
    assert result.script.index("_accel_as_in_notebook(globals(), _accel_prepared)", cell3) < result.script.index(
        "# --- cell [4]"
    )


def test_a_function_finds_a_name_defined_after_it_but_before_the_training_cell(tmp_path: Path) -> None:
    result = export("def step():\n    return loss_fn()", "def loss_fn():\n    return 0", "%%accel_train\nstep()",
                    tmp=tmp_path)  # fmt: skip
    assert taken(result) == [1, 2, 3]
    assert dict(result.cells)[2] == "defines loss_fn (used by [1])"


def test_a_function_uses_the_latest_definition_before_the_training_cell(tmp_path: Path) -> None:
    cells = ["def loss_fn():\n    return 0", "def step():\n    return loss_fn()", "def loss_fn():\n    return 1"]
    result = export(*cells, "x = 2", "%%accel_train\nstep()", tmp=tmp_path)
    assert taken(result) == [2, 3, 5]
    assert "return 0" not in result.script
    chain = export("def a():\n    return b()", "def b():\n    return c", "c = 1", "%%accel_train\na()", tmp=tmp_path)
    assert taken(chain) == [1, 2, 3, 4]  # followed transitively
    own = export("lr = 5", "%%accel_train\ndef f():\n    return lr\nlr = 1\nf()", tmp=tmp_path)
    assert taken(own) == [2]  # the training cell's own binding


def test_cells_that_change_a_used_object_without_rebinding_it_are_taken(tmp_path: Path) -> None:
    result = export(
        "import torch",  # [1]
        "torch.manual_seed(0)",  # [2] the seed
        "print(torch.__version__)",  # [3] displays only
        "state = {}",  # [4] used by [6]
        "model = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",  # [5]
        "model.load_state_dict(state)",  # [6]
        'opt.param_groups[0]["lr"] = 0.5',  # [7]
        "%%accel_train\nmodel, opt = accelerator.prepare(model, opt)",
        tmp=tmp_path,
    )
    assert taken(result) == [1, 2, 4, 5, 6, 7, 8]
    reasons = dict(result.cells)
    assert reasons[2] == "changes torch (used by [5])"
    assert reasons[6] == "changes model (used by [8])"
    assert reasons[7] == "changes opt (used by [8])"
    assert reasons[4] == "defines state (used by [6])"


def test_cells_that_only_show_values_are_left_out_and_a_cell_that_changes_one_is_kept(tmp_path: Path) -> None:
    result = export(
        "import torch",  # [1]
        "model = torch.nn.Linear(3, 1)\nx = torch.ones(4, 3)",  # [2]
        "print(torch.cuda.is_available())\ntorch.cuda.device_count()",  # [3]
        "print(x.mean().item())\nprint(model.weight.sum())",  # [4]
        "sum(p.numel() for p in model.parameters())",  # [5]
        'import logging\nlogging.info(f"{x.norm().item():.2f}")\ndisplay(model)',  # [6]
        "model.train()",  # [7]
        "%%accel_train\nmodel = accelerator.prepare(model)\nprint(model(x))",
        tmp=tmp_path,
    )
    assert taken(result) == [1, 2, 7, 8]
    assert dict(result.cells)[7] == "changes model (used by [8])"


def test_a_change_matters_only_to_the_cells_that_run_after_it(tmp_path: Path) -> None:
    result = export(
        "import torch",  # [1]
        "model = torch.nn.Linear(2, 2)",  # [2] ran before the seed
        "torch.manual_seed(0)",  # [3]
        "%%accel_train\nx = torch.randn(2)\nmodel = accelerator.prepare(model)",
        tmp=tmp_path,
    )
    assert taken(result) == [1, 2, 3, 4]
    assert dict(result.cells)[1] == "defines torch (used by [2], [3], [4])"
    assert dict(result.cells)[3] == "changes torch (used by [4])"
    late = export("x = []", "y = list(x)", "x.append(1)", "%%accel_train\nz = y", tmp=tmp_path)
    assert taken(late) == [1, 2, 4]  # [3] changed x after [2] had read it
    called = export("import torch", "def draw():\n    return torch.randn(1)", "torch.manual_seed(0)",
                    "%%accel_train\nx = draw()", tmp=tmp_path)  # fmt: skip
    assert taken(called) == [1, 2, 3, 4]  # the function in [2] runs when [4] calls it, after the seed
    assert dict(called.cells)[3] == "changes torch (used by [2])"


def test_a_change_before_the_name_is_bound_again_is_left_out(tmp_path: Path) -> None:
    result = export("x = []", "x.append(1)", "x = [2]", "x.append(3)", "%%accel_train\ny = x", tmp=tmp_path)
    assert taken(result) == [3, 4, 5]


def test_a_name_no_earlier_cell_defines_is_named_with_the_cell(tmp_path: Path) -> None:
    with pytest.raises(ExportError) as err:
        export("x = 1", "%%accel_train\ny = x + foo + bar", tmp=tmp_path)
    message = str(err.value)
    assert message.startswith("Cell [2] uses `foo` and `bar`, which no earlier cell of this kernel defines:")
    assert message.count(".") == 1 and "define them in a cell above it" in message
    with pytest.raises(ExportError, match=r"^Cell \[1\] uses `helper`, which no earlier"):
        export("model = helper()", "%%accel_train\nmodel.fit()", tmp=tmp_path)


def test_a_cell_that_parses_but_does_not_compile_is_refused_as_invalid_where_taken(tmp_path: Path) -> None:
    broken = "z = 1\nnonlocal x"  # ast.parse takes it; the compiler's symbol tables do not
    assert taken(export(broken, "y = 2", "%%accel_train\nprint(y)", tmp=tmp_path)) == [2, 3]
    with pytest.raises(ExportError, match=r"^Cell \[2\] is not valid Python: fix it, run it again"):
        export("y = 2", "%%accel_train\n" + broken, tmp=tmp_path)


def test_a_name_bound_later_in_the_cell_itself_is_its_own(tmp_path: Path) -> None:
    source = "%%accel_train\nfor i in range(3):\n    if i:\n        print(prev)\n    prev = i"
    assert taken(export(source, tmp=tmp_path)) == [1]


def test_ipython_history_names_and_get_ipython_are_refused_in_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"^Cell \[2\] uses `_`, IPython's input and output history"):
        export("1 + 1", "%%accel_train\nx = _", tmp=tmp_path)
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 2 calls get_ipython\(\), which a script does not"):
        export("%%accel_train\nx = 1\nget_ipython().user_ns", tmp=tmp_path)


def test_display_comes_from_ipython_where_it_is_installed_else_print(tmp_path: Path) -> None:
    result = export("%%accel_train\ndisplay(1)", tmp=tmp_path)
    assert "from IPython.display import display\nexcept ImportError" in result.script
    assert "IPython" not in export("%%accel_train\nprint(1)", tmp=tmp_path).script.split('"""', 2)[2]


def test_a_star_import_stands_for_names_nothing_else_defines(tmp_path: Path) -> None:
    assert taken(export("from math import *", "%%accel_train\nx = sqrt(2)", tmp=tmp_path)) == [1, 2]


def test_the_accelerator_name_and_builtins_are_not_needed(tmp_path: Path) -> None:
    result = export("%%accel_train\nacc.print(len([]))", settings=Settings(accelerator_name="acc"), tmp=tmp_path)
    assert "\nacc = Accelerator(" in result.script and "acc.prepare (or prepare_model" in result.script


# --- magics and ! lines ---


def test_magics_with_a_python_equivalent_are_translated_in_place(tmp_path: Path) -> None:
    setup = "\n".join(
        [
            "%load_ext autoreload",
            "%cd ~/data",
            "%env MODE=fast",
            "%pip install -q tqdm",
            "!echo hello  # keep this",
            "files = !ls",
            "%time data = load()",
            "def load():",
            "    return 1",
        ]
    )
    result = export("def load():\n    return [1]", setup, "%%accel_train\nx = data, files", tmp=tmp_path)
    body = result.script.split("# --- cell [2]")[1].split("# --- cell [3]")[0]
    assert "pass  # %load_ext autoreload (not needed in a script)" in body
    assert "os.chdir(os.path.expanduser('~/data'))" in body
    assert "os.environ['MODE'] = 'fast'" in body
    assert "subprocess.run([sys.executable, \"-m\", \"pip\", *['install', '-q', 'tqdm']], check=True)" in body
    assert "\nsubprocess.run('echo hello  # keep this', shell=True)\n" in body
    assert (
        "files = subprocess.run('ls', shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)"
        ".stdout.splitlines()\n" in body
    )
    assert "\ndata = load()" in body
    assert "import argparse\nimport os\nimport subprocess\nimport sys\n" in result.script
    assert taken(result) == [1, 2, 3]  # `load` at line 7 runs before the cell's own def: cell [1]'s


@pytest.mark.parametrize(
    ("line", "python"),
    [
        ("%env A=hello world", "os.environ['A'] = 'hello world'"),
        ("%env A hello world", "os.environ['A'] = 'hello world'"),
        ('%env A="quoted"', "os.environ['A'] = '\"quoted\"'"),
        ("%env A=", "os.environ['A'] = ''"),
        ("%env A", "os.environ['A']"),
        ("x = %env A=1", "x = os.environ.__setitem__('A', '1')"),
        ("x = %env A", "x = os.environ['A']"),
    ],
    ids=lambda v: v if v.startswith(("%", "x =")) else None,
)
def test_env_is_read_and_set_as_ipython_does(line: str, python: str, tmp_path: Path) -> None:
    result = export(f"{line}\nz = 1", "%%accel_train\ny = z", tmp=tmp_path)
    assert f"\n{python}\nz = 1\n" in result.script


def test_env_with_a_space_in_the_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 1 uses %env, which has no plain-Python equivalent"):
        export("%env cmd_args A=B\nz = 1", "%%accel_train\ny = z", tmp=tmp_path)


def test_a_time_cell_magic_is_its_body(tmp_path: Path) -> None:
    result = export("%%time\nimport torch\nmodel = torch.nn.Linear(2, 2)", "%%accel_train\nmodel", tmp=tmp_path)
    assert taken(result) == [1, 2]
    assert "import torch\nmodel = torch.nn.Linear(2, 2)" in result.script


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("x = 1\n\n%who_ls", r"^Cell \[1\] line 3 uses %who_ls, which has no plain-Python equivalent: "),
        ("x = 1\n!echo {x}", r"^Cell \[1\] line 2 uses `!echo \{x\}` with a Python expansion .*, which has no"),
        ("x = 1\n!echo $x", r"^Cell \[1\] line 2 uses `!echo \$x` with a Python expansion"),
        ("%%time\nx = 1\n%run other.py", r"^Cell \[1\] line 3 uses %run, which has no plain-Python equivalent"),
    ],
    ids=["other line magic", "brace expansion", "dollar expansion", "inside %%time"],
)
def test_magics_without_a_python_equivalent_are_refused_with_cell_and_line(cell: str, message: str,
                                                                           tmp_path: Path) -> None:  # fmt: skip
    with pytest.raises(ExportError, match=message) as err:
        export(cell, "%%accel_train\ny = x", tmp=tmp_path)
    assert str(err.value).count(". ") == 0 and str(err.value).endswith(".")


def test_a_training_cell_magic_is_refused_with_its_line_counted_below_the_magic(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 2 uses %debug"):
        export("%%accel_train -n 2\nx = 1\n%debug", tmp=tmp_path)
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 2 uses %debug"):
        export("\n%%accel_train -n 2\nx = 1\n%debug", tmp=tmp_path)
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 1 uses %%bash, which has no plain-Python equivalent"):
        export("%%accel_train -n 2\n%%bash\necho hi", tmp=tmp_path)
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 1 uses %%accel_train, which has no plain-Python"):
        export("%%accel_train -n 2\n%%accel_train\nx = 1", tmp=tmp_path)
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 4 uses %debug"):  # blank lines at the top count
        export("%%accel_train -n 2\n\n\nx = 1\n%debug", tmp=tmp_path)
    with pytest.raises(ExportError, match=r"^Cell \[2\] line 3 uses %who_ls"):  # an earlier training cell
        export("x = 1", "%%accel_train -n 2\ny = x\n\n%who_ls", "%%accel_train -n 2\nz = y", tmp=tmp_path)


def test_a_training_cells_line_is_the_one_a_launch_names(tmp_path: Path) -> None:
    cell = "%%accel_train -n 2\nimport os\n\n%debug"
    with pytest.raises(ExportError, match=r"^Cell \[1\] line 3 uses %debug"):
        export(cell, tmp=tmp_path)
    body = compile_cell(cell.split("\n", 1)[1], transform)  # what the magic is given, compiled as a launch does

    def get_ipython() -> None:  # a rank has no shell (an IPython shell made by another test would answer)
        raise LookupError("no shell")

    with pytest.raises(LookupError) as raised:
        exec(body.code, {"get_ipython": get_ipython})
    assert "  Cell line 3, in <module>\n" in cell_traceback(raised.value, body.filename)


def test_cells_that_are_not_taken_may_hold_any_magic(tmp_path: Path) -> None:
    result = export("%matplotlib inline\n%who", "!nvidia-smi {x}", "%%bash\nls", "%%accel_train\nx = 1", tmp=tmp_path)
    assert taken(result) == [4]
    assert "$HOME" not in result.script
    assert taken(export("!echo $HOME", "%%accel_train\nx = 1", tmp=tmp_path)) == [2]


def test_a_shell_variable_that_is_not_a_python_name_goes_to_the_shell(tmp_path: Path) -> None:
    result = export("!echo $HOME\nx = 1", "%%accel_train\ny = x", tmp=tmp_path)
    assert "subprocess.run('echo $HOME', shell=True)\n" in result.script


def test_shell_commands_run_as_in_ipython_a_failure_does_not_stop_and_output_holds_stderr(tmp_path: Path) -> None:
    result = export(
        "!exit 3\nlines = !echo out; echo err >&2\nafter = 1", "%%accel_train\nx = lines, after", tmp=tmp_path
    )
    cell = result.script.split("# --- cell [1]")[1].split("# --- cell [2]")[0].split("\n", 1)[1]
    namespace: dict = {}
    exec(compile("import subprocess\n" + cell, "cell", "exec"), namespace)
    assert namespace["lines"] == ["out", "err"] and namespace["after"] == 1


# --- the script, the commands and the SLURM file ---


def test_the_script_compiles_and_its_header_lists_the_cells_and_commands(tmp_path: Path) -> None:
    result = export("import torch", "model = torch.nn.Linear(2, 2)", "%%accel_train -n 2\nm = accelerator.prepare(model)",
                    settings=Settings(num_processes=2), tmp=tmp_path)  # fmt: skip
    compile(result.script, "train.py", "exec")
    header = ast.get_docstring(ast.parse(result.script)) or ""
    assert "[1] defines torch (used by [2])" in header and "[2] defines model (used by [3])" in header
    for command in result.commands:
        assert command in header
    assert "accel_magic" not in result.script.split('"""', 2)[2]
    imports = {n.names[0].name.split(".")[0] for n in ast.walk(ast.parse(result.script)) if isinstance(n, ast.Import)}
    imports |= {n.module.split(".")[0] for n in ast.walk(ast.parse(result.script)) if isinstance(n, ast.ImportFrom)}
    assert imports <= {"argparse", "datetime", "accelerate", "torch", "os", "sys", "time"}
    assert 'cpu=True,\n    mixed_precision="no",\n' in result.script and "timedelta(seconds=900)" in result.script


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        (Settings(num_processes=2), "accelerate launch --multi_gpu --num_processes 2 train.py --output-dir OUT"),
        (Settings(num_processes=1), "accelerate launch --cpu --num_processes 1 train.py --output-dir OUT"),
        (
            Settings(num_processes=4, cpu=False, mixed_precision="bf16", gpus=True),
            "accelerate launch --multi_gpu --num_processes 4 --mixed_precision bf16 train.py --output-dir OUT",
        ),
        (
            Settings(num_processes=1, cpu=False, mixed_precision="fp16"),
            "accelerate launch --num_processes 1 --mixed_precision fp16 train.py --output-dir OUT",
        ),
    ],
    ids=["two CPU processes", "one CPU process", "four GPUs in bf16", "one GPU in fp16"],
)
def test_commands_follow_the_plan(settings: Settings, expected: str) -> None:
    accelerate, torchrun, python, sbatch = commands("train.py", "train.slurm", settings, output="OUT")
    assert accelerate == expected
    assert torchrun == f"torchrun --nproc-per-node {settings.num_processes} train.py --output-dir OUT"
    assert python == "python train.py --output-dir OUT" and sbatch == "sbatch train.slurm"


def test_the_script_builds_the_accelerator_from_the_plan(tmp_path: Path) -> None:
    settings = Settings(num_processes=2, cpu=False, mixed_precision="bf16", timeout=60, gpus=True)
    result = export("%%accel_train\nx = 1", settings=settings, tmp=tmp_path)
    assert 'cpu=False,\n    mixed_precision="bf16",\n' in result.script
    assert "InitProcessGroupKwargs(timeout=timedelta(seconds=60))" in result.script
    assert "#SBATCH --gpus-per-node=2" in result.slurm


def test_the_slurm_file_passes_bash_n_and_runs_torchrun_with_c10d_on_the_first_node(tmp_path: Path) -> None:
    result = export("%%accel_train -n 2\nx = 1", settings=Settings(num_processes=3), port=29600, tmp=tmp_path)
    result.write()
    slurm = Path(result.slurm_path)
    assert slurm.name == "train.slurm" and Path(result.script_path).read_text() == result.script
    subprocess.run(["bash", "-n", str(slurm)], check=True, timeout=30)
    text = slurm.read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in text and "--gpus-per-node" not in text
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in text
    command = " ".join(text.split("\nsrun ", 1)[1].replace("\\\n", " ").split())
    assert command.startswith(
        'torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 3 --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d '
        f'--rdzv-endpoint "$head_node:29600" {tmp_path}/train.py --output-dir accel_export_output'
    )


class _Accelerator:
    """What the script's helpers call on an Accelerator, on one process."""

    is_main_process = True

    def prepare(self, *objects):
        return objects if len(objects) > 1 else objects[0]

    def prepare_model(self, model, device_placement=None):
        return model

    prepare_optimizer = prepare_scheduler = prepare_model

    def register_for_checkpointing(self, *objects):
        pass

    def wait_for_everyone(self):
        pass

    def get_state_dict(self, model):
        return model.state_dict()


def helpers(script: str) -> dict:
    """The script's own functions (_accel_record, _accel_save, ...), defined apart from the rest of it."""
    tree = ast.parse(script)
    tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_accel_")]
    namespace: dict = {}
    exec(compile(tree, "train.py", "exec"), namespace)
    return namespace


def test_models_optimizers_and_schedulers_prepared_one_at_a_time_are_saved(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    script = helpers(export("%%accel_train\nx = 1", tmp=tmp_path).script)
    accelerator = _Accelerator()
    prepared, registered = script["_accel_record"](accelerator)
    model = accelerator.prepare_model(torch.nn.Linear(2, 1))
    opt = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sched = accelerator.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt, 1))
    script["_accel_save"](accelerator, {"model": model, "opt": opt, "sched": sched}, prepared, registered, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["model.pt", "opt.pt", "sched.pt"]


def test_the_script_warns_when_nothing_prepared_is_left_to_save(tmp_path: Path, capsys) -> None:
    pytest.importorskip("torch")
    script = helpers(export("%%accel_train\nx = 1", tmp=tmp_path).script)
    accelerator = _Accelerator()
    prepared, registered = script["_accel_record"](accelerator)
    script["_accel_save"](accelerator, {"x": accelerator.prepare(1)}, prepared, registered, tmp_path / "out")
    err = capsys.readouterr().err
    assert err.startswith("warning: no model, optimizer or scheduler") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_slurm_file_asks_for_a_cpu_per_thread_of_each_process_on_a_cpu_plan(tmp_path: Path) -> None:
    settings = Settings(num_processes=2, threads_per_process=4)
    result = export("%%accel_train\nx = 1", settings=settings, script="my job.py", tmp=tmp_path)
    assert "#SBATCH --job-name='my job'\n" in result.slurm
    assert "#SBATCH --cpus-per-task=8\n# 2 process(es) x 4 thread(s) per node" in result.slurm
    assert '\nexport SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in result.slurm
    assert "#SBATCH --cpus-per-task=3\n" in export("%%accel_train", settings=Settings(num_processes=3, threads_per_process=0),
                                                    tmp=tmp_path).slurm  # fmt: skip
    result.write()
    subprocess.run(["bash", "-n", result.slurm_path], check=True, timeout=30)
    gpus = export("%%accel_train\nx = 1", settings=Settings(num_processes=2, cpu=False, gpus=True), tmp=tmp_path)
    assert "--cpus-per-task" not in gpus.slurm and "SRUN_CPUS_PER_TASK" not in gpus.slurm


def test_paths_that_cannot_be_written_are_refused_in_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "folder.py").mkdir()
    for path, message in [
        (tmp_path / "train.txt", "is not a .py file: give the script a name ending in .py"),
        (tmp_path / "folder.py", "is a folder: give the path of the script to write"),
        (tmp_path / "missing" / "train.py", "does not exist: create it first, or write elsewhere"),
    ]:
        with pytest.raises(ExportError, match=message) as err:
            script_paths(str(path))
        assert str(err.value).count(": ") == 1 and str(err.value).endswith(".")
    assert script_paths(str(tmp_path / "t.py")) == (str(tmp_path / "t.py"), str(tmp_path / "t.slurm"))
