PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench clean trainers-venv

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first (a file on this kind of machine): once it is there,
	# the extras' torch range is already satisfied and pip never pulls a CUDA build.
	$(BIN)/pip install -q 'torch==2.13.0'
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

# verl and skyrl-train pin what .venv cannot hold (transformers < 5.11, ray 2.51.1), so
# their adapters' contract tests (tests/test_adapters_trainers.py) run in this venv,
# installed from exact pins with --no-deps (no resolver run; CPU torch from the local file).
TRAINERS := .venvs/trainers
TRAINERS_STAMP := $(TRAINERS)/.installed

$(TRAINERS_STAMP): .ci/trainers.txt pyproject.toml
	test -x $(TRAINERS)/bin/python || $(PY) -m venv $(TRAINERS)
	$(TRAINERS)/bin/pip install -q --no-deps --no-compile --ignore-requires-python -r .ci/trainers.txt
	$(TRAINERS)/bin/pip install -q --no-deps -e .
	touch $(TRAINERS_STAMP)

trainers-venv: $(TRAINERS_STAMP)

demo: $(STAMP)
	$(BIN)/python -m envport.demo

test: $(STAMP) $(TRAINERS_STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	$(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/step_throughput.py

clean:
	rm -rf $(VENV) $(TRAINERS) .pytest_cache .mypy_cache .ruff_cache
