#!/usr/bin/env bash
# gpu_wheels.sh [PYTHON_VERSION]: the wheels scripts/gpu_check.sh needs beyond torch and accelerate (a kernel and a
# notebook runner), downloaded into .whl/ for a GPU machine that cannot reach PyPI (default Python 3.12, x86_64).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.12}
python3 -m pip download -q --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl ipykernel nbclient nbformat ipython traitlets psutil
ls .whl | wc -l
