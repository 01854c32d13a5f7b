#!/usr/bin/env bash
# User-space instructions per request (valgrind's callgrind), for the peers and for one or
# more postern builds in turn: each BIN_DIR holds a `postern` and a `posternctl`. One
# keep-alive client (curl), 300 warm-up requests, counters zeroed, N requests counted per
# target, PROGRAM TOTALS / N (every thread of the process counted). Counts do not move with
# the host's load, so builds and peers compare on a busy machine.
#
# Peers, counted first the same way: nginx as a plain reverse proxy and nginx with the
# Lua header filter (the configurations of ../shared/bench/peers, one process:
# `master_process off`), and `postern-floor`, a bare hyper proxy (server and hyper-util's
# pooled legacy client, nothing else). Each postern build is counted on a public route
# with no filter, one with a native header filter, one with the `header-injector` Wasm
# filter (the node run with a small `--wasm-instances`, since the pooling allocator's
# address-space reservation is too large for valgrind otherwise, and a long
# `--wasm-init-deadline-ms`, since `init` runs tens of times slower under valgrind), and
# one with an API key on a plan with a product (the calls usage metering counts). The
# summary gives each count and its ratio to nginx's.
#
#   bash bench/instructions.sh BIN_DIR [BIN_DIR ...]
#
# Env: N (200), PEERS=0 (skip the peers), NODE_ARGS (extra postern flags), ENDPOINTS (the
# cluster's endpoints, quoted and comma-separated; default one, "127.0.0.1:18080"),
# METER=1 (meter usage into a spool in a temporary folder, as a node with --usage-spool
# does; the count of `Meter::count` alone is printed as well), KEEP=1 (keep the callgrind
# files, in the folder printed at the end).
#
# Needs valgrind, nginx (apt-get install nginx-light; libnginx-mod-http-lua for the Lua
# peer, skipped without it), a built `postern-echo` and `postern-floor` (target/release,
# target/demo or target/debug) and the example filters (make filters).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BIN_DIR [BIN_DIR ...]" >&2; exit 2; }
N=${N:-200}
built() { # name -> its path in target/release, target/demo or target/debug
  local d
  for d in release demo debug; do
    [ -x "$root/target/$d/$1" ] && { echo "$root/target/$d/$1"; return; }
  done
  echo "build $1 first (cargo build --workspace --release)" >&2; exit 2
}
echo_bin=$(built postern-echo)
injector=$root/target/filters/wasm32-wasip2/release/header_injector.wasm
[ -f "$injector" ] || { echo "build the example filters first (make filters)" >&2; exit 2; }
lp=$(mktemp -d)
"$echo_bin" --listen 127.0.0.1:18080 >/dev/null 2>&1 &
echo_pid=$!
trap 'kill $echo_pid 2>/dev/null || true; [ -n "${KEEP:-}" ] || rm -rf "$lp"' EXIT
results=()
mk() { # tag ctl
  local work=$lp/$1
  mkdir -p $work/repo/platform $work/repo/teams/bench/filters
  printf 'clusters:\n  orders: { endpoints: [%s] }\n' "${ENDPOINTS:-\"127.0.0.1:18080\"}" > $work/repo/platform/clusters.yaml
  printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > $work/repo/platform/ownership.yaml
  route() { printf '  - name: %s\n    public: true\n    match: { path: { type: PathPrefix, value: %s } }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n    rewrite: { replacePrefixMatch: /v1/orders }\n%s\n' "$1" "$2" "${3:-}"; }
  { echo "routes:"; route plain /v1/plain; } > $work/repo/teams/bench/routes.yaml
  route native /v1/native $'    requestHeaders:\n      set: [{ name: x-bench, value: "1" }]' >> $work/repo/teams/bench/routes.yaml
  route auth /v1/auth $'    auth: { methods: [apiKey], scopes: [orders:read], product: orders }' | sed '/public: true/d' >> $work/repo/teams/bench/routes.yaml
  route wasm /v1/wasm $'    wasmFilters:\n      - name: injector\n        config: { set: { x-bench: "1" } }' >> $work/repo/teams/bench/routes.yaml
  cp "$injector" $work/repo/teams/bench/filters/injector.wasm
  # The deadline at the platform's maximum: a call under valgrind runs tens of times slower.
  printf 'module: injector.wasm\nlimits: { deadline_ms: 50 }\n' > $work/repo/teams/bench/filters/injector.yaml
  printf 'approved:\n  - { digest: "sha256:%s", filter: injector, team: bench }\n' "$(sha256sum "$injector" | cut -d' ' -f1)" > $work/repo/platform/filters.yaml
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
count() { # tag pid port path [header]: counts N requests of a process started under callgrind
  local tag=$1 p=$2 port=$3 path=$4 hdr=${5:-} f total status
  reqs $port $path 300 "$hdr"
  # A counted request must be a success, or the count is of an error path.
  status=$(curl -s -o /dev/null -w '%{http_code}' ${hdr:+-H "$hdr"} "http://127.0.0.1:$port$path")
  [ "$status" = 200 ] || { echo "$tag $path answers $status: not counted" >&2; return 1; }
  callgrind_control -z $p >/dev/null
  reqs $port $path $N "$hdr"
  callgrind_control -d "$tag${path//\//_}" $p >/dev/null
  sleep 1
  f=$(ls -t $lp/cg.$tag.$p.* | head -1)
  total=$(callgrind_annotate $f 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",","",$1); print $1}')
  last=$((total / N))
  last_file=$f
}
started() { # port: waits until something listens there
  for _ in $(seq 600); do curl -s -o /dev/null "http://127.0.0.1:$1/" && return 0; sleep 0.5; done
  echo "nothing listens on $1" >&2; return 1
}
vg() { # tag cmd...: the command under callgrind, in the background
  local tag=$1; shift
  valgrind --tool=callgrind --smc-check=all-non-file --callgrind-out-file=$lp/cg.$tag.%p "$@" >/dev/null 2>$lp/vg.$tag.log &
}
nginx_peer() { # tag conf port
  sed -e "s#@WORK@#$lp#g" -e "s#127.0.0.1:$3;#127.0.0.1:18390;#" "$root/../shared/bench/peers/$2.conf" > $lp/$1.conf
  vg $1 nginx -c $lp/$1.conf -g "pid $lp/$1.pid; master_process off;"
  local p=$!
  started 18390
  count $1 $p 18390 /v1/orders/1 && results+=("$1 /v1/orders/1 $last")
  kill $p; wait $p 2>/dev/null || true
}
if [ "${PEERS:-1}" != 0 ]; then
  nginx_peer nginx proxy-nginx 18081
  if [ -f /usr/lib/nginx/modules/ngx_http_lua_module.so ]; then
    nginx_peer nginx+lua proxy-lua 18084
  else
    echo "no ngx_http_lua_module (apt-get install libnginx-mod-http-lua): the Lua peer is skipped" >&2
  fi
  vg floor "$(built postern-floor)" --listen 127.0.0.1:18390 --backend 127.0.0.1:18080
  p=$!
  started 18390
  count floor $p 18390 /v1/orders/1 && results+=("postern-floor /v1/orders/1 $last")
  kill $p; wait $p 2>/dev/null || true
