# The two commands of the README: `make demo` and `make test`. Both create .venv and install
# the project into it first, so they work on a fresh clone. `make demo` installs only the core
# and one ONNX Runtime build; `make test` adds the test, serving, bench and docs tools to the
# same .venv (and `make demo` after it installs nothing more).
#
# ORT picks the ONNX Runtime build, an extra of pyproject.toml: cpu (default), gpu, or cuda
# (gpu plus NVIDIA's libraries from PyPI). One venv holds one build: changing ORT removes the
# other before installing, since both install the same `onnxruntime` module.
PYTHON ?= python3
ORT ?= cpu
# pytest-xdist processes for make test (0: one process, the default). Most tests wait on
# servers, subprocesses and sockets: 4 on 2 cores took 11.7-14.8 minutes in clean clones
# where one process takes 22-27, each module in one process (its module fixtures, a Ray or
# a server, start once), the slowest first (tests/conftest.py: SLOW_MODULES, hence
# --no-loadscope-reorder). But the slowest are the Ray modules, which then start their
# clusters at once: in one clean clone (2026-12-07, 09:13) they starved each other (Ray
# tests of 60-180 s, actors not placed within 60 s: 3 failed, 24 minutes). 0 until the Ray
# modules run one at a time.
TEST_WORKERS ?= 0
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder,)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
ORT_STAMP := $(VENV)/.ort
OTHER_ORT := $(if $(filter cpu,$(ORT)),onnxruntime-gpu,onnxruntime)

.PHONY: demo test check lint types docs bench install-check serve-docs clean FORCE

# Rewritten only when ORT changes, so that a change reinstalls and nothing else does.
$(ORT_STAMP): FORCE
	@mkdir -p $(VENV)
	@echo '$(ORT)' | cmp -s - $@ || echo '$(ORT)' > $@

# Shell: a venv with an up-to-date pip, and no ONNX Runtime build other than ORT's.
VENV_UP = if [ ! -x $(BIN)/python ]; then \
		$(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip install --quiet --upgrade pip; \
	fi && \
	if $(BIN)/python -m pip show --quiet $(OTHER_ORT) 2>/dev/null; then \
		$(BIN)/python -m pip uninstall --yes $(OTHER_ORT); \
	fi

# Everything the tests, lint, types and docs need.
$(STAMP): pyproject.toml $(ORT_STAMP)
	$(VENV_UP)
	$(BIN)/python -m pip install -e '.[dev,$(ORT)]'
	touch $@

# The core and one ONNX Runtime; nothing to install where the full install is up to date.
$(DEMO_STAMP): pyproject.toml $(ORT_STAMP)
	@if [ -f $(STAMP) ] && [ $(STAMP) -nt pyproject.toml ] && [ $(STAMP) -nt $(ORT_STAMP) ]; then \
		echo "$(STAMP) is up to date: the demo needs nothing more"; \
	else \
		set -x && $(VENV_UP) && $(BIN)/python -m pip install -e '.[$(ORT)]'; \
	fi
	@touch $@

## demo: load the bundled digits model and run concurrent requests under deadlines
demo: $(DEMO_STAMP)
	$(BIN)/trioinfer demo

## test: install everything, then run the whole test suite with branch coverage (in
## TEST_WORKERS pytest-xdist processes if set; each test module's tests in one). A
## test that fails is run again, twice at most (pytest-rerunfailures): tests and tutorials
## on the real clock (deadlines, an inline budget) starve on a busy machine; a test that
## fails every time still fails. The 25 slowest tests are listed at the end, with their times.
test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) --reruns 2 --durations=25 --cov --cov-report=term-missing:skip-covered

## check: lint, format check, strict types, and the docs site (what CI runs besides tests)
check: lint types docs

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

## install-check: build the sdist and wheel, install the wheel with only the cpu extra in a
## clean venv, run the README's quickstart with it, and print each extra's installed size
install-check: $(STAMP)
	$(BIN)/python scripts/install_check.py

## bench: the in-process engine benchmark (prints figures; not a test)
bench: $(STAMP)
	$(BIN)/python benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) site dist .pytest_cache .mypy_cache .ruff_cache .coverage
