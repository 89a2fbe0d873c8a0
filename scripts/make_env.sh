#!/usr/bin/env bash
# make_env.sh DIR REQUIREMENTS [UV]: a virtual environment at DIR with the pinned REQUIREMENTS and this package
# installed over them (editable) with --no-deps, as `pip install accel-magic` in a running kernel keeps the
# runtime's packages: the pins decide every version, and a test checks that they satisfy pyproject's ranges.
# The first line of REQUIREMENTS, `# python X.Y`, names the interpreter, found through pyenv or on PATH.
# Given UV (the path of a uv binary), uv installs the pins, fetching in parallel (a stack whose torch is PyPI's
# CUDA build downloads several GB), and looks where pip is told to look (PIP_FIND_LINKS, or pip's configuration):
# where this kind of machine keeps its CPU wheel of torch. Without UV, pip installs them.
set -euo pipefail
dir=$1 requirements=$2 uv=${3:-}
version=$(sed -n '1s/^# python \([0-9.]*\)$/\1/p' "$requirements")
[ -n "$version" ] || { echo "$requirements: the first line must be '# python X.Y'" >&2; exit 2; }
if command -v pyenv >/dev/null && prefix=$(pyenv prefix "$version" 2>/dev/null); then
    python=$prefix/bin/python$version
else
    python=$(command -v "python$version") || { echo "Python $version is needed for $requirements" >&2; exit 2; }
fi
rm -rf "$dir"
"$python" -m venv "$dir"
# No pip cache. uv unpacks into one cache in the checkout (.uv-cache, on the environments' own file system, never
# /tmp, which may be small or elsewhere) and hard-links every file from there: the stacks' identical CUDA libraries
# (about 4 GB each) are fetched once and stored once, the cache costs no space beside the environments, and
# building an environment again downloads nothing it had.
export PIP_NO_CACHE_DIR=1
"$dir/bin/pip" install -q --upgrade pip
if [ -n "$uv" ]; then
    links=${PIP_FIND_LINKS:-$("$dir/bin/pip" config get global.find-links 2>/dev/null || true)}
    [ -z "$links" ] || export UV_FIND_LINKS=${links// /,}
    # compiled to bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else ever compiles it, and
    # every kernel and process would compile torch anew (about 1.5 s more for each import of torch)
    UV_CACHE_DIR=$(cd "$(dirname "$0")/.." && pwd)/.uv-cache UV_LINK_MODE=hardlink UV_COMPILE_BYTECODE=1 "$uv" pip install -q --python "$dir/bin/python" -r "$requirements"
else
    "$dir/bin/pip" install -q -r "$requirements"
fi
"$dir/bin/pip" install -q --no-deps -e .
touch "$dir/.installed"
