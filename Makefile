# Two commands: `make run` and `make test`. Each creates .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch first, pinned to the CPU build this machine serves; the project's range admits it,
# so pip keeps it instead of fetching a multi-GB CUDA build.
TORCH := torch==2.13.0
# Test processes (pytest-xdist): a file's tests stay in one, so module set-up runs once;
# files start in the order tests/conftest.py gives them, not xdist's most-tests-first.
# The tests that mostly sleep on timers form two units of work (tests/scheduling.py), each
# started first in a process of its own while the other two keep both cores busy.
# The fast tier has none of those: a process per core.
TEST_WORKERS ?= 4
FAST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q --dist loadfile --no-loadscope-reorder
export DO_NOT_TRACK := 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: run test test-fast lint format clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

run: $(VENV)/.installed
	$(BIN)/gradline run

# The suite starts hundreds of Python processes of gradline's own code: each compiles
# the modules it imports unless bytecode is cached, which an environment with
# PYTHONDONTWRITEBYTECODE set (many container images) forbids (~0.3 CPU-s a process,
# ~3 s in each test process's collection). The tests write the caches, as Python does
# by default, into the ignored __pycache__ folders.
test test-fast: export PYTHONDONTWRITEBYTECODE :=

test: $(VENV)/.installed-dev browser
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(PYTEST) -n $(TEST_WORKERS) --durations=25

# The fast tier: unit and single-process tests (no worker processes, no CLI end to end),
# about 2 minutes on 2 cores.
test-fast: $(VENV)/.installed-dev
	$(PYTEST) -n $(FAST_WORKERS) -m "not multiprocess and not e2e" --durations=10

# The UI test renders the UIs in a headless Chromium. Installed with apt-get when it is
# missing and this user may; otherwise say how (under CI the test would fail, not skip).
browser:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing chromium (apt-get) for the UI test"; \
			apt-get install -y -qq --no-install-recommends chromium >/dev/null \
			|| { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; \
		else echo "chromium is missing: the UI test needs it (apt-get install chromium)"; fi; }

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
	$(BIN)/lint-imports

clean:
	rm -rf model checkpoints plots result.json metrics.json data/raw data/shards
