PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
UV := $(BIN)/uv
UV_INSTALL := $(UV) pip install -q

.PHONY: demo test lint typecheck bench clean trainers-venv

# uv installs without compiling bytecode (pip compiled all ~27k modules of .venv, most
# never imported): Python caches each module in __pycache__ the first time it is
# imported, which an inherited PYTHONDONTWRITEBYTECODE would turn into compiling it
# again in every test's subprocess.
unexport PYTHONDONTWRITEBYTECODE

# uv (from PyPI, put into .venv by pip) installs both venvs: it resolves and installs
# several times faster than pip, and unpacks each wheel once into its cache, so torch
# and the rest that both venvs hold are linked, not unpacked twice.
$(UV):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv

# The torch wheel is the one pip's own configuration picks (on this kind of machine, the
# CPU build on disk, which sorts above PyPI's CUDA build). Both venvs install that file
# and nothing else named torch: no resolver can swap in a CUDA build.
TORCH := 2.13.0
WHEELS := .venvs/wheels
TORCH_STAMP := $(WHEELS)/.torch-$(TORCH)

$(TORCH_STAMP): $(UV)
	$(BIN)/pip download -q --no-deps -d $(WHEELS) 'torch==$(TORCH)'
	touch $(TORCH_STAMP)

$(STAMP): pyproject.toml $(TORCH_STAMP)
	$(UV_INSTALL) --python $(BIN)/python $(WHEELS)/torch-$(TORCH)*.whl -e '.[test]'
	touch $(STAMP)

# verl and skyrl-train pin what .venv cannot hold (transformers < 5.11, ray 2.51.1), so
# their adapters' contract tests (tests/test_adapters_trainers.py) run in this venv,
# installed from exact pins with --no-deps (no resolver run; CPU torch from the wheel
# above). skyrl-train declares Python 3.12 only, which uv will not override: pip
# installs that one wheel with --ignore-requires-python.
TRAINERS := .venvs/trainers
TRAINERS_STAMP := $(TRAINERS)/.installed

$(TRAINERS_STAMP): .ci/trainers.txt pyproject.toml $(TORCH_STAMP)
	test -x $(TRAINERS)/bin/python || $(PY) -m venv $(TRAINERS)
	grep -v '^skyrl-train==' .ci/trainers.txt > $(TRAINERS)/pins.txt
	$(UV_INSTALL) --python $(TRAINERS)/bin/python --no-deps --find-links $(WHEELS) \
		-r $(TRAINERS)/pins.txt -e .
	$(TRAINERS)/bin/pip install -q --no-deps --no-compile --ignore-requires-python \
		$$(grep '^skyrl-train==' .ci/trainers.txt)
	touch $(TRAINERS_STAMP)

trainers-venv: $(TRAINERS_STAMP)

demo: $(STAMP)
	$(BIN)/python -m envport.demo

# mypy (a minute or two of one core when its cache is cold) runs beside the tests, at a
# lower priority: the tests leave the cores idle much of the time while their servers
# and subprocesses start, and take them back when they need them. mypy's report follows
# the tests', and either failing fails the target.
#
# pytest runs the test files on PYTEST_WORKERS processes (pytest-xdist): one worker's
# test waits on a server or subprocess while the other's runs. --dist loadfile keeps a
# file's tests on one worker, so a module's servers (the Ray cluster, ...) start once and
# the mini-swe-agent venv is installed by one process. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

test: $(STAMP) $(TRAINERS_STAMP)
	$(BIN)/ruff check src tests bench
	nice -n 10 $(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile; tests=$$?; \
	wait $$types; typed=$$?; cat $(VENV)/mypy.log; \
	test $$tests = 0 && test $$typed = 0

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/step_throughput.py

clean:
	rm -rf $(VENV) .venvs .pytest_cache .mypy_cache .ruff_cache
