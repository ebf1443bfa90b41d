# The README's two commands are `make demo` and `make test`; .ci/run calls `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/maturin:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "maturin>=1.9.4,<2"

# One release build of the extension per run; cargo's target/ cache makes repeats cheap.
setup: $(BIN)/maturin
	$(BIN)/maturin develop --release --quiet -E test,bench

demo: setup
	$(BIN)/kvbridge demo

# cargo test: the pure-Rust parts (pickle, CBOR, the pool's core), linked against the venv's Python.
test: setup
	PYO3_PYTHON=$(abspath $(BIN))/python cargo test --quiet
	$(BIN)/python -m pytest -q -p no:cacheprovider

bench: setup
	$(BIN)/python bench/hashing.py
	$(BIN)/python bench/encode.py
	$(BIN)/python bench/pool.py
	$(BIN)/python bench/bridge.py
	$(BIN)/python bench/decode_gc.py
	$(BIN)/python bench/idle.py
	$(BIN)/python bench/vllm_record.py

clean:
	rm -rf $(VENV) target
