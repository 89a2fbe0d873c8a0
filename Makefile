# The two set-up commands (README): `make quickstart` runs the quick-start notebook headless,
# `make test` runs the whole test suite. Both build their environments first, from nothing but the pyenv
# interpreters (each requirements file names its Python on its first line).
VENV := .venv
STACKS := colab kaggle minimum
# The layers every pinned stack runs: everything but the binder/ build, which has a Python of its own.
PINNED_LAYERS := tests/unit tests/shell tests/kernel

.PHONY: env envs quickstart test lint test-main $(addprefix test-,$(STACKS)) bench

$(VENV)/.installed: requirements/test.txt pyproject.toml
	scripts/make_env.sh $(VENV) requirements/test.txt

.venv-%/.installed: requirements/%.txt pyproject.toml
	scripts/make_env.sh .venv-$* requirements/$*.txt

env: $(VENV)/.installed

# Every environment, built side by side (the downloads dominate).
envs: $(VENV)/.installed $(foreach s,$(STACKS),.venv-$(s)/.installed)

quickstart: $(VENV)/.installed
	$(VENV)/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check accel_magic tests scripts bench
	$(VENV)/bin/ruff format --check accel_magic tests scripts bench

# Today's releases: every layer, the binder/ environment included.
test-main: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -ra

# Colab's runtime (requirements/colab.txt), Kaggle's, and every dependency at its declared minimum.
$(addprefix test-,$(STACKS)): test-%: .venv-%/.installed
	.venv-$*/bin/python -m pytest -ra $(PINNED_LAYERS)

# The environments build in parallel; the tests run one stack at a time (they measure and time processes).
test:
	$(MAKE) -j4 envs
	$(MAKE) lint test-main $(addprefix test-,$(STACKS))

# Benchmarks: figures and ratios, written to bench/RESULTS.md; they never fail on speed.
bench: $(VENV)/.installed
	$(VENV)/bin/python bench/run.py
