"""The troubleshooting page (docs/troubleshooting.md) holds every sentence the product can print when it refuses,
falls back or fails, collected here from the code: the message of every error a user sees (the one-sentence
errors of accel_magic.errors, IPython's UsageError, traitlets' TraitError, a node's NodeMismatch, an interrupted
launch's line), every fallback of the plan ("<reason>, so <outcome>") and note, and every sentence of the
functions that word a launch's end or what it did instead of what was asked."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "accel_magic"
PAGE = ROOT / "docs" / "troubleshooting.md"
# Errors whose message a user reads, beside accel_magic.errors' one-sentence ones.
ERRORS = {"UsageError", "TraitError", "NodeMismatch", "LaunchInterrupted"}
# The functions that word how a launch ended (a failure, an interrupt, stuck ranks, memory, what did not come
# back) or what it did instead of what was asked (gloo for a bucket, the launch's group for a rank's own
# init_process_group): every sentence in them.
WORDING = {
    "launch/outcome.py": {"interrupted_words", "abrupt", "failure_words"},
    "launch/places.py": {"stuck"},
    "launch/memory.py": {"killed_words"},
    "launch/adopt.py": {"disagreement", "word_taken_port", "adopt_init_process_group"},
    "launch/shm.py": {"region"},
    "footprint.py": {"fit_words"},
    "train.py": {"run_ranks", "bring_back", "results_interrupted"},
}
SHORTEST = 12  # characters: a shorter literal part names too little to be looked up
PLACEHOLDER = "…"


def one_sentence_errors() -> set[str]:
    """The classes of accel_magic.errors that show their message as one sentence."""
    tree = ast.parse((PACKAGE / "errors.py").read_text())
    found = {"OneSentence"}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id in found for b in node.bases):
            found.add(node.name)
    return found


def templates(node: ast.expr) -> list[str]:
    """A message as its literal text, each computed part a placeholder; one for each branch of a choice."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else PLACEHOLDER for v in node.values)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return [left + right for left in templates(node.left) for right in templates(node.right)]
    if isinstance(node, ast.IfExp):
        return templates(node.body) + templates(node.orelse)
    return [PLACEHOLDER]


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _strings(function: ast.FunctionDef) -> list[ast.expr]:
    """The string expressions of a function, outermost only, its docstring left out."""
    body = function.body[1:] if ast.get_docstring(function) is not None else function.body
    found: list[ast.expr] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            found.append(node)  # type: ignore[arg-type]
            return
        if isinstance(node, ast.Compare):  # a string looked for in another (an error's text), not printed
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    for statement in body:
        visit(statement)
    return found


def messages() -> list[tuple[str, str]]:
    """(where, template) of every sentence the product can print when it refuses, falls back or fails."""
    errors = ERRORS | one_sentence_errors()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and node.args:
                called = _called(node)
                if called in errors or (called == "add" and module == "plan.py"):
                    found += [(where, t) for t in templates(node.args[0])]
                elif called == "fallback" and len(node.args) >= 3:  # the plan's: "<reason>, so <outcome>."
                    reasons, outcomes = templates(node.args[1]), templates(node.args[2])
                    found += [(where, f"{r}, so {o}.") for r in reasons for o in outcomes]
            if isinstance(node, ast.FunctionDef) and node.name in WORDING.get(module, ()):
                found += [(f"{module}:{s.lineno}", t) for s in _strings(node) for t in templates(s)]
    return found


def normalized(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "")).strip()


def parts(message: str) -> list[str]:
    """The literal parts of a message that the page must hold as written: each long enough to name something
    (a message made of shorter ones only, such as one passed on from elsewhere, has none)."""
    return [p for p in (normalized(part) for part in message.split(PLACEHOLDER)) if len(p) >= SHORTEST]


def test_the_collection_finds_the_kinds_of_sentence_it_looks_for() -> None:
    found = [m for _, m in messages()]
    assert len(found) > 100, len(found)
    for expected in (
        "The cell is empty: put the training code below the %%accel_train line.",  # CellError
        "--return and --no-return contradict each other: use one of them.",  # UsageError
        "DeepSpeed is not installed, so the ranks use DDP.",  # a fallback
        "the launch was stopped before its ranks started",  # an interrupt's words
    ):
        assert expected in found, expected


def test_every_sentence_the_product_prints_when_it_refuses_falls_back_or_fails_is_on_the_troubleshooting_page() -> None:
    page = normalized(PAGE.read_text())
    missing = sorted({f"{where}: {m}" for where, m in messages() if any(part not in page for part in parts(m))})
    assert not missing, "not on docs/troubleshooting.md:\n" + "\n".join(missing)
