# The two commands of README.md: `make demo` and `make test`. Each creates the virtual
# environment, installs gradstream with its extras, and fetches the Kafka broker from
# Maven Central into ~/.cache/gradstream when it is not cached yet.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

FRAMEWORKS := $(VENV)/.frameworks-stamp
DEMO_PORT ?= 8765

.PHONY: demo test install frameworks kafka lint bench clean browser

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gradstream needs Python >= 3.11")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[demo,test]'
	@touch $(STAMP)

# PyTorch, JAX, transformers and Lightning, for the adapter tests (several GB: the PyPI
# torch wheel for Linux is a CUDA build that also runs on CPU).
frameworks: $(FRAMEWORKS)

$(FRAMEWORKS): $(STAMP) requirements-frameworks.txt
	$(PY) -m pip install --quiet -r requirements-frameworks.txt
	@touch $(FRAMEWORKS)

kafka: install
	$(VENV)/bin/gradstream broker fetch

demo: kafka
	$(VENV)/bin/gradstream demo --serve-port $(DEMO_PORT)

lint: install
	$(VENV)/bin/ruff check .

# Debian's chromium for the dashboard and animation browser tests (Playwright drives
# /usr/bin/chromium; it does not download browsers). Needs root or sudo when missing.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium chromium-driver; \
	fi

test: kafka frameworks lint browser
	$(PY) -m pytest

bench: kafka
	$(PY) bench/producer_overhead.py
	$(PY) bench/kafka_producer_config.py

clean:
	rm -rf $(VENV) out .pytest_cache
