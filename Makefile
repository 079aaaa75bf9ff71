# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv, install what they need (Debian packages too, when run as root or with sudo),
# then act. On a CPU machine torch is pinned to the local CPU build; GPU users install torch their way.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint typecheck test-fast test-fuzz test-install test-gpu bench clean system-deps

$(STAMP): pyproject.toml setup.py megascope/ingest/_kscan.c
	@$(MAKE) --no-print-directory system-deps
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Headless Chromium and its driver: browser tests and PNG heat-maps. A C compiler and Python's
# headers: the optional compiled Kineto scanner (the install goes on without it where they fail).
system-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver (apt)"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi
	@if ! command -v cc >/dev/null 2>&1 || ! python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
		echo "installing build-essential and python3-dev (apt)"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential python3-dev >/dev/null || true; \
	fi

demo: $(STAMP)
	$(VENV)/bin/megascope demo

lint: $(STAMP)
	$(VENV)/bin/ruff check megascope collectors dashboard tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy megascope collectors dashboard

# Every test, in two passes. First the tests of one process, spread over TEST_WORKERS worker
# processes (pytest-xdist); then, one at a time, those that start several processes, drive a browser
# or depend on elapsed time: they race a clock or each other's ranks and must not share the cores
# with other tests. Both passes run; either failing fails the target.
TEST_WORKERS ?= 2
test: $(STAMP) lint typecheck
	status=0; \
	$(VENV)/bin/pytest -n $(TEST_WORKERS) -m 'not gpu and not dist and not browser and not timing' || status=1; \
	$(VENV)/bin/pytest -m 'not gpu and (dist or browser or timing)' || status=1; \
	exit $$status

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m 'not dist and not browser'

# The long fuzz run (`make test` runs a fixed fast slice of the same tests). FUZZ_EXAMPLES per target.
FUZZ_EXAMPLES ?= 300
test-fuzz: $(STAMP)
	MEGASCOPE_FUZZ=long MEGASCOPE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(VENV)/bin/pytest -m fuzz

# The wheel as users get it, in a clean virtual environment: core dependencies only (torch pinned
# first, so that pip does not pull a CUDA build), `megascope --help` and a collector smoke test;
# then `[all]`: synth, report, export, heat-map and the dashboard from the installed package.
DIST := build/dist
INSTALL_VENV := build/venv-install
test-install: $(STAMP)
	rm -rf $(DIST) $(INSTALL_VENV)
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(DIST) .
	python3 -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(INSTALL_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(INSTALL_VENV)/bin/python -m pip install --quiet $(DIST)/megascope-*.whl
	$(INSTALL_VENV)/bin/python tests/install_smoke.py core
	$(INSTALL_VENV)/bin/python -m pip install --quiet "$$(ls $(DIST)/megascope-*.whl)[all]"
	$(INSTALL_VENV)/bin/python tests/install_smoke.py all

# On a GPU machine (torch with CUDA already installed there).
test-gpu:
	python3 -m pytest -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
