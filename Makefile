PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: install bench-deps demo test bench clean

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
	$(BIN)/python -m pytest -q tests

bench: install bench-deps
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/checkpoint_stall.py
	$(BIN)/python benchmarks/recovery_vs_raytrain.py
	$(BIN)/python benchmarks/parallel_layouts.py
	$(BIN)/python benchmarks/tp_data_sharing.py

clean:
	rm -rf $(VENV) runs .pytest_cache
