# Postern: `make demo` runs the whole thing on this machine; `make test` runs every test.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: setup build test lint unit demo bench bench-load clean

# Toolchain pieces the build needs (idempotent). The Wasm target is for filters.
setup:
	@command -v rustup >/dev/null && rustup target list --installed | grep -q wasm32-wasip2 \
		|| rustup target add wasm32-wasip2 || true

build: setup
	$(CARGO) build --workspace --bins

# The whole suite: formatting, lints, unit tests and end-to-end tests that start real
# processes on 127.0.0.1 (the e2e tests need the binaries built first).
test: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace

demo: setup
	$(CARGO) build --release --workspace --bins
	bash examples/demo.sh target/release

# Criterion micro-benchmarks (route match, snapshot build).
bench:
	$(CARGO) bench -p postern-router -p postern

# Load test against the peers (nginx, HAProxy, Caddy); needs their Debian packages.
bench-load:
	bash bench/load.sh

clean:
	$(CARGO) clean