fi
i=0
for dir in "$@"; do
  i=$((i + 1)); tag=b$i; bin=$(cd "$dir" && pwd)
  mk $tag $bin/posternctl
  meter=()
  [ "${METER:-}" = 1 ] && meter=(--usage-spool $lp/$tag/spool --node-id bench)
  node=(--snapshot $lp/$tag/snapshot.json --public 127.0.0.1:18290 --admin 127.0.0.1:18292 --partner 127.0.0.1:18291
    --workers 1 --wasm-instances 4 --wasm-init-deadline-ms 20000 ${NODE_ARGS:-})
  # Warm the compiled-code cache natively first.
  $bin/postern "${node[@]}" >/dev/null 2>&1 &
  p=$!; for _ in $(seq 200); do curl -sf -o /dev/null http://127.0.0.1:18292/healthz && break; sleep 0.1; done; kill $p; wait $p 2>/dev/null || true
  vg $tag $bin/postern "${node[@]}" "${meter[@]}"
  p=$!
  for _ in $(seq 600); do curl -sf -o /dev/null http://127.0.0.1:18292/healthz && break; sleep 0.5; done
  # The filter's header must reach the backend (postern-echo answers with the request).
  curl -s http://127.0.0.1:18290/v1/wasm/1 | grep -q '"x-bench"' || { echo "$bin: the Wasm route does not run its filter" >&2; exit 1; }
  for path in /v1/plain/1 /v1/native/1 /v1/wasm/1 /v1/auth/1; do
    hdr=; [ $path = /v1/auth/1 ] && hdr="x-api-key: $(cat $lp/$tag/key)"
    count $tag $p 18290 $path "$hdr" || continue
    line="$bin $path $last"
    if [ ${#meter[@]} -gt 0 ]; then
      c=$(callgrind_annotate --threshold=100 --inclusive=yes $last_file 2>/dev/null | awk '/postern_usage::meter::Meter::count/ && !seen {gsub(",","",$1); print $1; seen = 1}')
      line="$line (Meter::count $(( ${c:-0} / N )))"
    fi
    results+=("$line")
  done
  kill $p; wait $p 2>/dev/null || true
done
base=$(printf '%s\n' "${results[@]}" | awk '$1 == "nginx" {print $3}')
echo "instructions per request (N=$N), ratio to nginx's plain proxy:"
for r in "${results[@]}"; do
  set -- $r
  printf '%-40s %-14s %9s  %s\n' "$1" "$2" "$3" "$( [ -n "$base" ] && awk -v a=$3 -v b=$base 'BEGIN {printf "%.2f x nginx", a / b}')${4:+ $4 ${5:-} ${6:-}}"
done
[ -z "${KEEP:-}" ] || echo "callgrind files: $lp"
