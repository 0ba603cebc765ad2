# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv and install the package with the tested versions (constraints.txt) first;
# an existing .venv is reused while it is newer than pyproject.toml and constraints.txt.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lightning-boost-installed

.PHONY: demo test lint typecheck pytest doctor bench install clean

demo: $(STAMP)
	$(BIN)/lightning-boost demo

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

doctor: $(STAMP)
	$(BIN)/lightning-boost doctor

bench: $(STAMP)
	$(BIN)/python -m benchmarks

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --constraint constraints.txt --editable '.[dev]'
	touch $(STAMP)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache lightning_logs lightning_logs_demo
