# Two commands for a newcomer: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.installed-dev

# pytest-xdist workers for `make test-parallel` and `make test-fast` (README's Development
# section: why `make test`, what CI runs, stays serial for now).
WORKERS ?= 4
PARALLEL := $(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup

.PHONY: demo test test-parallel test-fast lint format bench clean

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
	$(BIN)/python -m pytest --durations=15

# The whole suite on WORKERS processes: faster on an idle machine, not yet reliable enough for CI.
test-parallel: $(DEVSTAMP)
	$(PARALLEL) --durations=15

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
