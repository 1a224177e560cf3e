# The two commands of README.md: `make demo` and `make test`. Each creates the virtual
# environment, installs gradstream with its extras, and fetches the Kafka broker from
# Maven Central into ~/.cache/gradstream when it is not cached yet. pip's output goes to
# $(LOG), printed in full only when a step fails.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
LOG := $(VENV)/install.log
EXTRAS := demo,test

FRAMEWORKS := $(VENV)/.frameworks-stamp
DEMO_PORT ?= 8765

.PHONY: demo test install frameworks kafka lint bench clean browser services

# The first line of `make` (= `make install`), `make demo` and `make test`: what gradstream is
# and what the goal sets up (printed while make reads this file, before any recipe runs).
ABOUT := gradstream: streaming gradient telemetry (training ranks -> Kafka -> DuckDB health reports).
SETUP_install := Setting up $(VENV) with gradstream[$(EXTRAS)] (pip log: $(LOG)).
SETUP_demo := Setting up $(VENV) (pip log: $(LOG)) and a local Kafka broker, then training 6 demo scenarios.
SETUP_test := Setting up $(VENV) (pip log: $(LOG)), the ML frameworks, Kafka, chromium, Prometheus and Alertmanager, then ruff and pytest.
GOAL := $(firstword $(MAKECMDGOALS) install)
ifneq ($(SETUP_$(GOAL)),)
$(info $(ABOUT) $(SETUP_$(GOAL)))
endif

# $(call logged,COMMAND): run COMMAND with its output appended to $(LOG); if it fails,
# print the whole log and stop.
logged = { echo "+ $(strip $(1))"; $(1); } >>$(LOG) 2>&1 || { cat $(LOG); \
	echo "make: '$(strip $(1))' failed; its output is above and in $(LOG)" >&2; exit 1; }
PIP := PIP_DISABLE_PIP_VERSION_CHECK=1 $(PY) -m pip install --progress-bar off

install: $(STAMP)
	@echo "gradstream is installed in $(VENV) ($(VENV)/bin/gradstream --help; make clean to start over)."

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gradstream needs Python >= 3.11")'
	@echo "creating $(VENV) and installing gradstream[$(EXTRAS)] with pip (a minute or more the first time)"
	@mkdir -p $(VENV) && : > $(LOG)
	@$(call logged,$(PYTHON) -m venv $(VENV))
	@$(call logged,$(PIP) --upgrade pip)
	@$(call logged,$(PIP) -e '.[$(EXTRAS)]')
	@touch $(STAMP)

# PyTorch, JAX, transformers and Lightning, for the adapter tests (several GB: the PyPI
# torch wheel for Linux is a CUDA build that also runs on CPU).
frameworks: $(FRAMEWORKS)

$(FRAMEWORKS): $(STAMP) requirements-frameworks.txt
	@echo "installing PyTorch, JAX, transformers and Lightning for the adapter tests (several GB)"
	@$(call logged,$(PIP) -r requirements-frameworks.txt)
	@touch $(FRAMEWORKS)

kafka: $(STAMP)
	@libs=$$($(VENV)/bin/gradstream broker fetch) && echo "Kafka broker jars (from Maven Central, cached): $$libs"

demo: kafka
	$(VENV)/bin/gradstream demo --serve-port $(DEMO_PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Debian's chromium for the dashboard and animation browser tests (Playwright drives
# /usr/bin/chromium; it does not download browsers). Needs root or sudo when missing.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium chromium-driver; \
	fi

# Debian's Prometheus (with promtool) and Alertmanager for the operations-stack integration
# tests (a real scrape, the shipped rules and dashboard queries, alert routing). The tests
# start their own instances on loopback; the packages' system services are not used.
services:
	@if [ ! -x /usr/bin/prometheus ] || [ ! -x /usr/bin/promtool ] || \
			[ ! -x /usr/bin/prometheus-alertmanager ]; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y --no-install-recommends \
			prometheus prometheus-alertmanager; \
	fi

test: kafka frameworks lint browser services
	$(PY) -m pytest

bench: kafka
	$(PY) bench/producer_overhead.py
	$(PY) bench/kafka_producer_config.py

clean:
	rm -rf $(VENV) out .pytest_cache
