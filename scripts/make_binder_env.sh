#!/usr/bin/env bash
# make_binder_env.sh DIR: what mybinder.org builds from binder/, in a virtual environment at DIR. repo2docker reads
# binder/runtime.txt (the Python), installs binder/requirements.txt with pip, then runs binder/postBuild from the
# repository's root (here from a copy, as repo2docker copies the repository into its image: the environments built
# beside this one install from the checkout itself, and two builds in one folder would meet). Two differences, said when it runs: PyTorch's CPU index line is not honoured (this machine
# reaches only PyPI; the same CPU wheel, torch 2.13.0+cpu, lies on its disk), and ipykernel, nbclient and nbformat
# are added (repo2docker's base image brings the Jupyter server and ipykernel; nbclient runs the notebooks here).
set -euo pipefail
dir=$(realpath -m "$1")
cd "$(dirname "$0")/.."
not_honoured="--extra-index-url https://download.pytorch.org/whl/cpu"
grep -qxF -- "$not_honoured" binder/requirements.txt ||
    { echo "binder/requirements.txt must keep PyTorch's CPU index for mybinder.org" >&2; exit 2; }
version=$(sed 's/^python-//' binder/runtime.txt)
python=$(command -v "python$version") ||
    { echo "binder/runtime.txt asks for Python $version, which this machine lacks" >&2; exit 2; }
echo "binder: not honoured here: '$not_honoured' (PyTorch's index is unreachable; the CPU wheel is on disk)"
rm -rf "$dir"
"$python" -m venv "$dir"
export PIP_NO_CACHE_DIR=1
grep -vxF -- "$not_honoured" binder/requirements.txt > "$dir/requirements.txt"
"$dir/bin/python" -m pip install -q -r "$dir/requirements.txt" ipykernel==7.4.0 nbclient==0.11.0 nbformat==5.11.1
mkdir "$dir/repository"
tar --exclude='./.venv*' --exclude=./.uv-cache --exclude=./.git --exclude=./build --exclude='./*.egg-info' -cf - . | tar -xf - -C "$dir/repository"
(cd "$dir/repository"; unset PYTHONPATH; PATH="$dir/bin:$PATH" VIRTUAL_ENV="$dir" binder/postBuild)
rm -rf "$dir/repository"
touch "$dir/.installed"
