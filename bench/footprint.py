"""Memory a launch needs: the estimate the launch makes before it starts (accel_magic.footprint) against the
measured peak of what the kernel and its ranks allocated beyond what the kernel held before (a memory cgroup the
kernel enters just before the launch: pages it held stay counted where they were), for the bench MLP and a small
transformers model (GPT-2 layout, made from its config), AdamW, 20 steps, at -n 1 (in the kernel), -n 2 and -n 4:
after one step of a copy in the notebook (as a notebook that tried its model first), and on first use, where the
modules a first step imports come on top (not part of the estimate)."""

from __future__ import annotations

from common import Section, figures, run_cells, verdict

MODELS = {
    "MLP 128-1024-1024-10": """
model = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
def loss_of(model, i, share):
    x, y = torch.randn(128 // share, 128), torch.randint(0, 10, (128 // share,))
    return torch.nn.functional.cross_entropy(model(x), y)
""",
    "GPT-2 layout, 6 layers of 512, 19M parameters": """
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(vocab_size=2000, n_positions=64, n_embd=512, n_layer=6, n_head=8))
def loss_of(model, i, share):
    ids = torch.randint(0, 2000, (8 // share, 32))
    return model(input_ids=ids, labels=ids).loss
""",
}

PREPARE = """
import os, time, torch
get_ipython().run_line_magic("load_ext", "accel_magic")
get_ipython().run_line_magic("accel_setup", "--quiet")
from accel_magic import footprint
torch.manual_seed(0)
{model}
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
lines = open("/proc/self/cgroup").read().splitlines()
v1 = [line.split(":", 2)[2] for line in lines if ":memory:" in line]
own = "/sys/fs/cgroup/memory" + v1[0] if v1 else "/sys/fs/cgroup" + lines[-1].split(":", 2)[2]
cgroup = os.path.join(own, f"accel-magic-bench-{{os.getpid()}}")
os.makedirs(cgroup, exist_ok=True)
peak_file = os.path.join(cgroup, "memory.max_usage_in_bytes" if v1 else "memory.peak")
"""
BODY = """
model, opt = accelerator.prepare(model, opt)
for i in range(20):
    accelerator.backward(loss_of(model, i, accelerator.num_processes))
    opt.step(); opt.zero_grad()
"""
WARM = """
import copy, gc
trial = copy.deepcopy(model)
trial_opt = torch.optim.AdamW(trial.parameters())
loss_of(trial, 0, 1).backward(); trial_opt.step()
del trial, trial_opt; gc.collect()
"""
ESTIMATE = """
plan = get_ipython().run_line_magic("accel_setup", "--quiet -n {n}")
fp = footprint.estimate(footprint.used_objects(compile({body!r}, "cell", "exec"), globals()), {n},
                        in_kernel=plan.launch == "kernel", shared_memory=plan.allreduce == "shm",
                        kernel_private=footprint.kernel_private())
print("ESTIMATE", fp.total / 2**20)
open(os.path.join(cgroup, "cgroup.procs"), "w").write(str(os.getpid()))
"""
READ = """
print("PEAK", int(open(peak_file).read()) / 2**20)
open(os.path.join(own, "cgroup.procs"), "w").write(str(os.getpid()))
for _ in range(50):
    try:
        os.rmdir(cgroup); break
    except OSError:
        time.sleep(0.1)
"""


def measure(counts: tuple[int, ...] = (1, 2, 4), first_use: bool = True) -> Section:
    rows, worst = [], 0.0
    for name, model in MODELS.items():
        for warm in (True, False) if first_use else (True,):
            for n in counts:
                cells = [PREPARE.format(model=model.strip()), WARM if warm else "", ESTIMATE.format(body=BODY, n=n)]
                cells += [f"%%accel_train -n {n} --no-return\n{BODY}", READ]
                text = "".join(run_cells(cells))
                (estimate,), peak = figures(text, "ESTIMATE"), figures(text, "PEAK")
                launch = f"-n {n}" + ("" if warm else ", first use")
                if not peak:
                    rows.append([name, launch, f"{estimate:.0f}", "no memory cgroup here", ""])
                    continue
                ratio = estimate / peak[0]
                if warm:
                    worst = max(worst, abs(ratio - 1))
                rows.append([name, launch, f"{estimate:.0f}", f"{peak[0]:.0f}", f"{ratio:.2f}"])
    section = Section(
        "8. Memory a launch needs",
        "The launch's estimate before it starts against the measured peak of what the kernel and its ranks "
        "allocated beyond what the kernel held (a memory cgroup entered just before the launch); AdamW, 20 steps, "
        "after one step of a copy in the notebook, or on first use, where the modules a first step imports come "
        "on top; MiB.",
        ["model", "launch", "estimate", "measured peak", "estimate / peak"],
        rows,
    )
    section.verdicts = [verdict("largest distance of the estimate from the peak, after a step", worst * 100, 30, " %")]
    return section
