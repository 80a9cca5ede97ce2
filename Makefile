# The two commands a user needs: `make serve` and `make test`. Both set up .venv first.
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml

.PHONY: setup serve test test-fast lint prepare-model

setup:
	@bash scripts/setup.sh

prepare-model: setup
	$(VENV)/bin/knnlm-serve prepare-model

serve: setup
	$(VENV)/bin/knnlm-serve --config $(CONFIG)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	@bash scripts/browser.sh
	$(PY) -m pytest tests

test-fast: lint
	$(PY) -m pytest tests -m "not slow"
