#!/usr/bin/env bash
# What validating a body costs per request, under load beside nginx: interleaved rounds
# of wrk POSTing the realistic 2 KB order (host/validate/fixtures/order.json) to nginx
# (a plain proxy, which buffers small bodies too), and to one node on three routes: the
# body streamed (plain), read whole (bufferBody), and read whole and validated against
# the orders team's OpenAPI operation (examples/config/teams/orders/openapi/orders.yaml,
# createOrder). Proxies pinned to CPU 1, wrk and the nginx backend to CPU 0; the figure
# is the proxy's CPU time per request from /proc, medians over the rounds.
#
#   bash bench/validate.sh BIN_DIR      Env: ROUNDS (5), DUR (10s), CONN (50)
#
# BIN_DIR holds `postern` and `posternctl`. Needs: apt-get install nginx-light wrk
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS:-$root/../shared/bench/peers}
[ $# -eq 1 ] || { echo "usage: $0 BIN_DIR" >&2; exit 2; }
bin=$(cd "$1" && pwd)
ROUNDS=${ROUNDS:-5}
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill $p 2>/dev/null || true; done; sleep 0.3; rm -rf "$work"' EXIT

repo=$work/repo
mkdir -p "$repo/platform" "$repo/teams/bench/openapi"
printf 'clusters:\n  orders: { endpoints: ["127.0.0.1:18080"] }\n' > "$repo/platform/clusters.yaml"
printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > "$repo/platform/ownership.yaml"
cp "$root/examples/config/teams/orders/openapi/orders.yaml" "$repo/teams/bench/openapi/"
route() { # name path extra
  printf '  - name: %s\n    public: true\n    match: { path: { type: Exact, value: %s }, methods: [POST] }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n%s' "$1" "$2" "$3"
}
{
  echo 'routes:'
  route plain /v1/orders/plain ''
  route buffered /v1/orders/buffered '    bufferBody: true\n'
  route validated /v1/orders/validated '    validate: { openapi: orders.yaml, operationId: createOrder }\n'
} | sed 's/\\n/\n/g' > "$repo/teams/bench/routes.yaml"
"$bin/posternctl" compile "$repo" -o "$work/snap.json" >&2

body=$root/host/validate/fixtures/order.json
cat > "$work/post.lua" <<LUA
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local f = io.open("$body", "rb"); wrk.body = f:read("*a"); f:close()
LUA

for f in backend proxy-nginx; do sed "s#@WORK@#$work#g" "$peers/$f.conf" > "$work/$f.conf"; done
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" & pids+=($!)
taskset -c 1 nginx -c "$work/proxy-nginx.conf" -g "pid $work/n.pid;" & pids+=($!); nginx_pid=$!
POSTERN_LOG=warn taskset -c 1 "$bin/postern" --snapshot "$work/snap.json" --public 127.0.0.1:18090 \
  --partner 127.0.0.1:18091 --admin 127.0.0.1:18092 --workers 1 & pids+=($!); node_pid=$!
for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:18092/healthz && break; sleep 0.1; done
for path in plain buffered validated; do
  code=$(curl -s -o /dev/null -w '%{http_code}' -H 'content-type: application/json' --data-binary @"$body" \
    "http://127.0.0.1:18090/v1/orders/$path")
  [ "$code" = 200 ] || { echo "$path answers $code, not 200" >&2; exit 1; }
done
sleep 1
. "$root/bench/lib.sh"
post() { # pid url
  local before after out reqs non2xx
  before=$(ticks "$1")
  out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-10s}" -s "$work/post.lua" "$2" 2>&1)
  after=$(ticks "$1")
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  awk -v t=$((after - before)) -v r="$reqs" -v hz="$(getconf CLK_TCK)" -v e="${non2xx:-0}" \
    'BEGIN{ printf "%.2f %s\n", (r > 0 ? t / hz / r * 1e6 : 0), e }'
}
declare -a n_ p_ b_ v_
errors=0
for r in $(seq "$ROUNDS"); do
  read -r n e < <(post $nginx_pid http://127.0.0.1:18081/v1/orders/plain); n_+=("$n"); errors=$((errors + e))
  read -r p e < <(post $node_pid http://127.0.0.1:18090/v1/orders/plain); p_+=("$p"); errors=$((errors + e))
  read -r b e < <(post $node_pid http://127.0.0.1:18090/v1/orders/buffered); b_+=("$b"); errors=$((errors + e))
  read -r v e < <(post $node_pid http://127.0.0.1:18090/v1/orders/validated); v_+=("$v"); errors=$((errors + e))
  echo "round $r: nginx $n  plain $p  buffered $b  validated $v  (CPU µs/request)"
done
nm=$(median "${n_[@]}"); pm=$(median "${p_[@]}"); bm=$(median "${b_[@]}"); vm=$(median "${v_[@]}")
echo "median: nginx $nm  plain $pm  buffered $bm  validated $vm ($(awk -v a="$vm" -v b="$bm" 'BEGIN{printf "%+.2f", a - b}') over buffered) µs/request; non-2xx $errors"
