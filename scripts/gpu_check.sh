#!/usr/bin/env bash
# make gpu-check: the GPU path end to end in real kernels (scripts/gpu_check.py), on a machine with NVIDIA GPUs.
# It builds what it needs in .venv-gpu, beside the machine's own torch and accelerate where it has them (a venv
# with the system's packages): from PyPI, or with no network from the wheels in .whl/ that
# scripts/gpu_wheels.sh downloads beforehand on a machine that has one. CI never runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null; then
    echo "gpu-check: no NVIDIA GPU on this machine (nvidia-smi not found): nothing was checked"
    exit 0
fi
python=${PYTHON:-python3}
venv=.venv-gpu
[ -x $venv/bin/python ] || "$python" -m venv --system-site-packages $venv
missing=$($venv/bin/python - <<'PY'
import importlib.util
needed = {"torch": "torch", "accelerate": "accelerate", "ipykernel": "ipykernel", "nbclient": "nbclient",
          "nbformat": "nbformat", "psutil": "psutil", "IPython": "ipython", "traitlets": "traitlets"}
print(" ".join(pkg for module, pkg in needed.items() if importlib.util.find_spec(module) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu-check: installing $missing"
    if [ -d .whl ]; then
        $venv/bin/python -m pip install -q --no-index --find-links .whl $missing
    else
        $venv/bin/python -m pip install -q $missing
    fi
fi
# The kernels import this checkout's accel_magic, as the tests' kernels do.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec timeout 540 $venv/bin/python scripts/gpu_check.py
