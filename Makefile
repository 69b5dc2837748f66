# Every target creates .venv when missing; nothing else is needed on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test conformance bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_cnn.py

# The whole suite on default (host-addressable) sim memory, then the core tests again with
# device-only memory (TORCHPORT_SIM_STRICT=1), where every byte must go through the runtime.
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 tests
	TORCHPORT_SIM_STRICT=1 $(BIN)/python -m pytest -q tests/test_core_*.py

conformance: $(STAMP)
	$(BIN)/python -m tests.conformance.run --full

bench: $(STAMP)
	$(BIN)/python benchmarks/op_overhead.py

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
