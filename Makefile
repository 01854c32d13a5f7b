# Postern: `make demo` runs the whole thing on this machine; `make test` runs every test.
SHELL := /bin/bash
CARGO ?= cargo
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),target)
GUESTS := examples/filters/Cargo.toml tests/filters/Cargo.toml tests/filters-std/Cargo.toml

.PHONY: setup kafka-broker build filters test demo bench bench-load clean

# What the build needs (idempotent; installs persist outside the clone): the Wasm
# target for filters, cmake and the curl headers for the bundled librdkafka (Debian).
setup:
	@rustup target list --installed | grep -q '^wasm32-wasip2$$' || rustup target add wasm32-wasip2
	@command -v cmake >/dev/null && dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || \
		{ echo "==> installing cmake and libcurl4-openssl-dev (librdkafka's build)"; \
		  apt-get install -y -q cmake libcurl4-openssl-dev >/dev/null || \
		  { apt-get update -q >/dev/null && apt-get install -y -q cmake libcurl4-openssl-dev >/dev/null; }; }

# The Kafka-protocol broker the usage stream's tests run: `tansu`, from crates.io
# (~10 min the first time; kept in cargo's bin folder, outside the clone).
TANSU_VERSION := 0.6.0
kafka-broker:
	@command -v tansu >/dev/null || test -x $${CARGO_HOME:-$$HOME/.cargo}/bin/tansu || \
		{ echo "==> installing the tansu Kafka broker $(TANSU_VERSION) (tests of the usage stream)"; \
		  $(CARGO) install tansu --version $(TANSU_VERSION) --locked --features dynostore,postgres; }

build: setup
	$(CARGO) build --workspace --bins

# Wasm filters (examples and the hostile test filters) for wasm32-wasip2, built from
# their own folders so their .cargo/config.toml (a 16 KiB shadow stack) applies.
filters: setup
	for m in $(GUESTS); do \
		(cd $$(dirname $$m) && $(CARGO) build --release --target wasm32-wasip2 --target-dir $(abspath $(TARGET_DIR))/filters) || exit 1; \
	done

# The whole suite: formatting, lints, unit tests, filter tests, and end-to-end tests that
# start real processes on 127.0.0.1 (they need the binaries and filters built first).
test: setup kafka-broker
	$(CARGO) fmt --all -- --check
	for m in $(GUESTS) filter-sdk/guest/Cargo.toml; do $(CARGO) fmt --manifest-path $$m --all -- --check || exit 1; done
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(MAKE) filters
	for m in filter-sdk/guest/Cargo.toml $(GUESTS); do \
		$(CARGO) test --manifest-path $$m --target-dir $(TARGET_DIR)/filters-native || exit 1; \
	done
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace

# The whole product on one machine (examples/demo.sh): built with the `demo` profile.
demo: setup
	@echo "==> building the example Wasm filters (wasm32-wasip2)"
	@$(MAKE) --no-print-directory filters
	@echo "==> building postern, posternctl, postern-echo and postern-grpc-echo (profile demo: optimised, no LTO)"
	$(CARGO) build --profile demo --bins -p postern -p posternctl -p postern-echo -p postern-grpc-echo
	@echo "==> starting the demo"
	bash examples/demo.sh $(TARGET_DIR)/demo

# Criterion micro-benchmarks (route match, snapshot build, filter calls).
bench: filters
	$(CARGO) bench -p postern-router -p postern -p postern-wasm

# Load test against the peers (nginx, HAProxy, Caddy); needs their Debian packages.
bench-load: filters
	bash bench/load.sh

clean:
	$(CARGO) clean
