# The two commands of the README: `make demo` and `make test`. Both create .venv
# and install the project into it first, so they work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint types docs bench serve-docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

## demo: load the bundled digits model and run concurrent requests under deadlines
demo: $(STAMP)
	$(BIN)/trioinfer demo

## test: install everything, then run the whole test suite with branch coverage
test: $(STAMP)
	$(BIN)/python -m pytest --cov --cov-report=term-missing:skip-covered

## check: lint, format check, strict types, and the docs site (what CI runs besides tests)
check: lint types docs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

## bench: the in-process engine benchmark (prints figures; not a test)
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .coverage
