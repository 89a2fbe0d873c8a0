# The two set-up commands (README): `make quickstart` runs the quick-start notebook headless,
# `make test` runs the whole test suite. Both build their environments first, from nothing but the pyenv
# interpreters (each requirements file names its Python on its first line).
VENV := .venv
STACKS := colab kaggle minimum
# The layers every pinned stack runs: everything but the binder/ build, which has a Python of its own.
PINNED_LAYERS := tests/unit tests/ranks tests/shell tests/kernel

.PHONY: env envs quickstart test lint docs test-main test-main-layers test-main-browser $(addprefix test-,$(STACKS)) bench chromium screenshots gpu-check

# uv installs the environments' pins, fetching in parallel (a pinned stack's torch is PyPI's CUDA build, GBs).
UV := .venv-uv/bin/uv
.venv-uv/.installed:
	rm -rf .venv-uv && python3 -m venv .venv-uv && .venv-uv/bin/pip install -q uv==0.13.9 && touch $@

$(VENV)/.installed: requirements/test.txt pyproject.toml | .venv-uv/.installed
	scripts/make_env.sh $(VENV) requirements/test.txt $(UV)

.venv-%/.installed: requirements/%.txt pyproject.toml | .venv-uv/.installed
	scripts/make_env.sh .venv-$* requirements/$*.txt $(UV)

# What mybinder.org builds from binder/ (its own Python and pins, this package installed by binder/postBuild).
.venv-binder/.installed: scripts/make_binder_env.sh pyproject.toml $(wildcard binder/*) $(shell find accel_magic -name '*.py')
	scripts/make_binder_env.sh .venv-binder

env: $(VENV)/.installed

# Every environment, built side by side (the downloads dominate).
envs: $(VENV)/.installed $(foreach s,$(STACKS),.venv-$(s)/.installed) .venv-binder/.installed

quickstart: $(VENV)/.installed
	$(VENV)/bin/python scripts/run_notebook.py notebooks/01_quickstart.ipynb

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check accel_magic tests scripts bench docs/conf.py
	$(VENV)/bin/ruff format --check accel_magic tests scripts bench docs/conf.py

# The browser layer drives Debian's chromium (never a browser downloaded by a test tool); root installs it.
chromium:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)

# Today's releases: every layer, the binder/ environment and the browser included (classic Notebook runs from
# Colab's environment). `make test` runs it as two parts: the layers every stack runs, and the binder and browser
# layers.
test-main: $(VENV)/.installed .venv-colab/.installed .venv-binder/.installed chromium
	$(VENV)/bin/python -m pytest -ra --durations=15

test-main-layers: $(VENV)/.installed
	$(OWN_NETWORK) $(VENV)/bin/python -m pytest -ra --durations=15 $(PINNED_LAYERS)

test-main-browser: $(VENV)/.installed .venv-colab/.installed .venv-binder/.installed chromium
	$(VENV)/bin/python -m pytest -ra --durations=15 tests/binder tests/browser

# Takes docs/screenshots anew from JupyterLab (the browser layer checks that they are current).
screenshots: $(VENV)/.installed chromium
	ACCEL_MAGIC_SCREENSHOTS=write $(VENV)/bin/python -m pytest -q tests/browser/test_screenshots.py

# Colab's runtime (requirements/colab.txt), Kaggle's, and every dependency at its declared minimum.
$(addprefix test-,$(STACKS)): test-%: .venv-%/.installed
	$(OWN_NETWORK) .venv-$*/bin/python -m pytest -ra --durations=15 $(PINNED_LAYERS)

# Each stack's run has a network of its own (its own loopback: no port one run takes is seen by the other), so two
# stacks run side by side: a stack's kernel layer keeps about half the CPU idle (waits for timeouts, interrupts,
# rendezvous). Where the machine gives a process no network of its own, the stacks run one at a time. The browser
# layer, the most sensitive to a busy machine, runs alone.
OWN_NETWORK := python3 scripts/own_network.py
SIDE_BY_SIDE = $(shell $(OWN_NETWORK) --check && echo -j2 --output-sync=target)

# The environments (and Chromium) install in parallel; then the stacks' tests, two at a time.
test:
	$(MAKE) -j6 envs chromium
	$(MAKE) lint
	$(MAKE) $(SIDE_BY_SIDE) test-main-layers test-colab
	$(MAKE) test-main-browser
	$(MAKE) $(SIDE_BY_SIDE) test-kaggle test-minimum

# Benchmarks: figures and ratios, written to bench/RESULTS.md; they never fail on speed.
bench: $(VENV)/.installed
	$(VENV)/bin/python bench/run.py

# The GPU path end to end in real kernels, on a machine with NVIDIA GPUs (CI has none): one line per check.
gpu-check:
	scripts/gpu_check.sh

# The documentation site, into build/docs: docs/ and the notebooks as the kernel layer executed them, by Sphinx
# with warnings as errors, every link between its pages checked (the browser layer builds it and opens it).
docs: $(VENV)/.installed
	$(VENV)/bin/python scripts/build_docs.py
