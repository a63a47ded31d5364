# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/overnight: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $@

demo: $(BIN)/overnight
	$(BIN)/overnight demo

test: $(BIN)/overnight
	$(BIN)/pytest

lint: $(BIN)/overnight
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(BIN)/overnight
	$(BIN)/python -m bench.all

clean:
	rm -rf $(VENV) .overnight .pytest_cache .mypy_cache .ruff_cache
