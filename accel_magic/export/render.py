"""The exported files as text: the script, its SLURM batch file and the commands that run them."""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ExportError
from .slicing import Cell

__all__ = ["DEFAULT_OUTPUT", "Settings", "Export", "script_paths", "commands", "slurm_script", "script_text"]

DEFAULT_OUTPUT = "accel_export_output"


@dataclass(frozen=True)
class Settings:
    """What the script takes from the notebook's plan."""

    num_processes: int = 1
    cpu: bool = True
    mixed_precision: str = "no"
    timeout: float = 900.0
    gpus: bool = False  # the plan trains on CUDA GPUs: the SLURM job asks for them
    threads_per_process: int = 1  # on a CPU plan the SLURM job asks for num_processes * threads CPUs per node
    accelerator_name: str = "accelerator"


@dataclass(frozen=True)
class Export:
    """The script, the SLURM batch file and the commands that run them, with the cells taken and why."""

    script: str
    slurm: str
    commands: tuple[str, ...]
    cells: tuple[tuple[int, str], ...]  # (execution count, why it was taken), in the order they ran
    script_path: str
    slurm_path: str

    def write(self) -> None:
        """Write the script and the SLURM file (an existing file is replaced)."""
        Path(self.script_path).expanduser().write_text(self.script)
        Path(self.slurm_path).expanduser().write_text(self.slurm)

    def summary(self) -> str:
        taken, commands = _listing(self.cells, self.commands)
        return (
            f"Wrote {self.script_path} and {self.slurm_path} from these cells:\n{taken}\n"
            f"Run it with one of:\n{commands}"
        )


def _listing(cells: Iterable[tuple[int, str]], commands: Iterable[str]) -> tuple[str, str]:
    """The cells taken ("  [3] defines model (used by [5])") and the commands, a line each."""
    return "\n".join(f"  [{count}] {why}" for count, why in cells), "\n".join(f"  {c}" for c in commands)


def script_paths(path: str) -> tuple[str, str]:
    """The script's path as given and its SLURM file's; refuses a path that cannot be written."""
    target = Path(path).expanduser()
    if target.suffix != ".py":
        raise ExportError(f"{path!r} is not a .py file: give the script a name ending in .py, such as train.py.")
    if target.is_dir():
        raise ExportError(f"{path!r} is a folder: give the path of the script to write, such as {path}/train.py.")
    if not target.parent.is_dir():
        raise ExportError(f"The folder {str(target.parent)!r} does not exist: create it first, or write elsewhere.")
    slurm = path[: -len(".py")] + ".slurm"
    if Path(slurm).expanduser().is_dir():
        raise ExportError(f"{slurm!r} is a folder: choose another name for the script.")
    return path, slurm


def commands(script: str, slurm: str, settings: Settings, output: str = DEFAULT_OUTPUT) -> tuple[str, ...]:
    """accelerate launch, torchrun, plain python (one process), and sbatch, as a user types them."""
    n, path = settings.num_processes, shlex.quote(script)
    # accelerate's --cpu starts one process unless given an MPI hostfile; --multi_gpu is its torchrun launcher,
    # and the script's Accelerator(cpu=True) keeps those processes on the CPU.
    mode = "--multi_gpu " if n > 1 else ("--cpu " if settings.cpu else "")
    precision = f" --mixed_precision {settings.mixed_precision}" if settings.mixed_precision != "no" else ""
    out = f"--output-dir {shlex.quote(output)}"
    return (
        f"accelerate launch {mode}--num_processes {n}{precision} {path} {out}",
        f"torchrun --nproc-per-node {n} {path} {out}",
        f"python {path} {out}",
        f"sbatch {shlex.quote(slurm)}",
    )


