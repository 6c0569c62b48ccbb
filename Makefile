PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install bench-deps demo lint format test test-fast bench clean

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

# The inner loop: pure units (spec, data, policies, planner, topology, memory model, storage
# store and formats, memory tier, mesh dims) and the controller's state machine on a fake
# worker group. Selected by file, because what makes a test slow here is what it starts
# (a Ray runtime, gloo process groups, a multi-node Cluster), not a marker; the
# -m filter also drops anything marked slow (multi-node clusters, the measured memory
# model) or gpu. Every test here is also in `make test`.
FAST_TESTS := tests/test_memory_model.py tests/test_planner.py tests/test_topology.py \
	tests/test_cluster_configs.py tests/foundation/test_spec.py tests/foundation/test_data.py \
	tests/elastic/test_controller.py tests/elastic/test_policies.py tests/elastic/test_rank_order.py \
	tests/parallel/test_parallel_dims.py tests/parallel/test_moe_cp_units.py tests/checkpoint/test_memory_tier.py \
	tests/storage/test_storage_store.py tests/storage/test_storage_fs.py tests/storage/test_storage_dcp.py \
	tests/test_layers.py tests/elastic/test_recovery_plan.py tests/elastic/test_worker_group_api.py \
	tests/elastic/test_torch_private_api.py tests/simulator/test_simulator.py tests/tune/test_sweep_space.py \
	tests/report/test_report_units.py tests/elastic/test_diagnosis.py tests/elastic/test_recovery_report.py \
	tests/elastic/test_health_units.py \
	tests/test_stop_signals.py \
	tests/test_topology_placement.py \
	tests/data/test_waves.py

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not gpu" $(FAST_TESTS)

bench: install bench-deps
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/checkpoint_stall.py
	$(BIN)/python benchmarks/recovery_vs_raytrain.py
	$(BIN)/python benchmarks/parallel_layouts.py
	$(BIN)/python benchmarks/tp_data_sharing.py

clean:
	rm -rf $(VENV) runs .pytest_cache
