"""The setup panel as data, text and HTML, from described runtimes: what a reader sees at a glance."""

from __future__ import annotations

import re
from dataclasses import replace
from html.parser import HTMLParser

import pytest

from accel_magic.panel import change_rows, detail_groups, headline, panel_bundle, plan_html, plan_notes, plan_text
from accel_magic.plan import Request, make_plan
from accel_magic.runtime import GPU, Runtime

TODAY = (("python", "3.13.1"), ("torch", "2.11.0+cpu"), ("accelerate", "1.16.0"), ("ipython", "9.8.0"))
COLAB = (("python", "3.13.5"), ("torch", "2.11.0"), ("accelerate", "1.14.0"), ("ipython", "7.34.0"))
CPU2 = Runtime(platform="jupyter", shell="zmq", cpu_budget=2, cpu_count=2, ram_bytes=8 * 2**30, versions=TODAY)
BINDER = Runtime(platform="binder", shell="zmq", cpu_budget=1, cpu_count=64, versions=TODAY)
T4 = GPU(0, "Tesla T4", 15360, (7, 5))
CU124 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ONE_T4 = Runtime(platform="colab", gpus=(T4,), torch_cuda_archs=CU124, cpu_budget=2, versions=COLAB)
TWO_T4 = Runtime(
    platform="kaggle",
    gpus=(T4, GPU(1, T4.name, T4.memory_mib, T4.capability)),
    torch_cuda_archs=CU124,
    cpu_budget=4,
    versions=COLAB,
)
TPU_XLA = Runtime(platform="colab", tpu="v5e-1", torch_xla=True, cpu_budget=8, versions=COLAB)
TPU_NO_XLA = Runtime(platform="colab", tpu="v5e-1", cpu_budget=8, versions=COLAB)
MPS = Runtime(platform="terminal", mps=True, cpu_budget=8, cpu_count=8)

FSDP_FP16 = Request(num_processes=2, mixed_precision="fp16", strategy="fsdp")

# (id, runtime, request, headline)
HEADLINES = [
    ("two CPU ranks", CPU2, Request(num_processes=2), "CPU · gloo · 2 ranks × 1 thread · accelerate 1.16"),
    ("CPU in the kernel", CPU2, Request(), "CPU · in the kernel · 2 threads · accelerate 1.16"),
    (
        "two GPUs with fp16",
        TWO_T4,
        Request(mixed_precision="fp16"),
        "2 × Tesla T4 · nccl · 2 ranks · fp16 · accelerate 1.14",
    ),
    ("one GPU in the kernel", ONE_T4, Request(), "Tesla T4 · in the kernel · accelerate 1.14"),
    ("FSDP on GPUs", TWO_T4, Request(strategy="fsdp"), "2 × Tesla T4 · nccl · 2 ranks · FSDP · accelerate 1.14"),
    ("a TPU", TPU_XLA, Request(mixed_precision="bf16"), "TPU v5e-1 · in the kernel · bf16 · accelerate 1.14"),
    (
        "a TPU without torch_xla runs on the CPU",
        TPU_NO_XLA,
        Request(),
        "CPU · in the kernel · 8 threads · accelerate 1.14",
    ),
    ("MPS without versions", MPS, Request(), "Apple GPU (MPS) · in the kernel"),
    ("fp16 and FSDP on CPU", CPU2, FSDP_FP16, "CPU · gloo · 2 ranks × 1 thread · accelerate 1.16"),
    (
        "CPU ranks that share memory (the details say so)",
        replace(CPU2, shared_memory=True),
        Request(num_processes=2),
        "CPU · gloo · 2 ranks × 1 thread · accelerate 1.16",
    ),
    (
        "one node of two",
        CPU2,
        Request(num_processes=2, num_nodes=2, node_rank=1, rdzv_endpoint="10.0.0.5:29500"),
        "CPU · gloo · node 1 of 2 · 2 ranks × 1 thread · accelerate 1.16",
    ),
]


@pytest.mark.parametrize(("runtime", "request_", "line"), [r[1:] for r in HEADLINES], ids=[r[0] for r in HEADLINES])
def test_headline_says_where_how_many_and_which_accelerate_in_one_line(
    runtime: Runtime, request_: Request, line: str
) -> None:
    plan = make_plan(runtime, request_)
    assert headline(plan) == line
    assert plan_text(plan).splitlines()[0] == f"accel_magic: {line}"


