"""binder/ builds what mybinder.org would build, and every notebook runs in it.

repo2docker reads binder/runtime.txt (the Python), installs binder/requirements.txt with pip, then runs
binder/postBuild from the repository's root. This test does the same in a fresh virtual environment, with
two differences it states: the PyTorch CPU index line is not honoured (this machine reaches only PyPI; the
same CPU wheel, torch 2.13.0+cpu, lies on its disk), and ipykernel and nbclient are added (repo2docker's
base image brings the Jupyter server and ipykernel; nbclient runs the notebooks here).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
BINDER = ROOT / "binder"
NOT_HONOURED = "--extra-index-url https://download.pytorch.org/whl/cpu"
RUNNER_TOOLS = ["ipykernel==7.4.0", "nbclient==0.11.0", "nbformat==5.11.1"]


@pytest.fixture(scope="module")
def binder_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = (BINDER / "runtime.txt").read_text().strip().removeprefix("python-")
    python = shutil.which(f"python{version}")
    assert python, f"binder/runtime.txt asks for Python {version}, which this machine lacks"
    env_dir = tmp_path_factory.mktemp("binder") / "env"
    subprocess.run([python, "-m", "venv", str(env_dir)], check=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    assert NOT_HONOURED in lines, "binder/requirements.txt must keep PyTorch's CPU index for mybinder.org"
    requirements = tmp_path_factory.mktemp("binder") / "requirements.txt"
    requirements.write_text("\n".join(line for line in lines if line.strip() != NOT_HONOURED) + "\n")
    print(f"binder: not honoured here: {NOT_HONOURED!r} (PyTorch's index is unreachable; the CPU wheel is on disk)")
    subprocess.run([*pip, "-r", str(requirements), *RUNNER_TOOLS], check=True)
    env = dict(os.environ, PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(env_dir))
    env.pop("PYTHONPATH", None)
    subprocess.run([str(BINDER / "postBuild")], cwd=ROOT, env=env, check=True)
    return env_dir


def test_binder_environment_installs_the_package_and_a_cpu_torch(binder_env: Path) -> None:
    code = "import accel_magic, torch; print(accel_magic.__file__); print(torch.__version__)"
    out = subprocess.run(
        [str(binder_env / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd="/", check=True
    )
    where, torch_version = out.stdout.split()
    assert where.startswith(str(binder_env)) and torch_version.endswith("+cpu")


def test_every_notebook_runs_in_the_binder_environment(binder_env: Path) -> None:
    notebooks = sorted(str(p) for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 3
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(binder_env / "bin" / "python"), str(ROOT / "scripts" / "run_notebook.py"), *notebooks],
        capture_output=True,
        text=True,
        env=env,
    )
    print(result.stdout[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "test accuracy in the notebook" in result.stdout
        and "largest difference from rank 0's weights: 0.0" in result.stdout
    )
