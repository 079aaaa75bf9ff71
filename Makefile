# Two entry points that work on a fresh machine: `make demo` and `make test`.
# Both create .venv, install what they need (Debian packages too, when run as root or with sudo),
# then act. On a CPU machine torch is pinned to the local CPU build; GPU users install torch their way.

VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint typecheck test-fast test-gpu bench clean system-deps

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# Headless Chromium and its driver: browser tests and PNG heat-maps.
system-deps:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver (apt)"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

demo: $(STAMP)
	$(VENV)/bin/megascope demo

lint: $(STAMP)
	$(VENV)/bin/ruff check megascope collectors dashboard tests bench

typecheck: $(STAMP)
	$(VENV)/bin/mypy megascope collectors dashboard

test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest

test-fast: $(STAMP)
	$(VENV)/bin/pytest -m 'not dist and not browser'

# On a GPU machine (torch with CUDA already installed there).
test-gpu:
	python3 -m pytest -m gpu -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
