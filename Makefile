# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install the package with the tested versions (constraints.txt) first;
# an existing .venv is reused while it is newer than pyproject.toml and constraints.txt.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lightning-boost-installed
OLDEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) python3.10)
OLDEST_VENV ?= .venv-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.lightning-boost-installed

.PHONY: demo test test-gpu test-many-cpus test-oldest lint typecheck pytest doctor bench device-wheels install clean

demo: $(STAMP)
	$(BIN)/lightning-boost demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

# Every gpu-marked test (the CUDA paths); fails at once on a machine without a CUDA device.
test-gpu: $(STAMP)
	$(BIN)/python -c "import sys, torch; torch.cuda.is_available() or sys.exit('make test-gpu needs a CUDA device')"
	$(BIN)/pytest -m gpu -rA

# The suite as a 16-CPU machine (the GPU machine's count) runs it, on this one's CPUs: a test
# that assumed 2 CPUs failed there (tests/conftest.py's --simulate-cpus).
test-many-cpus: $(STAMP)
	$(BIN)/pytest --simulate-cpus=16

# The suite over the oldest supported set (pyproject.toml's floors, pinned in
# constraints-oldest.txt) on the oldest Python allowed, in its own venv.
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/pytest

doctor: $(STAMP)
	$(BIN)/lightning-boost doctor

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The test wheels a lent GPU machine lacks, from the workplace's shared folder, and this package's
# own wheel (that machine has no build backend: the contract test reads the installed metadata), into
# the git-ignored .device-wheels/ that each device call carries (benchmarks/gpu.sh; docs/development.md).
DEVICE_WHEELS ?= ../shared/device-wheels
device-wheels: $(STAMP)
	rm -rf .device-wheels && mkdir -p .device-wheels
	cp $(DEVICE_WHEELS)/*.whl .device-wheels/
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir .device-wheels .

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --constraint constraints.txt --editable '.[dev]'
	touch $(STAMP)

$(OLDEST_STAMP): pyproject.toml constraints-oldest.txt
	test -x $(OLDEST_VENV)/bin/python || $(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install --quiet --constraint constraints-oldest.txt --editable '.[test]'
	touch $(OLDEST_STAMP)

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .mypy_cache .ruff_cache .pytest_cache lightning_logs lightning_logs_demo
