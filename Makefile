# The two set-up commands (README): `make quickstart` runs the quick-start notebook headless,
# `make test` runs the whole test suite. Both build their environments first, from nothing but Python 3.11.
PYTHON ?= python3.11
export PYTHON
VENV := .venv
COLAB := .venv-colab
ACC112 := .venv-accelerate-1.12

.PHONY: env quickstart test lint test-main test-colab test-accelerate-1.12 bench

$(VENV)/.installed: requirements/test.txt pyproject.toml
	scripts/make_env.sh $(VENV) requirements/test.txt

$(COLAB)/.installed: requirements/colab.txt pyproject.toml
	scripts/make_env.sh $(COLAB) requirements/colab.txt

$(ACC112)/.installed: requirements/accelerate-1.12.txt pyproject.toml
	scripts/make_env.sh $(ACC112) requirements/accelerate-1.12.txt

env: $(VENV)/.installed

quickstart: $(VENV)/.installed
	$(VENV)/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check accel_magic tests scripts bench
	$(VENV)/bin/ruff format --check accel_magic tests scripts bench

# Today's stack: every layer, the binder/ environment included.
test-main: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -ra

# Colab's pinned stack (IPython 7.34, ipykernel 6.17.1, ipywidgets 7.7.1, accelerate 1.14): magics, kernels, notebooks.
test-colab: $(COLAB)/.installed
	$(COLAB)/bin/python -m pytest -ra tests/shell tests/kernel

# The oldest supported accelerate, 1.12.0.
test-accelerate-1.12: $(ACC112)/.installed
	$(ACC112)/bin/python -m pytest -ra tests/shell tests/kernel

test: lint test-main test-colab test-accelerate-1.12

# Benchmarks: figures and ratios, written to bench/RESULTS.md; they never fail on speed.
bench: $(VENV)/.installed
	$(VENV)/bin/python bench/run.py
