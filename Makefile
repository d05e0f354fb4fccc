# asyncps: the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=
# the long suites wait on the wall clock more than they compute: two at a time (tests/conftest.py: which tests run together)
E2E_WORKERS ?= 2
# the default suite too: one module at a time per worker (tests/conftest.py), the longest first
TEST_WORKERS ?= 2
# the code generator's own venv (its grpcio-tools cannot share .venv with TensorFlow's protobuf)
PROTO_VENV ?= .venv-proto
# the shard's dependencies at exactly their floors (scripts/floors.py), for test-floors; the tests make their
# certificates with asyncps devcerts, hence cryptography
FLOORS_VENV ?= .venv-floors
# the floors prove the shard on the oldest numpy/grpcio/protobuf; the fuzzing's depth is the default suite's, so
# here a quarter of its examples (tests/test_hostile_input.py)
FLOORS_FUZZ ?= 0.25
# the tests that need only the shard's dependencies (no TensorFlow): they run again at the floors
FLOOR_TESTS := $(addprefix tests/test_,$(addsuffix .py,codec frames ps_store ps_server hostile_input \
	policies ps_policies sync_shards stream_guard authz checkpoint_cut security rules_registry \
	policy_store consistency load clocklead rows_wire state_store))
BENCH_ARGS ?=
# TensorFlow build: cpu (tensorflow-cpu, the default here) or tf (tensorflow); or empty to keep your own
TF_EXTRA ?= cpu
comma := ,
# setuptools tells every editable install of a flat layout to mind same-named folders (ten lines
# that newer pip shows even with --quiet); the layout is deliberate (docs/architecture.md)
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: demo test static test-e2e test-floors layers lint typecheck proto proto-check bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(QUIET_EDITABLE) $(PY) -m pip install --quiet -e '.$(if $(TF_EXTRA),[$(TF_EXTRA)])'
	touch $@

$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(QUIET_EDITABLE) $(PY) -m pip install --quiet -e '.[dev$(if $(TF_EXTRA),$(comma)$(TF_EXTRA))]'
	touch $@ $(VENV)/.installed

## demo: train the default local cluster (2 shards, 2 workers, mlp on digits) with live progress
demo: $(VENV)/.installed
	$(VENV)/bin/asyncps local

## test: generated code current, ruff, mypy, layers (side by side), the default test suite on $(TEST_WORKERS) pytest-xdist
## workers, then the shard's tests at the version floors
test: $(STAMP)
	$(MAKE) --no-print-directory -j4 static
	$(PY) -m pytest -m "not slow and not docker and not multinode and not soak" -n $(TEST_WORKERS) --no-loadscope-reorder $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-floors

## static: the checks that read the code (each on one core: make -j runs them side by side)
static: proto-check lint typecheck layers

$(FLOORS_VENV)/.installed: pyproject.toml scripts/floors.py Makefile
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_VENV)/bin/python -m pip install --quiet $$($(PYTHON) scripts/floors.py) \
		pyyaml pytest pytest-timeout hypothesis cryptography
	$(QUIET_EDITABLE) $(FLOORS_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $@

## test-floors: numpy, grpcio and protobuf at pyproject.toml's floors; the shard's tests
test-floors: $(FLOORS_VENV)/.installed
	$(FLOORS_VENV)/bin/python -c 'import google.protobuf, grpc, numpy; print("floors:", "numpy", numpy.__version__, "grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)'
	HOSTILE_EXAMPLES_FACTOR=$(FLOORS_FUZZ) $(FLOORS_VENV)/bin/python -m pytest -p no:cacheprovider \
		-m "not slow and not docker" $(FLOOR_TESTS) $(PYTEST_ARGS)

## test-e2e: the long end-to-end suites (process clusters, crash recovery, docker compose); CI runs them too
test-e2e: $(STAMP)
	$(PY) -m pytest -m "(slow or docker) and not soak" -n $(E2E_WORKERS) --no-loadscope-reorder $(PYTEST_ARGS)

## layers: core <- roles <- tools, no role imports another, the core's floors, no circles (scripts/check_layers.py)
layers: $(STAMP)
	$(PY) scripts/check_layers.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

$(PROTO_VENV)/.installed: scripts/proto-tools.txt
	rm -rf $(PROTO_VENV)
	$(PYTHON) -m venv $(PROTO_VENV)
	$(PROTO_VENV)/bin/python -m pip install --quiet -r scripts/proto-tools.txt
	touch $@

## proto: regenerate asyncps/pb from proto/ (grpcio-tools from scripts/proto-tools.txt, in $(PROTO_VENV))
proto: $(PROTO_VENV)/.installed
	$(PROTO_VENV)/bin/python scripts/gen_proto.py

proto-check: $(PROTO_VENV)/.installed
	$(PROTO_VENV)/bin/python scripts/gen_proto.py --check

## bench: steps/s against a Keras loop and TF's ParameterServerStrategy, transfer MB/s, scaling (BENCH_ARGS=--quick)
bench: $(STAMP)
	$(PY) -m benchmarks.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(PROTO_VENV) $(FLOORS_VENV) .mypy_cache .ruff_cache .pytest_cache build *.egg-info
