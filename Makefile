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

# mypy cannot follow setuptools' package-dir mapping, so it checks a view of the installed
# layout: build/typecheck/overnight/{config,worker,coordinator} are links to the folders.
lint: $(BIN)/overnight
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf build/typecheck && mkdir -p build/typecheck/overnight
	for f in overnight/*; do ln -s ../../../$$f build/typecheck/overnight/; done
	for d in config worker coordinator; do ln -s ../../../$$d build/typecheck/overnight/$$d; done
	$(BIN)/mypy

# The reference in docs/, built as a site under build/site; --strict fails on a broken link.
$(BIN)/mkdocs: $(BIN)/overnight
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

docs: $(BIN)/mkdocs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(BIN)/overnight
	$(BIN)/python -m bench.all

clean:
	rm -rf $(VENV) build .overnight .pytest_cache .mypy_cache .ruff_cache
