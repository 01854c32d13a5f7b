#!/usr/bin/env bash
# What the per-cluster protections (circuit breaker, retry budget, the copy a retriable
# request keeps) cost per request, under load beside nginx: interleaved rounds of wrk
# against nginx (plain proxy), a node of an older build, and a node of this build on a
# one-host and on a two-host cluster (where a GET keeps a copy to retry with). Proxies
# pinned to CPU 1, wrk and the nginx backend to CPU 0; the figure is the proxy's CPU time
# per request from /proc, medians over the rounds.
#
#   bash bench/protect.sh OLD_BIN_DIR NEW_BIN_DIR     Env: ROUNDS (5), DUR (10s), CONN (50)
#
# Each BIN_DIR holds `postern` and `posternctl`. Needs: apt-get install nginx-light wrk
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS:-$root/../shared/bench/peers}
[ $# -eq 2 ] || { echo "usage: $0 OLD_BIN_DIR NEW_BIN_DIR" >&2; exit 2; }
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd)
ROUNDS=${ROUNDS:-5}
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill $p 2>/dev/null || true; done; sleep 0.3; rm -rf "$work"' EXIT
repo() { # dir endpoints
  mkdir -p "$1/platform" "$1/teams/bench"
  printf 'clusters:\n  orders: { endpoints: [%s] }\n' "$2" > "$1/platform/clusters.yaml"
  printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > "$1/platform/ownership.yaml"
  printf 'routes:\n  - name: orders\n    public: true\n    match: { path: { type: PathPrefix, value: /v1/orders } }\n    backendRefs: [{ name: orders }]\n    timeouts: { connect: 1s, response: 5s }\n' > "$1/teams/bench/routes.yaml"
}
repo "$work/one" '"127.0.0.1:18080"'
repo "$work/two" '"127.0.0.1:18080", "localhost:18080"'
"$old/posternctl" compile "$work/one" -o "$work/old.json" >&2
"$new/posternctl" compile "$work/one" -o "$work/one.json" >&2
"$new/posternctl" compile "$work/two" -o "$work/two.json" >&2

for f in backend proxy-nginx; do sed "s#@WORK@#$work#g" "$peers/$f.conf" > "$work/$f.conf"; done
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" & pids+=($!)
taskset -c 1 nginx -c "$work/proxy-nginx.conf" -g "pid $work/n.pid;" & pids+=($!); nginx_pid=$!
node() { # bin snapshot port-base
  POSTERN_LOG=warn taskset -c 1 "$1/postern" --snapshot "$2" --public 127.0.0.1:$3 --partner 127.0.0.1:$(($3 + 1)) \
    --admin 127.0.0.1:$(($3 + 2)) --workers 1 &
  pids+=($!)
}
node "$old" "$work/old.json" 18090; old_pid=$!
node "$new" "$work/one.json" 18190; one_pid=$!
node "$new" "$work/two.json" 18290; two_pid=$!
for port in 18092 18192 18292; do
  for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:$port/healthz && break; sleep 0.1; done
done
sleep 1
. "$root/bench/lib.sh"
declare -a n_ o_ a_ b_
errors=0
for r in $(seq "$ROUNDS"); do
  read -r n e < <(run $nginx_pid http://127.0.0.1:18081/v1/orders/1); n_+=("$n"); errors=$((errors + e))
  read -r o e < <(run $old_pid http://127.0.0.1:18090/v1/orders/1); o_+=("$o"); errors=$((errors + e))
  read -r a e < <(run $one_pid http://127.0.0.1:18190/v1/orders/1); a_+=("$a"); errors=$((errors + e))
  read -r b e < <(run $two_pid http://127.0.0.1:18290/v1/orders/1); b_+=("$b"); errors=$((errors + e))
  echo "round $r: nginx $n  old $o  new, one host $a  new, two hosts $b  (CPU µs/request)"
done
nm=$(median "${n_[@]}"); om=$(median "${o_[@]}"); am=$(median "${a_[@]}"); bm=$(median "${b_[@]}")
echo "median: nginx $nm  old $om  new, one host $am ($(awk -v a="$am" -v b="$om" 'BEGIN{printf "%+.2f", a - b}'))  new, two hosts $bm ($(awk -v a="$bm" -v b="$om" 'BEGIN{printf "%+.2f", a - b}')) µs/request; non-2xx $errors"
