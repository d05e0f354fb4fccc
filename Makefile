# asyncps: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=
BENCH_ARGS ?=
# TensorFlow build: cpu (tensorflow-cpu, the default here) or tf (tensorflow); or empty to keep your own
TF_EXTRA ?= cpu
comma := ,

.PHONY: demo test test-e2e layers lint typecheck proto proto-check bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.$(if $(TF_EXTRA),[$(TF_EXTRA)])'
	touch $@

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[dev$(if $(TF_EXTRA),$(comma)$(TF_EXTRA))]'
	touch $@ $(VENV)/.installed

## demo: train the default local cluster (2 shards, 2 workers, mlp on digits) with live progress
demo: $(VENV)/.installed
	$(VENV)/bin/asyncps local

## test: generated code current, ruff, mypy, then the default test suite (a few minutes)
test: $(STAMP) proto-check lint typecheck layers
	$(PY) -m pytest -m "not slow and not docker" $(PYTEST_ARGS)

## test-e2e: the long end-to-end suites (process clusters, crash recovery, docker compose); CI runs them too
test-e2e: $(STAMP)
	$(PY) -m pytest -m "slow or docker" $(PYTEST_ARGS)

## layers: core <- roles <- tools, no role imports another (scripts/check_layers.py)
layers: $(STAMP)
	$(PY) scripts/check_layers.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

## proto: regenerate asyncps/pb from proto/
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

proto-check: $(STAMP)
	$(PY) scripts/gen_proto.py --check

## bench: steps/s against a Keras loop and TF's ParameterServerStrategy, transfer MB/s, scaling (BENCH_ARGS=--quick)
bench: $(STAMP)
	$(PY) -m benchmarks.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