def test_fp16_and_fsdp_on_cpu_are_two_rows_of_what_was_asked_and_what_is_used_with_why() -> None:
    plan = make_plan(CPU2, FSDP_FP16)
    rows = change_rows(plan)
    assert [(topic, change) for topic, change, _ in rows] == [
        ("mixed_precision", "asked fp16 → using no"),
        ("strategy", "asked fsdp → using ddp"),
    ]
    assert rows[0][2].startswith("fp16 has no effect on the CPU") and rows[1][2].startswith("FSDP needs CUDA GPUs")
    assert plan_notes(plan) == []  # each reason is said once, on its row


def test_fp16_and_fsdp_on_cpu_read_as_text() -> None:
    assert repr(make_plan(CPU2, FSDP_FP16)) == (
        "accel_magic: CPU · gloo · 2 ranks × 1 thread · accelerate 1.16\n"
        "  mixed_precision    asked fp16 → using no\n"
        "                     fp16 has no effect on the CPU (accelerate would silently ignore it), so\n"
        "                     training runs in full precision (--mixed-precision bf16 gives bf16 autocast on\n"
        "                     the CPU).\n"
        "  strategy           asked fsdp → using ddp\n"
        "                     FSDP needs CUDA GPUs and this plan runs on the CPU (accelerate would silently\n"
        "                     build a plain setup), so the ranks use DDP.\n"
        "  plan:\n"
        "    num_processes    2, as forked ranks\n"
        "    mixed_precision  no\n"
        "    cpu              True (accelerate's CPU mode)\n"
        "    device           cpu\n"
        "    backend          gloo\n"
        "    allreduce        gloo: the ranks average gradients through the process group\n"
        "    strategy         ddp\n"
        "    threads          1 per rank\n"
        "    timeout          900 s for a collective to wait for the other ranks\n"
        "    accelerator      built when first used\n"
        "  runtime:\n"
        "    runs in          Jupyter\n"
        "    CPUs             2\n"
        "    memory           8.0 GiB\n"
        "    GPUs             none\n"
        "    TPU              none\n"
        "    versions         Python 3.13.1, torch 2.11.0+cpu, accelerate 1.16.0, IPython 9.8.0"
    )


def test_a_device_nobody_asked_for_reads_as_found_and_other_notes_stay_notes() -> None:
    (row,) = change_rows(make_plan(TPU_NO_XLA))
    assert row[:2] == ("device", "found TPU v5e-1 → using cpu") and "torch_xla is not installed" in row[2]
    plan = make_plan(BINDER, Request(num_processes=2, mixed_precision="fp16"))
    assert [topic for topic, _, _ in change_rows(plan)] == ["mixed_precision"]
    assert [n for n in plan_notes(plan) if "share a budget of 1 CPU" in n] == plan_notes(plan) != []
    text = plan_text(plan)
    assert "  note: 2 processes share a budget of 1 CPU" in text and "1 usable of 64" in text
    assert text.count("fp16 has no effect") == 1


def test_gpu_notes_and_details_name_the_gpus_and_a_ready_or_later_accelerator() -> None:
    two = make_plan(TWO_T4, Request(mixed_precision="bf16"))
    assert change_rows(two)[0][:2] == ("mixed_precision", "asked bf16 → using fp16")
    assert any("built on first use" in n for n in plan_notes(two))
    details = dict(row for _, rows in detail_groups(two) for row in rows)
    assert details["GPUs"] == "2 x Tesla T4, 15 GiB, sm_75"
    assert details["accelerator"] == "built when first used" and details["runs in"] == "Kaggle"
    one = dict(row for _, rows in detail_groups(make_plan(ONE_T4)) for row in rows)
    assert (one["accelerator"], one["runs in"], one["backend"]) == ("ready", "Colab", "nccl")


def test_details_use_plain_words_and_accelerates_option_names() -> None:
    groups = detail_groups(make_plan(CPU2, Request(num_processes=2)))
    assert [title for title, _ in groups] == ["plan", "runtime"]
    keys = [key for _, rows in groups for key, _ in rows]
    assert keys[:3] == ["num_processes", "mixed_precision", "cpu"]
    for key in ("threads", "timeout", "accelerator", "runs in", "CPUs", "GPUs", "TPU", "versions"):
        assert key in keys
    text = plan_text(make_plan(CPU2, Request(num_processes=2)))
    for jargon in ("shell:", "zmq", "eager", "lazy", "built now", "CPU budget", "platform"):
        assert jargon not in text


