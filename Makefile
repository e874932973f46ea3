# Two commands for a newcomer: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

# pytest-xdist workers for `make test` and `make test-fast`: two on two cores. Three paid on a
# fast machine (the e2e stacks mostly wait on their subprocesses), but on a slow one three ran
# seven e2e timing margins out in 48 min where two passed everything in 35 (README's
# Development section has the figures).
WORKERS ?= 2
PARALLEL := $(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup

.PHONY: demo test test-serial test-fast lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Torch first, so the project's dependency on torch is already met and pip never pulls a CUDA
# build. On a GPU host, install the torch build you need into .venv before running make.
$(BIN)/.torch: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	touch $@

$(STAMP): pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e '.[engine,tui,provision,gpu,postgres]'
	touch $@

$(DEVSTAMP): pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(STAMP)

# The whole stack on this machine: control plane, agent (fake GPUs without NVIDIA), demo model.
demo: $(STAMP)
	$(BIN)/dctl up --demo

test: $(DEVSTAMP) lint
	$(PARALLEL) --durations=15

# The whole suite in one process, in file order: for a failure that only shows alongside others.
test-serial: $(DEVSTAMP)
	$(BIN)/python -m pytest --durations=15

# After each change: every test that starts no process stack, sshd or Prometheus.
test-fast: $(DEVSTAMP)
	$(PARALLEL) -m "not e2e and not slow and not fuzz"

lint: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(DEVSTAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(DEVSTAMP)
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
