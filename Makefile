# Two commands: `make run` (the default job) and `make test`.
# The environment lives in .venv; a stamp file records what was installed, so
# a second run installs nothing unless pyproject.toml changed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-test
CONFIG ?= configs/arith.yaml

.PHONY: run test bench clean-venv

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

run: $(STAMP)
	$(BIN)/rlbus broker $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/broker_throughput.py --quick

clean-venv:
	rm -rf $(VENV)