def test_long_text_lines_wrap_without_splitting_a_package_from_its_version() -> None:
    many = tuple((f"package{i}", f"1.{i}.0") for i in range(12))
    text = plan_text(make_plan(Runtime(platform="jupyter", versions=many)))
    assert max(len(line) for line in text.splitlines()) <= 100
    assert all(re.search(rf"package{i} 1\.{i}\.0", text) for i in range(12))
    assert "\u00a0" not in text


class Tags(HTMLParser):
    """Every tag opened and closed in order; void elements need no end tag."""

    VOID = {"br", "hr", "img", "wbr", "meta", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.seen: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        assert self.stack and self.stack[-1] == tag, (tag, self.stack)
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(markup: str) -> Tags:
    tags = Tags()
    tags.feed(markup)
    tags.close()
    assert tags.stack == [], tags.stack
    return tags


PLANS = {
    "two CPU ranks": make_plan(CPU2, Request(num_processes=2)),
    "fp16 and FSDP on CPU": make_plan(CPU2, FSDP_FP16),
    "two GPUs, bf16 asked": make_plan(TWO_T4, Request(mixed_precision="bf16")),
    "a TPU without torch_xla": make_plan(TPU_NO_XLA),
    "MPS": make_plan(MPS),
}


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_html_is_plain_balanced_markup_with_no_widget_script_or_stylesheet(plan) -> None:
    bundle = panel_bundle(plan)
    assert set(bundle) == {"text/plain", "text/html"}
    markup = bundle["text/html"]
    assert "widget-view" not in markup and "<script" not in markup.lower() and "<style" not in markup.lower()
    tags = parse(markup)
    names = [tag for tag, _ in tags.seen]
    assert names.count("details") == 1 and names.count("summary") == 1
    assert "table" in names and set(names) <= {"div", "span", "strong", "small", "table", "tbody", "tr", "th", "td"} | {
        "details",
        "summary",
    }
    text = "".join(tags.text)
    assert headline(plan) in text
    for topic, change, why in change_rows(plan):
        assert topic in text and change in text and why in text
    assert plan_html(plan) == markup


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_html_inherits_colors_and_overrides_notebook_table_styles_inline(plan) -> None:
    tags = parse(plan_html(plan))
    styles = [attrs.get("style") or "" for _, attrs in tags.seen]
    joined = ";".join(styles)
    # No fixed colors: text inherits the theme's, borders are translucent, backgrounds transparent.
    assert not re.search(r"#[0-9a-f]{3,6}\b|(?<![-\w])(white|black)(?![-\w])|rgb\(", joined, re.I)
    assert set(re.findall(r"background:([^;]+)", joined)) == {"transparent"}
    assert all(float(a) < 1 for a in re.findall(r"rgba\(\d+,\d+,\d+,([\d.]+)\)", joined))
    for tag, attrs in tags.seen:
        style = attrs.get("style") or ""
        if tag in ("td", "th"):  # front ends right-align and pad output tables
            assert "text-align:left" in style and "padding:" in style, (tag, style)
        if tag == "table":  # classic Notebook centers tables and makes their text black
            assert "color:inherit" in style and "margin:" in style
        if tag == "th" and attrs.get("scope") == "row":  # a key never wraps into what looks like a second row
            assert "white-space:nowrap" in style


def test_html_escapes_what_the_runtime_reports() -> None:
    odd = Runtime(
        platform="jupyter", gpus=(GPU(0, "<b>GPU</b> & co", 1024, (8, 0)),), torch_cuda_archs=(), versions=TODAY
    )
    markup = plan_html(make_plan(odd))
    assert "<b>GPU</b>" not in markup and "&lt;b&gt;GPU&lt;/b&gt; &amp; co" in markup
    parse(markup)


def test_the_details_say_how_cpu_ranks_average_gradients_and_how_to_turn_it_off() -> None:
    shm = make_plan(replace(CPU2, shared_memory=True), Request(num_processes=2))
    text = plan_text(shm)
    assert "allreduce        shm: the ranks average gradients in shared memory" in text
    assert "(--allreduce gloo turns it off)" in " ".join(text.split())
    assert "allreduce        gloo" in plan_text(make_plan(CPU2, Request(num_processes=2)))
