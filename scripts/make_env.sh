#!/usr/bin/env bash
# make_env.sh DIR REQUIREMENTS: a virtual environment at DIR with the pinned REQUIREMENTS and this package
# (editable, no dependencies of its own: the pins decide every version).
set -euo pipefail
dir=$1 requirements=$2 python=${PYTHON:-python3.11}
rm -rf "$dir"
"$python" -m venv "$dir"
"$dir/bin/pip" install -q --upgrade pip
"$dir/bin/pip" install -q -r "$requirements"
"$dir/bin/pip" install -q --no-deps --no-build-isolation -e .
touch "$dir/.installed"
