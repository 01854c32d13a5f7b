#!/usr/bin/env bash
# Load benchmark: postern beside nginx, nginx+Lua, HAProxy and Caddy, through the peer
# harness (../shared/bench/peers/run.sh): same small GET, proxy pinned to CPU 1, wrk and
# the nginx backend on CPU 0. Prints req/s, p50, p99 and CPU µs per request.
# Needs: apt-get install nginx-light libnginx-mod-http-lua haproxy caddy wrk
# Env: DUR (default 10s), CONN (default 50), PEERS (path of the peer harness).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS:-$root/../shared/bench/peers/run.sh}
[ -x "$peers" ] || [ -f "$peers" ] || { echo "peer harness not found at $peers" >&2; exit 1; }
cargo build --release -p postern -p posternctl --bins >&2
make -C "$root" filters >&2
work=$(mktemp -d)
mkdir -p "$work/repo/platform" "$work/repo/teams/bench/filters"
# A Wasm filter that sets one request header (the equivalent of the nginx+Lua peer).
wasm="$root/target/filters/wasm32-wasip2/release/header_injector.wasm"
cp "$wasm" "$work/repo/teams/bench/filters/header-injector.wasm"
echo "module: header-injector.wasm" > "$work/repo/teams/bench/filters/header-injector.yaml"
cat > "$work/repo/platform/filters.yaml" <<Y
approved:
  - { digest: "sha256:$(sha256sum "$wasm" | cut -d' ' -f1)", filter: header-injector, team: bench }
Y
cat > "$work/repo/platform/clusters.yaml" <<'Y'
clusters:
  orders: { endpoints: ["127.0.0.1:18080"] }
Y
cat > "$work/repo/platform/ownership.yaml" <<'Y'
owners:
  - { host: "*", pathPrefix: /, team: bench }
Y
cat > "$work/repo/teams/bench/routes.yaml" <<'Y'
routes:
  - name: orders
    public: true
    match: { path: { type: PathPrefix, value: /v1/orders } }
    backendRefs: [{ name: orders }]
    timeouts: { connect: 1s, response: 5s }
  - name: orders-with-header
    public: true
    match: { path: { type: PathPrefix, value: /v1/hdr } }
    backendRefs: [{ name: orders }]
    timeouts: { connect: 1s, response: 5s }
    rewrite: { replacePrefixMatch: /v1/orders }
    requestHeaders:
      set: [{ name: x-bench, value: "1" }]
  - name: orders-with-wasm
    public: true
    match: { path: { type: PathPrefix, value: /v1/wasm } }
    backendRefs: [{ name: orders }]
    timeouts: { connect: 1s, response: 5s }
    rewrite: { replacePrefixMatch: /v1/orders }
    wasmFilters:
      - name: header-injector
        config: { set: { x-bench: "1" } }
Y
"$root/target/release/posternctl" compile "$work/repo" -o "$work/snapshot.json" >&2
POSTERN_LOG=warn taskset -c 1 "$root/target/release/postern" --snapshot "$work/snapshot.json" \
  --public 127.0.0.1:18090 --partner 127.0.0.1:18091 --admin 127.0.0.1:18092 --workers 1 &
pid=$!
trap 'kill $pid 2>/dev/null; rm -rf "$work"' EXIT
sleep 0.5
bash "$peers" "postern=http://127.0.0.1:18090/v1/orders/1=$pid" \
  "postern+hdr=http://127.0.0.1:18090/v1/hdr/1=$pid" \
  "postern+wasm=http://127.0.0.1:18090/v1/wasm/1=$pid"
