# Two set-up commands on a fresh machine: `make run` and `make test`.
# torch is installed first and pinned to the CPU wheel so pip never pulls a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: run test test-unit test-all lint format install dev clean

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

test: $(VENV)/.dev
	$(BIN)/python -m pytest

# day-to-day: the fast tests (tests/unit: one process, no server), under 2 minutes
test-unit: $(VENV)/.dev
	$(BIN)/python -m pytest tests/unit

lint: $(VENV)/.dev
	$(BIN)/ruff check exactrl tests benchmarks examples
	$(BIN)/ruff format --check exactrl tests benchmarks examples

format: $(VENV)/.dev
	$(BIN)/ruff check --fix exactrl tests benchmarks examples
	$(BIN)/ruff format exactrl tests benchmarks examples

test-all: $(VENV)/.dev
	$(BIN)/python -m pytest -m ''

clean:
	rm -rf $(VENV) runs
