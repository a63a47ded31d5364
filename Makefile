# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench docs clean

$(BIN)/overnight: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,dev]'
	touch $@

demo: $(BIN)/overnight
	$(BIN)/overnight demo

test: $(BIN)/overnight
	$(BIN)/pytest

# mypy finds the package as installed through src/overnight (see pyproject.toml).
lint: $(BIN)/overnight
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The reference in docs/, built as a site under build/site; --strict fails on a broken link.
$(BIN)/mkdocs: $(BIN)/overnight
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

docs: $(BIN)/mkdocs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(BIN)/overnight
	$(BIN)/python -m bench.all

# A demo whose step user could not enter .overnight kept its scratch repository in the temp
# folder, linked from .overnight/demo/<night>/scratch: removed with it.
clean:
	for link in .overnight/demo/*/scratch; do \
	  if [ -L "$$link" ]; then rm -rf -- "$$(readlink "$$link")"; fi; \
	done
	rm -rf $(VENV) build .overnight .pytest_cache .mypy_cache .ruff_cache
