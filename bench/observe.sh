#!/usr/bin/env bash
# What observing costs per request, under load beside nginx: interleaved rounds of wrk
# on three nodes that differ only in observation: none; `--access-log` (1 % of
# successes and every error); the log and OpenTelemetry traces (1 %, every 5xx) sent to
# an OTLP/HTTP collector on CPU 0 (a small Python receiver that reads and acknowledges
# each export). A successful route shows the everyday cost; a log storm (every request
# a 404, so every request is logged) shows what it does to p99 and whether lines are
# dropped (counted) rather than waited for. Proxies pinned to CPU 1, wrk and the nginx backend to CPU 0;
# the figure is the proxy's CPU time per request from /proc (its log thread included),
# medians over the rounds.
#
#   bash bench/observe.sh BIN_DIR      Env: ROUNDS (5), DUR (10s), CONN (50)
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
mkdir -p "$repo/platform" "$repo/teams/bench"
printf 'clusters:\n  orders: { endpoints: ["127.0.0.1:18080"] }\n' > "$repo/platform/clusters.yaml"
printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > "$repo/platform/ownership.yaml"
printf 'routes:\n  - name: plain\n    public: true\n    match: { path: { type: Exact, value: /v1/orders } }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n' \
  > "$repo/teams/bench/routes.yaml"
"$bin/posternctl" compile "$repo" -o "$work/snap.json" >&2

for f in backend proxy-nginx; do sed "s#@WORK@#$work#g" "$peers/$f.conf" > "$work/$f.conf"; done
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" & pids+=($!)
taskset -c 1 nginx -c "$work/proxy-nginx.conf" -g "pid $work/n.pid;" & pids+=($!); nginx_pid=$!
node() { # port-base [flags]
  local base=$1; shift
  POSTERN_LOG=warn taskset -c 1 "$bin/postern" --snapshot "$work/snap.json" --public 127.0.0.1:$base \
    --partner 127.0.0.1:$((base + 1)) --admin 127.0.0.1:$((base + 2)) --workers 1 "$@" &
}
node 18090; pids+=($!); off_pid=$!
node 18190 --access-log "$work/access.log"; pids+=($!); on_pid=$!
cat > "$work/collector.py" <<'PY'
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
PY
taskset -c 0 python3 "$work/collector.py" 18300 & pids+=($!)
node 18290 --access-log "$work/access-traced.log" --otlp-endpoint http://127.0.0.1:18300 --trace-sample 0.01
pids+=($!); tr_pid=$!
for a in 18092 18192 18292; do
  for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:$a/healthz && break; sleep 0.1; done
done
sleep 1
. "$root/bench/lib.sh"
load() { # pid url -> CPU µs/request, p99 ms, requests
  local before after out reqs p99
  before=$(ticks "$1")
  out=$(taskset -c 0 wrk -t1 -c"${CONN:-50}" -d"${DUR:-10s}" --latency "$2" 2>&1)
  after=$(ticks "$1")
  reqs=$(echo "$out" | awk '/requests in/ {print $1}')
  p99=$(echo "$out" | awk '$1 == "99%" {v=$2; if (v ~ /us$/) {sub(/us/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1000}; print v}')
  awk -v t=$((after - before)) -v r="$reqs" -v hz="$(getconf CLK_TCK)" -v p="$p99" \
    'BEGIN{ printf "%.2f %s %s\n", (r > 0 ? t / hz / r * 1e6 : 0), p, r }'
}
declare -a n_ f_ o_ t_ sf_ so_ pf_ po_
for r in $(seq "$ROUNDS"); do
  read -r n _ _ < <(load $nginx_pid http://127.0.0.1:18081/v1/orders); n_+=("$n")
  read -r f _ _ < <(load $off_pid http://127.0.0.1:18090/v1/orders); f_+=("$f")
  read -r o _ _ < <(load $on_pid http://127.0.0.1:18190/v1/orders); o_+=("$o")
  read -r t _ _ < <(load $tr_pid http://127.0.0.1:18290/v1/orders); t_+=("$t")
  read -r sf pf _ < <(load $off_pid http://127.0.0.1:18090/nope); sf_+=("$sf"); pf_+=("$pf")
  read -r so po _ < <(load $on_pid http://127.0.0.1:18190/nope); so_+=("$so"); po_+=("$po")
  echo "round $r: nginx $n  success: off $f, log $o, log + 1 % traces $t  storm (every request a 404): log off $sf (p99 $pf ms), on $so (p99 $po ms)  CPU µs/request"
done
m() { median "$@"; }
d() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%+.2f", a - b}'; }
echo "median CPU µs/request: nginx $(m "${n_[@]}"); success: off $(m "${f_[@]}"), log $(m "${o_[@]}") ($(d "$(m "${o_[@]}")" "$(m "${f_[@]}")")), log + 1 % traces $(m "${t_[@]}") ($(d "$(m "${t_[@]}")" "$(m "${f_[@]}")")); storm: off $(m "${sf_[@]}"), on $(m "${so_[@]}") ($(d "$(m "${so_[@]}")" "$(m "${sf_[@]}")"))"
echo "median p99 in the storm: off $(m "${pf_[@]}") ms, on $(m "${po_[@]}") ms"
curl -s http://127.0.0.1:18192/metrics | grep '^postern_access_log_lines_total'
curl -s http://127.0.0.1:18292/metrics | grep -E '^postern_trace'
echo "log: $(wc -l < "$work/access.log") lines, $(du -h "$work/access.log" | cut -f1), rotated files: $(ls "$work" | grep -c 'access.log\.' || true)"