def slurm_script(script: str, settings: Settings, port: int, job: str, output: str = DEFAULT_OUTPUT) -> str:
    n = settings.num_processes
    cpus_for_srun = ""
    if settings.gpus:
        resources = f"#SBATCH --gpus-per-node={n}"
    else:
        cpus = max(n, n * settings.threads_per_process)
        resources = (
            f"#SBATCH --cpus-per-task={cpus}\n# {n} process(es) x {settings.threads_per_process} thread(s) per node, "
            "as the notebook's plan has it: adjust\n# --cpus-per-task to the cores a node gives this job, at least "
            "one per process."
        )
        cpus_for_srun = 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"  # srun does not pass it on by itself\n'

    return f"""#!/bin/bash
#SBATCH --job-name={shlex.quote(job)}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
{resources}
# Written by accel_magic's %accel_export with {script}: each node runs one torchrun, which starts {n} process(es)
# there; the nodes meet through torch's c10d rendezvous on the job's first node, port {port}. Submit it from the
# folder you exported from: sbatch <this file>. Change --nodes above to use more machines.
set -euo pipefail
{cpus_for_srun}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

srun torchrun \\
    --nnodes "$SLURM_NNODES" \\
    --nproc-per-node {n} \\
    --rdzv-id "$SLURM_JOB_ID" \\
    --rdzv-backend c10d \\
    --rdzv-endpoint "$head_node:{port}" \\
    {shlex.quote(script)} --output-dir {shlex.quote(output)}
"""


_HELPERS = '''
def _accel_environment(num_processes):
    """Refuse a launch that asked for several processes but started one; keep gloo on loopback on one machine."""
    import os
    import sys

    env = os.environ
    sizes = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    if not any(key in env for key in sizes) and "ACCELERATE_DYNAMO_BACKEND" in env and "MASTER_PORT" in env:
        sys.exit(
            "accelerate launch started one process, not several: its --cpu needs an MPI hostfile for more, so run "
            f"`accelerate launch --multi_gpu --num_processes {num_processes} ...` (this script stays on the CPU)."
        )
    if sys.platform == "linux" and "WORLD_SIZE" in env and env.get("LOCAL_WORLD_SIZE") == env["WORLD_SIZE"]:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: the hostname's interface is flaky in containers


def _accel_record(accelerator):
    """accelerator.prepare, its prepare_model/_optimizer/_scheduler and register_for_checkpointing, remembering what
    they were given and returned (prepare calls the others: a pair may be recorded twice)."""
    prepared, registered = [], []

    def recorded(prepare):
        def wrapper(*objects, **kwargs):
            result = prepare(*objects, **kwargs)
            prepared.extend(zip(objects, result if isinstance(result, tuple) else (result,)))
            return result

        return wrapper

    for method in ("prepare", "prepare_model", "prepare_optimizer", "prepare_scheduler"):
        setattr(accelerator, method, recorded(getattr(accelerator, method)))
    register = accelerator.register_for_checkpointing

    def recorded_register(*objects):
        registered.extend(objects)
        return register(*objects)

    accelerator.register_for_checkpointing = recorded_register
    return prepared, registered


def _accel_as_in_notebook(namespace, prepared):
    """After an earlier %%accel_train cell the notebook held its own objects again, with the trained state."""
    for name, value in list(namespace.items()):
        for given, returned in prepared:
            if value is returned and not name.startswith("_"):
                namespace[name] = given


def _accel_save(accelerator, namespace, prepared, registered, output_dir):
    """Write the state of every named model, optimizer, scheduler and registered object, as the notebook got it
    back: models through accelerator.get_state_dict on every process (a collective under FSDP and DeepSpeed),
    the files from the main process; then end the process group."""
    import os
    import sys
    import time

    import torch
    from torch.utils.data import DataLoader

    accelerator.wait_for_everyone()
    states, seen = {}, set()
    pairs = list(prepared) + [(obj, obj) for obj in registered]
    for name, value in list(namespace.items()):
        for given, returned in pairs:
            if name.startswith("_") or id(given) in seen or (value is not given and value is not returned):
                continue
            if isinstance(given, DataLoader) or isinstance(returned, DataLoader) or not hasattr(returned, "state_dict"):
                continue
            seen.add(id(given))
            if isinstance(given, torch.nn.Module):
                states[name] = accelerator.get_state_dict(returned)
            else:
                states[name] = returned.state_dict()
    if accelerator.is_main_process and not states:
        print(
            "warning: no model, optimizer or scheduler that went through the accelerator's prepare is bound to a name "
            "at the end of the script, so nothing was saved: keep what prepare returns in a name, such as "
            "`model = accelerator.prepare(model)`.",
            file=sys.stderr,
        )
    elif accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        for name, state in states.items():
            path = os.path.join(output_dir, f"{name}.pt")
            torch.save(state, path)
            print(f"wrote {path}")
    accelerator.wait_for_everyone()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        # A gloo worker thread frees its last collective's tensors a moment after the collective returns, and needs
        # the GIL for it; if the interpreter is already exiting, that thread aborts the process ("terminate called
        # without an active exception", about 1 run in 40 on two CPU ranks). Sleeping hands it the GIL.
        time.sleep(0.1)
'''


