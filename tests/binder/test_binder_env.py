"""binder/ builds what mybinder.org would build, and every notebook runs in it.

`scripts/make_binder_env.sh` builds it as repo2docker would (binder/runtime.txt's Python, binder/requirements.txt
with pip, then binder/postBuild from the repository's root) at .venv-binder, with the two differences it states:
PyTorch's CPU index line is not honoured (this machine reaches only PyPI; the same CPU wheel, torch 2.13.0+cpu,
lies on its disk), and ipykernel and nbclient are added (repo2docker's base image brings the Jupyter server and
ipykernel; nbclient runs the notebooks here). `make test` builds it beside the other environments; run alone, this
test builds it when it is missing or older than what it is built from.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
BUILD = ROOT / "scripts" / "make_binder_env.sh"
ENV = ROOT / ".venv-binder"


def _built_from() -> list[Path]:
    return [BUILD, ROOT / "pyproject.toml", *(ROOT / "binder").iterdir(), *(ROOT / "accel_magic").rglob("*.py")]


@pytest.fixture(scope="module")
def binder_env() -> Path:
    done = ENV / ".installed"
    if not done.exists() or any(p.stat().st_mtime > done.stat().st_mtime for p in _built_from()):
        subprocess.run([str(BUILD), str(ENV)], check=True)
    return ENV


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
