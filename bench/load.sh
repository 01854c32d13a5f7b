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
cat > "$work/repo/platform/plans.yaml" <<'Y'
scopes: [orders:read]
products: [orders]
plans:
  partner: { products: [orders] }
  metered: { products: [orders], rateLimit: { rps: 1000000000, burst: 1000000000 } }
Y
# Credentials: a signing key (ES256) and an API key, made the way the demo makes them.
ctl="$root/target/release/posternctl"
"$ctl" token keygen --kid bench-1 --issuer https://id.example.com --private-out "$work/signing.pem" > "$work/signing.yaml"
{ echo "jwt: { audiences: [api.example.com] }"; echo "apps: { bench-app: { plan: partner, tenant: acme } }";
  echo "signing_keys:"; cat "$work/signing.yaml"; } > "$work/repo/platform/auth.yaml"
key=$("$ctl" key new "$work/repo" --id bench-key --app bench-app --tenant acme --plan partner --scope orders:read)
# A key on a plan with a (never reached) rate limit: the same route, plus a bucket check.
key_limited=$("$ctl" key new "$work/repo" --id bench-metered --app bench-app --tenant acme --plan metered --scope orders:read)
jwt=$("$ctl" token mint --key "$work/signing.pem" --kid bench-1 --issuer https://id.example.com \
  --audience api.example.com --sub alice --client-id bench-app --scope orders:read --ttl 60m)
cat > "$work/repo/teams/bench/routes.yaml" <<'Y'
routes:
  - name: orders-authenticated
    match: { path: { type: PathPrefix, value: /v1/auth } }
    auth: { methods: [apiKey, jwt], scopes: [orders:read], product: orders }
    backendRefs: [{ name: orders }]
    timeouts: { connect: 1s, response: 5s }
    rewrite: { replacePrefixMatch: /v1/orders }
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
"$ctl" compile "$work/repo" -o "$work/snapshot.json" >&2
start_postern() {
  POSTERN_LOG=warn taskset -c 1 "$root/target/release/postern" --snapshot "$work/snapshot.json" \
    --public 127.0.0.1:18090 --partner 127.0.0.1:18091 --admin 127.0.0.1:18092 --workers 1 "$@" &
  pid=$!
}
start_postern
trap 'kill $pid 2>/dev/null; rm -rf "$work"' EXIT
sleep 0.5
bash "$peers" "postern=http://127.0.0.1:18090/v1/orders/1=$pid" \
  "postern+hdr=http://127.0.0.1:18090/v1/hdr/1=$pid" \
  "postern+wasm=http://127.0.0.1:18090/v1/wasm/1=$pid"

# Authenticated requests need a header, which the peer harness does not send: the same
# measurement (wrk on CPU 0 against the same nginx backend, postern's CPU time per
# request from /proc), for postern without and with an API key or a JWT.
peers_dir=$(dirname "$peers")
sed "s#@WORK@#$work#g" "$peers_dir/backend.conf" > "$work/backend.conf"
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" &
backend=$!
trap 'kill $pid $backend 2>/dev/null; rm -rf "$work"' EXIT
sleep 0.5
bench_h() { # name url [header]
  local before after out rps p50 p99 reqs cpu
  before=$(awk '{print $14+$15}' /proc/$pid/stat)
  if [ -n "${3:-}" ]; then
    out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-10s}" --latency -H "$3" "$2" 2>&1)
  else
    out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-10s}" --latency "$2" 2>&1)
  fi
  after=$(awk '{print $14+$15}' /proc/$pid/stat)
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  cpu=$(awk -v t=$((after-before)) -v r="$reqs" -v hz="$(getconf CLK_TCK)" 'BEGIN{ if (r>0 && t>0) printf "%.2f", t/hz/r*1e6; else print "-" }')
  printf '%-14s rps=%-9s p50=%-8s p99=%-8s cpu_us_per_req=%s%s\n' "$1" "$rps" "$p50" "$p99" "$cpu" "${non2xx:+ non2xx=$non2xx}"
}
bench_h postern "http://127.0.0.1:18090/v1/orders/1"
bench_h postern+apikey "http://127.0.0.1:18090/v1/auth/1" "x-api-key: $key"
bench_h postern+jwt "http://127.0.0.1:18090/v1/auth/1" "authorization: Bearer $jwt"
bench_h postern+apikey+limit "http://127.0.0.1:18090/v1/auth/1" "x-api-key: $key_limited"
# The same, with the node in a fleet: buckets count, and a sync thread reports to Redis.
if redis-cli -h 127.0.0.1 ping >/dev/null 2>&1; then
  kill $pid; wait $pid 2>/dev/null || true
  start_postern --ratelimit-redis redis://127.0.0.1:6379 --ratelimit-prefix "postern-bench:$$:"
  trap 'kill $pid $backend 2>/dev/null; rm -rf "$work"' EXIT
  sleep 1
  bench_h postern+apikey+limit+fleet "http://127.0.0.1:18090/v1/auth/1" "x-api-key: $key_limited"
fi
