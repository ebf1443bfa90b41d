# The README's two commands are `make demo` and `make test`; .ci/run calls `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench bench-native wheel clean

$(BIN)/maturin:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "maturin>=1.9.4,<2"

# One release build of the extension per run; cargo's target/ cache makes repeats cheap.
setup: $(BIN)/maturin
	$(BIN)/maturin develop --release --quiet -E test,bench

demo: setup
	$(BIN)/kvbridge demo

# rustfmt's check (the crate and bench/native), clippy (warnings are errors; the unsafe-code lints
# are set in rust/lib.rs and clippy.toml), then
# cargo test: the pure-Rust parts (pickle, CBOR, the pool's and the index's cores), linked against
# the venv's Python.
test: setup
	cargo fmt --check
	cd bench/native && cargo fmt --check
	PYO3_PYTHON=$(abspath $(BIN))/python cargo clippy --quiet --all-targets -- -D warnings
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
	$(BIN)/python bench/relay.py
	$(BIN)/python bench/relay.py --plugin
	$(BIN)/python bench/consumer.py
	$(BIN)/python bench/engine_route.py
	$(BIN)/python bench/engine_route.py --rate 0 --runs 2

# The index core against Dynamo's native indexers (dynamo-kv-router from crates.io): its own cargo
# package and target dir under bench/native, so neither the wheel nor `make test` ever builds it.
# Cargo.lock pins every crate; after one `cargo fetch` there it builds offline. PYO3_PYTHON: the
# index core's crate links libpython when not built as an extension. Then the same queries from
# Python (bench/index_boundary.py), on the stream and queries the native run dumps.
NATIVE_DUMP := $(abspath target)/bench-native
bench-native: setup
	cd bench/native && PYO3_PYTHON=$(abspath $(BIN))/python cargo run --release --locked --quiet -- $(ARGS)
	cd bench/native && PYO3_PYTHON=$(abspath $(BIN))/python cargo run --release --locked --quiet -- --dump $(NATIVE_DUMP)
	$(BIN)/python bench/index_boundary.py $(NATIVE_DUMP)

# Release artefacts in dist/: the manylinux_2_28 abi3 wheel for this machine's architecture
# (linked through zig against glibc 2.28, so it installs on any Linux with glibc >= 2.28; maturin
# refuses the tag otherwise), checked by auditwheel, and the sdist, checked by building a wheel
# from it. Not part of `make test`: a release build takes minutes.
WHEEL_TAG := cp311-abi3-manylinux_2_28_$(shell uname -m)
wheel: $(BIN)/maturin
	$(BIN)/pip install -q --group release
	rm -rf dist
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/maturin build --release --zig --out dist
	$(BIN)/maturin sdist --out dist
	ls dist/kvbridge-*-$(WHEEL_TAG).whl
	$(BIN)/auditwheel show dist/kvbridge-*-$(WHEEL_TAG).whl | grep '"manylinux_2_28_$(shell uname -m)"'
	$(BIN)/pip wheel -q --no-deps -w dist/from-sdist dist/kvbridge-*.tar.gz
	@echo 'wheel and sdist in dist/: pip install "$$(ls dist/kvbridge-*-$(WHEEL_TAG).whl)[demo]"'

clean:
	rm -rf $(VENV) target dist
