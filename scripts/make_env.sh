#!/usr/bin/env bash
# make_env.sh DIR REQUIREMENTS: a virtual environment at DIR with the pinned REQUIREMENTS and this package
# installed over them (editable) with --no-deps, as `pip install accel-magic` in a running kernel keeps the
# runtime's packages: the pins decide every version, and a test checks that they satisfy pyproject's ranges.
# The first line of REQUIREMENTS, `# python X.Y`, names the interpreter, found through pyenv or on PATH.
set -euo pipefail
dir=$1 requirements=$2
version=$(sed -n '1s/^# python \([0-9.]*\)$/\1/p' "$requirements")
[ -n "$version" ] || { echo "$requirements: the first line must be '# python X.Y'" >&2; exit 2; }
if command -v pyenv >/dev/null && prefix=$(pyenv prefix "$version" 2>/dev/null); then
    python=$prefix/bin/python$version
else
    python=$(command -v "python$version") || { echo "Python $version is needed for $requirements" >&2; exit 2; }
fi
rm -rf "$dir"
"$python" -m venv "$dir"
# No download cache: three CUDA builds of torch would leave about 9 GB of wheels behind beside the environments.
export PIP_NO_CACHE_DIR=1
"$dir/bin/pip" install -q --upgrade pip
"$dir/bin/pip" install -q -r "$requirements"
"$dir/bin/pip" install -q --no-deps -e .
touch "$dir/.installed"
