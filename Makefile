# `make train` and `make test` work on a fresh machine with only python3, make and git.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=

.PHONY: train test lint bench clean-runs

# Re-install only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) scripts/train.py --config configs/default.yaml $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxtrain scripts tests bench
	$(VENV)/bin/ruff format --check jaxtrain scripts tests bench
	$(VENV)/bin/mypy jaxtrain

bench: $(STAMP)
	$(PY) bench/bench_loop.py $(ARGS)
