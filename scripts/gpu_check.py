"""The GPU path end to end in real kernels, on a machine with NVIDIA GPUs (`make gpu-check`; CI has none).

One line per check, with its figure: PASS, FAIL or SKIP (a check that needs two GPUs on a machine with one).
Exits 1 when a check failed, 0 otherwise; on a machine without an NVIDIA GPU it checks nothing and says so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import nbformat
from nbclient import NotebookClient

BUDGET = 8 * 60  # seconds for every check together
started = time.monotonic()
failed = False


def gpu_count() -> int:
    """NVIDIA GPUs as nvidia-smi lists them (no CUDA call in this process)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return len(re.findall(r"^GPU \d+:", listed, re.MULTILINE))


def run(*cells: str, timeout: int = 240) -> list[str]:
    """Run cells in a fresh kernel; each cell's text output (errors as `ename: evalue`)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in cells]
    NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True).execute()
    texts = []
    for cell in nb.cells:
        parts = []
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                parts.append(out["text"])
            elif out["output_type"] == "error":
                parts.append(f"{out['ename']}: {out['evalue']}\n")
            else:
                parts.append(out.get("data", {}).get("text/plain", "") + "\n")
        texts.append("".join(parts))
    return texts


def check(name: str, body: Callable[[], str]) -> None:
    """Run one check; its line says PASS with the figure it returns, SKIP, or FAIL with why."""
    global failed
    if time.monotonic() - started > BUDGET:
        print(f"SKIP {name}: the {BUDGET // 60} minutes of the check were spent", flush=True)
        return
    t0 = time.monotonic()
    try:
        figure = body()
    except Skip as why:
        print(f"SKIP {name}: {why}", flush=True)
        return
    except Exception as err:
        failed = True
        print(f"FAIL {name}: {type(err).__name__}: {err}".replace("\n", " | ")[:2000], flush=True)
        return
    print(f"PASS {name}: {figure} ({time.monotonic() - t0:.1f} s)", flush=True)


class Skip(Exception):
    pass


def expect(condition: bool, text: str) -> None:
    if not condition:
        raise AssertionError(text)


SETUP = "%load_ext accel_magic\n%accel_setup --quiet\n"


def setup_leaves_cuda_uninitialized() -> str:
    (out,) = run(
        "%load_ext accel_magic\nplan = %accel_setup --quiet\nimport torch\n"
        "print('plan', plan.device, plan.backend, plan.num_processes, plan.runtime.gpus[0].name)\n"
        "print('initialized', torch.cuda.is_initialized())"
    )
    expect("plan cuda nccl" in out and "initialized False" in out, out)
    return out.strip().replace("\n", "; ")


def one_gpu_trains_in_the_kernel_with_fp16_autocast() -> str:
    out = run(
        "%load_ext accel_magic\n%accel_setup --quiet -n 1 --mixed-precision fp16",
        """
        %%accel_train -n 1
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        x, y = torch.randn(512, 256, device=accelerator.device), torch.randint(0, 10, (512,), device=accelerator.device)
        losses = []
        for _ in range(50):
            with accelerator.autocast():
                inner = model[0](x)  # prepare() hands the model's own output back in fp32: look inside
                loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        print("device", accelerator.device, "dtype", inner.dtype, "precision", accelerator.mixed_precision)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        """,
    )[1]
    expect("device cuda" in out and "dtype torch.float16" in out and "precision fp16" in out, out)
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups())
    expect(last < first, out)
    return out.strip().replace("\n", "; ")


def more_ranks_than_gpus_is_one_sentence(gpus: int) -> Callable[[], str]:
    def body() -> str:
        out = run("%load_ext accel_magic", f"%%accel_train -n {gpus + 1}\nprint('ran')")[1]
        expect("ran" not in out and out.count("\n") == 1 and "GPUs" in out, out)
        return out.strip()

    return body


def a_launch_after_cuda_in_the_kernel_is_refused() -> str:
    out = run(SETUP + "import torch\nx = torch.zeros(1, device='cuda')", "%%accel_train -n 1 --background\nprint(1)")[1]
    expect("CUDA is already initialized in this kernel" in out and out.count("\n") == 1, out)
    return out.strip()


def a_forked_rank_trains_on_the_gpu() -> str:
    out = run(
        "%load_ext accel_magic",
        "%%accel_train -n 1 --background\nimport torch\n"
        "t = torch.ones(4, device=accelerator.device) * 2\nprint('rank', accelerator.device, t.sum().item())",
        "%accel_wait\nprint(accel_result.output)\n"
        "import torch\nprint('kernel initialized', torch.cuda.is_initialized())",
    )[2]
    expect("rank cuda:0 8.0" in out and "kernel initialized False" in out, out)
    return out.strip().replace("\n", "; ")


def two_gpus_train_with_nccl_to_identical_weights(gpus: int) -> Callable[[], str]:
    def body() -> str:
        if gpus < 2:
            raise Skip(f"needs two GPUs, this machine has {gpus}")
        out = run(
            SETUP + "import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Linear(64, 4)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
            """
            %%accel_train -n 2
            import torch
            model, opt = accelerator.prepare(model, opt)
            g = torch.Generator().manual_seed(accelerator.process_index)
            for _ in range(10):
                x = torch.randn(32, 64, generator=g).to(accelerator.device)
                accelerator.backward(model(x).pow(2).mean()); opt.step(); opt.zero_grad()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            every = accelerator.gather(flat[None])
            print("backend", accelerator.state.backend, "ranks", accelerator.num_processes,
                  "max difference", (every - every[0]).abs().max().item())
            """,
        )[1]
        expect("backend nccl ranks 2 max difference 0.0" in out, out)
        return out.strip().replace("\n", "; ")

    return body


def accelerates_clean_cuda_fork_test_holds(gpus: int) -> Callable[[], str]:
    def body() -> str:
        out = run(
            SETUP,
            f"""
            import os
            os.environ["ACCELERATE_NUM_PROCESSES"] = "{max(gpus, 1)}"
            import accelerate.test_utils.scripts.test_notebook as suite
            if not hasattr(suite, "test_clean_cuda_fork"):
                print("absent from this accelerate")
            else:
                from accel_magic import notebook_launcher
                from accelerate import notebook_launcher as accelerates
                for launcher in (notebook_launcher, accelerates):
                    suite.notebook_launcher = launcher
                    suite.test_clean_cuda_fork()
                    print("held:", launcher.__module__)
            """,
        )[1]
        if "absent from this accelerate" in out:
            raise Skip("this accelerate has no test_clean_cuda_fork")
        expect(out.count("held:") == 2, out)
        return out.strip().replace("\n", "; ")

    return body


def main() -> int:
    gpus = gpu_count()
    if gpus == 0:
        print("gpu-check: no NVIDIA GPU on this machine (nvidia-smi lists none): nothing was checked")
        return 0
    print(f"gpu-check: {gpus} NVIDIA GPU(s); Python {sys.version.split()[0]}; accel_magic from {os.getcwd()}")
    print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout.strip())
    check("%accel_setup leaves CUDA uninitialized in the kernel", setup_leaves_cuda_uninitialized)
    check("one GPU trains in the kernel with fp16 autocast", one_gpu_trains_in_the_kernel_with_fp16_autocast)
    check(f"-n {gpus + 1} on {gpus} GPU(s) is one sentence", more_ranks_than_gpus_is_one_sentence(gpus))
    check("a launch after CUDA was initialized in the kernel is refused", a_launch_after_cuda_in_the_kernel_is_refused)
    check("a forked rank trains on cuda:0, the kernel CUDA-free", a_forked_rank_trains_on_the_gpu)
    check("-n 2 on two GPUs trains with nccl to identical weights", two_gpus_train_with_nccl_to_identical_weights(gpus))
    check("accelerate's test_clean_cuda_fork holds", accelerates_clean_cuda_fork_test_holds(gpus))
    print(f"gpu-check: {'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
