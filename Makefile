PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install bench-deps demo lint format test test-fast bench bench-list bench-full gpu-check gpu-wheels clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	# torch first and alone: on CPU machines this takes the local CPU wheel instead of
	# the multi-GB CUDA build that a resolver run with other packages would pick.
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# torchft for the TorchFT side of benchmarks/recovery_vs_raytrain.py, into the same .venv.
# torch is named at its installed version so pip keeps the CPU build (torchft needs >=2.7);
# its other dependencies (opentelemetry) fit the pinned protobuf and requests.
bench-deps: install
	$(BIN)/python -m pip install -q -c constraints.txt torchft==0.2.0 torch==$(TORCH_VERSION)

demo: install
	$(BIN)/elastic demo

test: install
	$(BIN)/python -m pytest -q --durations=30 tests

# ruff, then mypy on elastic/ and storage/ (the packages named in pyproject's [tool.mypy]).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The inner loop: every test that starts no Ray, no process group and no worker process
# (pure units, the controller on a fake worker group, the CLI's input checks, the layer and
# file-size checks), selected by marker: tests that start one are marked `cluster`, and
# tests/conftest.py fails an unmarked test that starts one in-process. Every test here is
# also in `make test`.

test-fast: install
	$(BIN)/python -m pytest -q -m "not cluster and not slow and not gpu" tests

# Every benchmark at its quick settings, in the catalog's order (benchmarks/catalog.py); one
# that cannot run here says why and is skipped (engine_vs_torchtitan: a GPU and torchtitan),
# and without torchft the recovery benchmark reports its TorchFT sides skipped (make
# bench-deps). This run's results files go to runs/bench/: the published figures in
# benchmarks/results/ stay as they were measured.
bench: install
	$(BIN)/python -m benchmarks run

# What each benchmark measures, its results file and its quick settings.
bench-list: install
	$(BIN)/python -m benchmarks list

# The published figures: every benchmark at its default settings, each writing its file in
# benchmarks/results/ (hours on 2 cores).
bench-full: install bench-deps
	$(BIN)/python -m benchmarks run --full

# The GPU check (docs/gpu.md): every device path on one GPU, in one call, under 8 minutes.
# It needs no `make install`: on a GPU machine it runs with that machine's own python3 (its
# torch, no Ray); the pydantic wheels it lacks travel in .whl/ (`make gpu-wheels`, run here)
# and are installed into /tmp/site only when pydantic is not importable. Writes
# benchmarks/results/gpu_check.json and .log; exits 1 when a part fails.
# On CPU: `make gpu-check GPU_CHECK_ARGS=--dry-run` (tiny sizes, gloo; runs/gpu-check-dry/).
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
GPU_SITE ?= /tmp/site
GPU_WHL_DIR ?= .whl
GPU_WHEELS := pydantic==2.14.3 annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0
GPU_WHEELS_NATIVE := pydantic_core==2.50.4
GPU_WHEEL_PLATFORM := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-check:
	@if ! $(GPU_PY) -c "import pydantic; assert pydantic.VERSION >= '2'" 2>/dev/null; then \
		echo "gpu-check: installing $(GPU_WHL_DIR)/*.whl into $(GPU_SITE)"; \
		$(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --target $(GPU_SITE) $(GPU_WHL_DIR)/*.whl || exit 2; \
		export PYTHONPATH=$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH}; \
	fi; \
	$(GPU_PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The wheels `make gpu-check` needs on a GPU machine (CPython 3.12, x86-64), into .whl/ (git-ignored;
# carry it to the machine with the working tree).
gpu-wheels:
	mkdir -p .whl
	$(PY) -m pip download -q --no-deps --only-binary=:all: $(GPU_WHEEL_PLATFORM) -d .whl $(GPU_WHEELS_NATIVE)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform any -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache
