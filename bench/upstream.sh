#!/usr/bin/env bash
# What speaking HTTP/2 to a backend costs against HTTP/1.1, and how fast the gateway
# answers when a cluster's breaker is open or its cap is full.
#
# 1. CPU per request: one node with two routes to the same nginx backend, /v1/h1 over
#    HTTP/1.1 (pooled keep-alive connections) and /v1/h2 over h2c (one multiplexed
#    connection); interleaved wrk rounds, the node's CPU time per request from /proc,
#    medians (node pinned to CPU 1, wrk and the backend to CPU 0).
# 2. Answer time: wrk --latency with one connection against a route whose breaker is
#    open, and against one whose cluster's cap (1) is held by a slow request.
#
#   bash bench/upstream.sh BIN_DIR      Env: ROUNDS (5), DUR (10s), CONN (50)
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
mkdir -p "$work/repo/platform" "$work/repo/teams/bench"
cat > "$work/repo/platform/clusters.yaml" <<'YAML'
clusters:
  h1: { endpoints: ["127.0.0.1:18080"] }
  h2: { endpoints: ["127.0.0.1:18083"], protocol: http2 }
  dead:
    endpoints: ["127.0.0.1:9"]
    breaker: { minRequests: 1, failurePercent: 1, openFor: 5m }
  capped: { endpoints: ["127.0.0.1:18084"], maxConnections: 1 }
YAML
printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > "$work/repo/platform/ownership.yaml"
route() { printf '  - name: %s\n    public: true\n    match: { path: { type: PathPrefix, value: /v1/%s } }\n    backendRefs: [{ name: %s }]\n    timeouts: { connect: 1s, response: 30s }\n' "$1" "$1" "$2"; }
{ echo "routes:"; route h1 h1; route h2 h2; route dead dead; route capped capped; } > "$work/repo/teams/bench/routes.yaml"
"$bin/posternctl" compile "$work/repo" -o "$work/snap.json" >&2

sed "s#@WORK@#$work#g" "$peers/backend.conf" > "$work/backend.conf"
# The same backend also on h2c (HTTP/2 with prior knowledge).
sed -i 's#listen 127.0.0.1:18080;#listen 127.0.0.1:18080;\n    listen 127.0.0.1:18083 http2;#' "$work/backend.conf"
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" & pids+=($!)
# A backend that never answers, to hold the capped cluster's one place.
python3 -c 'import socket,time
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1",18084)); s.listen(64)
c=[]
while True: c.append(s.accept())' & pids+=($!)
POSTERN_LOG=warn taskset -c 1 "$bin/postern" --snapshot "$work/snap.json" --public 127.0.0.1:18190 \
  --partner 127.0.0.1:18191 --admin 127.0.0.1:18192 --workers 1 --shed-cpu 0 &
pids+=($!); node_pid=$!
for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:18192/healthz && break; sleep 0.1; done
sleep 1
curl -s -o /dev/null -w 'h2 route answers %{http_code}\n' http://127.0.0.1:18190/v1/h2/1
. "$root/bench/lib.sh"
declare -a a_ b_
errors=0
for r in $(seq "$ROUNDS"); do
  read -r a e < <(run $node_pid http://127.0.0.1:18190/v1/h1/1); a_+=("$a"); errors=$((errors + e))
  read -r b e < <(run $node_pid http://127.0.0.1:18190/v1/h2/1); b_+=("$b"); errors=$((errors + e))
  echo "round $r: upstream HTTP/1.1 $a  upstream h2c $b  (CPU µs/request)"
done
am=$(median "${a_[@]}"); bm=$(median "${b_[@]}")
echo "median: upstream HTTP/1.1 $am  h2c $bm ($(awk -v a="$bm" -v b="$am" 'BEGIN{printf "%+.2f", a - b}')) µs/request; non-2xx $errors"

# The breaker: one failure opens it (for 5 min); then every answer is the gateway's.
curl -s -o /dev/null http://127.0.0.1:18190/v1/dead/1
echo "breaker open, one connection:"
taskset -c 0 wrk -t1 -c1 -d"${DUR:-10s}" --latency http://127.0.0.1:18190/v1/dead/1 | grep -E '50%|90%|99%|Requests/sec|Non-2xx'
# The cap: one request holds the only place; every other is refused at once.
curl -s -o /dev/null -m 60 http://127.0.0.1:18190/v1/capped/hold & pids+=($!)
sleep 0.5
echo "cap full, one connection:"
taskset -c 0 wrk -t1 -c1 -d"${DUR:-10s}" --latency http://127.0.0.1:18190/v1/capped/1 | grep -E '50%|90%|99%|Requests/sec|Non-2xx'