def _docstring_text(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def script_text(
    cells: list[Cell],
    reasons: dict[int, str],
    settings: Settings,
    runs: tuple[str, ...],
    source: str,
    display: bool,
    training: int,
    needs: set[str],
) -> str:
    name = settings.accelerator_name
    taken, run_lines = _listing(((c.count, reasons[c.count]) for c in cells), runs)
    header = f'''"""Training script exported by accel_magic's %accel_export from {_docstring_text(source)}.

The cells it runs, in the order they ran in the notebook:
{_docstring_text(taken)}

The Accelerator is built as the notebook's plan said: {settings.num_processes} process(es), cpu={settings.cpu},
mixed_precision={settings.mixed_precision!r}, a collective may wait {settings.timeout:g} s for the other processes.

Run it with one of (the last one submits the SLURM batch file written next to it):
{_docstring_text(run_lines)}

The main process writes the trained state of every model, optimizer and scheduler that went through
{name}.prepare (or prepare_model, prepare_optimizer, prepare_scheduler) to <output-dir>/<name>.pt; read it with
torch.load(path, map_location="cpu").
"""
'''
    imports = "import argparse\n" + "".join(f"import {module}\n" for module in sorted(needs))
    parts = [
        header,
        f"\n{imports}from datetime import timedelta\n\nfrom accelerate import Accelerator\n"
        "from accelerate.utils import InitProcessGroupKwargs\n\n",
        _HELPERS,
        f"""

_accel_parser = argparse.ArgumentParser(description="Run the notebook's training cell.")
_accel_parser.add_argument("--output-dir", default="{DEFAULT_OUTPUT}", help="folder for the trained state")
_accel_args = _accel_parser.parse_args()
_accel_environment({settings.num_processes})

{name} = Accelerator(
    cpu={settings.cpu!r},
    mixed_precision="{settings.mixed_precision}",
    kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds={settings.timeout:g}))],
)
_accel_prepared, _accel_registered = _accel_record({name})
""",
    ]
    if display:
        parts.append(
            "\ntry:\n    from IPython.display import display\nexcept ImportError:  # outside IPython: print it\n"
            "    display = print\n"
        )
    for cell in cells:
        label = "the %%accel_train cell" if cell.count == training else reasons[cell.count].split(";")[0]
        parts.append(f"\n# --- cell [{cell.count}]: {label} ---\n{cell.source.rstrip()}\n")
        if cell.training and cell.count != training:
            parts.append("_accel_as_in_notebook(globals(), _accel_prepared)\n")
    parts.append(
        "\n# --- the trained state, as the notebook got it back ---\n"
        f"_accel_save({name}, globals(), _accel_prepared, _accel_registered, _accel_args.output_dir)\n"
    )
    return "".join(parts)
