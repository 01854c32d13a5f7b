#!/usr/bin/env bash
# User-space instructions per request (valgrind's callgrind), for one or more builds in
# turn: each BIN_DIR holds a `postern` and a `posternctl`. One keep-alive client (curl),
# 300 warm-up requests, counters zeroed, N requests counted per route (a public route
# with no filter, one with a native header filter, and one with an API key on a plan
# with a product: the calls usage metering counts), PROGRAM TOTALS / N. Counts do not
# move with the host's load, so builds compare on a busy machine.
#
#   bash bench/instructions.sh BIN_DIR [BIN_DIR ...]
#
# Env: N (200), NODE_ARGS (extra postern flags), ENDPOINTS (the cluster's endpoints, quoted and
# comma-separated; default one, "127.0.0.1:18080"), METER=1 (meter usage into a spool in a
# temporary folder, as a node with --usage-spool does; the count of `Meter::count` alone
# is printed as well).
#
# Needs valgrind and a built `postern-echo` (target/debug or target/release).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BIN_DIR [BIN_DIR ...]" >&2; exit 2; }
N=${N:-200}
echo_bin=$root/target/release/postern-echo
[ -x "$echo_bin" ] || echo_bin=$root/target/debug/postern-echo
lp=$(mktemp -d)
"$echo_bin" --listen 127.0.0.1:18080 >/dev/null 2>&1 &
echo_pid=$!
trap 'kill $echo_pid 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$lp"' EXIT
mk() { # tag ctl
  local work=$lp/$1
  mkdir -p $work/repo/platform $work/repo/teams/bench/filters
  printf 'clusters:\n  orders: { endpoints: [%s] }\n' "${ENDPOINTS:-\"127.0.0.1:18080\"}" > $work/repo/platform/clusters.yaml
  printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > $work/repo/platform/ownership.yaml
  route() { printf '  - name: %s\n    public: true\n    match: { path: { type: PathPrefix, value: %s } }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n    rewrite: { replacePrefixMatch: /v1/orders }\n%s\n' "$1" "$2" "${3:-}"; }
  { echo "routes:"; route plain /v1/plain; } > $work/repo/teams/bench/routes.yaml
  route native /v1/native $'    requestHeaders:\n      set: [{ name: x-bench, value: "1" }]' >> $work/repo/teams/bench/routes.yaml
  route auth /v1/auth $'    auth: { methods: [apiKey], scopes: [orders:read], product: orders }' | sed '/public: true/d' >> $work/repo/teams/bench/routes.yaml
  printf 'scopes: [orders:read]\nproducts: [orders]\nplans:\n  partner: { products: [orders] }\n' > $work/repo/platform/plans.yaml
  printf 'apps: { bench-app: { plan: partner, tenant: acme } }\n' > $work/repo/platform/auth.yaml
  $2 key new $work/repo --id bench-key --app bench-app --tenant acme --plan partner --scope orders:read > $work/key
  $2 compile $work/repo -o $work/snapshot.json >&2
}
reqs() { # port path n [header]
  local args=()
  for _ in $(seq $3); do args+=(-o /dev/null "http://127.0.0.1:$1$2"); done
  curl -s -o /dev/null ${4:+-H "$4"} "${args[@]}"
}
i=0
for dir in "$@"; do
  i=$((i + 1)); tag=b$i; bin=$(cd "$dir" && pwd)
  mk $tag $bin/posternctl
  meter=()
  [ "${METER:-}" = 1 ] && meter=(--usage-spool $lp/$tag/spool --node-id bench)
  # Warm the compiled-code cache natively first.
  $bin/postern --snapshot $lp/$tag/snapshot.json --public 127.0.0.1:18290 --admin 127.0.0.1:18292 --partner 127.0.0.1:18291 --workers 1 --wasm-instances 4 ${NODE_ARGS:-} >/dev/null 2>&1 &
  p=$!; for _ in $(seq 200); do curl -sf -o /dev/null http://127.0.0.1:18292/healthz && break; sleep 0.1; done; kill $p; wait $p 2>/dev/null || true
  valgrind --tool=callgrind --smc-check=all-non-file --callgrind-out-file=$lp/cg.$tag.%p $bin/postern --snapshot $lp/$tag/snapshot.json --public 127.0.0.1:18290 --admin 127.0.0.1:18292 --partner 127.0.0.1:18291 --workers 1 --wasm-instances 4 ${NODE_ARGS:-} "${meter[@]}" >/dev/null 2>$lp/vg.$tag.log &
  p=$!
  for _ in $(seq 600); do curl -sf -o /dev/null http://127.0.0.1:18292/healthz && break; sleep 0.5; done
  for path in /v1/plain/1 /v1/native/1 /v1/auth/1; do
    hdr=; [ $path = /v1/auth/1 ] && hdr="x-api-key: $(cat $lp/$tag/key)"
    reqs 18290 $path 300 "$hdr"
    callgrind_control -z $p >/dev/null
    reqs 18290 $path $N "$hdr"
    callgrind_control -d "$tag${path//\//_}" $p >/dev/null
    sleep 1
    f=$(ls -t $lp/cg.$tag.$p.* | head -1)
    total=$(callgrind_annotate $f 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}')
    line="$bin $path $((total / N)) instructions/request"
    if [ ${#meter[@]} -gt 0 ]; then
      count=$(callgrind_annotate --threshold=100 --inclusive=yes $f 2>/dev/null | awk '/postern_usage::meter::Meter::count/ {gsub(",","",$1); print $1; exit}')
      line="$line (Meter::count $(( ${count:-0} / N )))"
    fi
    echo "$line"
  done
  kill $p; wait $p 2>/dev/null || true
done
