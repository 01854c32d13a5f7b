#!/usr/bin/env bash
# What a Wasm filter adds per request under load: one node (one worker, CPU 1) with a
# route without filters, the same route with the native header filter, and one route per
# Wasm module given (each attached with `{"set": {"x-bench": "1"}}`, a header-injector
# config); wrk (CPU 0) takes turns on them for ROUNDS rounds, so a noisy host moves all of
# them alike. Prints the node's CPU µs per request, per round and the median.
#
#   bash bench/wasm_cost.sh [module.wasm ...]     (default: the header-injector example)
#
# Needs: apt-get install nginx-light wrk. Env: DUR (default 6s), CONN (50), ROUNDS (5),
# BIN_DIR (binaries to use instead of building target/release), RESETS (the nodes'
# `--wasm-reset` ways, one node each, taking turns in every round; default "copy").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${BIN_DIR:-}" ]; then
  cargo build --release -p postern -p posternctl --bins >&2
  BIN_DIR=$root/target/release
fi
bin=$(cd "$BIN_DIR" && pwd)
make -C "$root" filters >&2
[ $# -gt 0 ] || set -- "$root/target/filters/wasm32-wasip2/release/header_injector.wasm"
work=$(mktemp -d)
repo="$work/repo"
mkdir -p "$repo/platform" "$repo/teams/bench/filters"
cat > "$repo/platform/clusters.yaml" <<'Y'
clusters:
  orders: { endpoints: ["127.0.0.1:18080"] }
Y
cat > "$repo/platform/ownership.yaml" <<'Y'
owners:
  - { host: "*", pathPrefix: /, team: bench }
Y
route() { # name prefix [extra yaml]
  printf '  - name: %s\n    public: true\n    match: { path: { type: PathPrefix, value: %s } }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n    rewrite: { replacePrefixMatch: /v1/orders }\n%s\n' "$1" "$2" "${3:-}"
}
{
  echo "routes:"
  route plain /v1/plain
  route native /v1/native $'    requestHeaders:\n      set: [{ name: x-bench, value: "1" }]'
} > "$repo/teams/bench/routes.yaml"
echo "approved:" > "$repo/platform/filters.yaml"
names=()
i=0
for m in "$@"; do
  i=$((i + 1))
  name="w$i-$(basename "$m" .wasm | tr '_' '-')"
  names+=("$name")
  cp "$m" "$repo/teams/bench/filters/$name.wasm"
  echo "module: $name.wasm" > "$repo/teams/bench/filters/$name.yaml"
  echo "  - { digest: \"sha256:$(sha256sum "$m" | cut -d' ' -f1)\", filter: $name, team: bench }" >> "$repo/platform/filters.yaml"
  route "$name" "/v1/$name" "$(printf '    wasmFilters:\n      - name: %s\n        config: { set: { x-bench: "1" } }\n' "$name")" >> "$repo/teams/bench/routes.yaml"
done
"$bin/posternctl" compile "$repo" -o "$work/snapshot.json" >&2
sed "s#@WORK@#$work#g" "$root/../shared/bench/peers/backend.conf" > "$work/backend.conf"
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" &
backend=$!
resets=(${RESETS:-copy})
nodes=()
trap 'kill "${nodes[@]}" $backend 2>/dev/null; rm -rf "$work"' EXIT
for n in "${!resets[@]}"; do
  POSTERN_LOG=warn taskset -c 1 "$bin/postern" --snapshot "$work/snapshot.json" --wasm-reset "${resets[$n]}" \
    --public 127.0.0.1:$((18090 + 10 * n)) --partner 127.0.0.1:$((18091 + 10 * n)) \
    --admin 127.0.0.1:$((18092 + 10 * n)) --workers 1 &
  nodes+=($!)
  # The node listens once its snapshot is built: every module compiled and prepared for
  # its config, which takes a few seconds with several modules.
  for _ in $(seq 120); do
    curl -sf -o /dev/null http://127.0.0.1:$((18092 + 10 * n))/healthz && break
    kill -0 ${nodes[$n]} 2>/dev/null || { echo "the node exited" >&2; exit 1; }
    sleep 0.25
  done
done
cpu_us() { # node path -> CPU µs of node n per request
  local node=${nodes[$1]} port=$((18090 + 10 * $1)) before after out reqs
  before=$(awk '{print $14+$15}' /proc/$node/stat)
  out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-6s}" "http://127.0.0.1:$port$2" 2>&1)
  after=$(awk '{print $14+$15}' /proc/$node/stat)
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  if echo "$out" | grep -q Non-2xx; then
    echo "$2: $(echo "$out" | awk '/Non-2xx/ {print $NF}') non-2xx of $reqs; the node's filter outcomes so far:" >&2
    curl -s http://127.0.0.1:$((18092 + 10 * $1))/metrics | grep -E '^postern_filter_calls_total' | grep -v -e ' 0$' -e 'outcome="ok"' >&2
  fi
  awk -v t=$((after - before)) -v r="$reqs" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f", t / hz / r * 1e6 }'
}
targets=(plain native "${names[@]}")
declare -A runs
for round in $(seq "${ROUNDS:-5}"); do
  for n in "${!resets[@]}"; do
    for t in "${targets[@]}"; do
      runs[$n.$t]="${runs[$n.$t]:-} $(cpu_us $n "/v1/$t/1")"
    done
  done
  echo "round $round done" >&2
done
for n in "${!resets[@]}"; do
  for t in "${targets[@]}"; do
    # shellcheck disable=SC2086
    median=$(printf '%s\n' ${runs[$n.$t]} | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
    printf '%-10s %-32s median %6s CPU µs/request   runs:%s\n' "${resets[$n]}" "$t" "$median" "${runs[$n.$t]}"
  done
done
