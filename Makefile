# The two set-up commands (README): `make quickstart` runs the quick-start notebook headless,
# `make test` runs the whole test suite. Both build the environment first, from nothing but Python 3.11.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: env quickstart test lint

$(STAMP): requirements/test.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements/test.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

env: $(STAMP)

quickstart: $(STAMP)
	$(BIN)/python scripts/run_notebook.py notebooks/01_quickstart.ipynb

lint: $(STAMP)
	$(BIN)/ruff check accel_magic tests scripts bench
	$(BIN)/ruff format --check accel_magic tests scripts bench

test: lint
	$(BIN)/python -m pytest -ra
