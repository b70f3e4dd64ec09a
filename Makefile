# Two set-up commands on a fresh machine: `make run` and `make test`.
# torch is installed first and pinned to the CPU wheel so pip never pulls a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: run test test-unit test-slow test-all lint format install dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH) -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed
	$(BIN)/pip install -q $(TORCH) -e '.[dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

run: $(VENV)/.installed
	$(BIN)/exactrl train

# tests run in one worker process per core (pytest-xdist), each kernel on one thread, so the workers never
# wait on each other's OpenMP threads; property tests draw a fifth of their examples (tests/helpers/fuzzing.py)
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n auto --dist loadfile

test: $(VENV)/.dev
	$(PYTEST)

# day-to-day: the fast tests (tests/unit: in-process, no server)
test-unit: $(VENV)/.dev
	$(PYTEST) tests/unit

# the slow tests and every property test at its full example count (.ci/run runs it after `make test`)
test-slow: $(VENV)/.dev
	EXACTRL_FUZZ=full $(PYTEST) -m 'slow or fuzz'

lint: $(VENV)/.dev
	$(BIN)/ruff check exactrl tests benchmarks examples
	$(BIN)/ruff format --check exactrl tests benchmarks examples

format: $(VENV)/.dev
	$(BIN)/ruff check --fix exactrl tests benchmarks examples
	$(BIN)/ruff format exactrl tests benchmarks examples

test-all: $(VENV)/.dev
	EXACTRL_FUZZ=full $(PYTEST) -m ''

clean:
	rm -rf $(VENV) runs
