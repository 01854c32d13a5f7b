#!/usr/bin/env bash
# What usage metering adds per request, under load beside nginx: interleaved rounds of
# wrk against nginx (plain proxy), a postern node without metering and one with it
# (`--usage-spool`), the same API-key route on a plan with a product (the calls metering
# counts). Proxies pinned to CPU 1, wrk and the nginx backend to CPU 0; the figure is the
# proxy's CPU time per request from /proc, medians over the rounds.
#
#   bash bench/metering.sh            Env: ROUNDS (5), DUR (10s), CONN (50), PROFILE (release)
#
# Needs: apt-get install nginx-light wrk
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${PEERS:-$root/../shared/bench/peers}
profile=${PROFILE:-release}
ROUNDS=${ROUNDS:-5}
cargo build --profile "$profile" -p postern -p posternctl --bins >&2
bin=$root/target/$profile
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill $p 2>/dev/null || true; done; sleep 0.3; rm -rf "$work"' EXIT
mkdir -p "$work/repo/platform" "$work/repo/teams/bench"
printf 'clusters:\n  orders: { endpoints: ["127.0.0.1:18080"] }\n' > "$work/repo/platform/clusters.yaml"
printf 'owners:\n  - { host: "*", pathPrefix: /, team: bench }\n' > "$work/repo/platform/ownership.yaml"
printf 'scopes: [orders:read]\nproducts: [orders]\nplans:\n  partner: { products: [orders] }\n' > "$work/repo/platform/plans.yaml"
printf 'apps: { bench-app: { plan: partner, tenant: acme } }\n' > "$work/repo/platform/auth.yaml"
cat > "$work/repo/teams/bench/routes.yaml" <<'Y'
routes:
  - name: orders-authenticated
    match: { path: { type: PathPrefix, value: /v1/auth } }
    auth: { methods: [apiKey], scopes: [orders:read], product: orders }
    backendRefs: [{ name: orders }]
    timeouts: { connect: 1s, response: 5s }
    rewrite: { replacePrefixMatch: /v1/orders }
Y
key=$("$bin/posternctl" key new "$work/repo" --id bench-key --app bench-app --tenant acme --plan partner --scope orders:read)
"$bin/posternctl" compile "$work/repo" -o "$work/snapshot.json" >&2

for f in backend proxy-nginx; do sed "s#@WORK@#$work#g" "$peers/$f.conf" > "$work/$f.conf"; done
taskset -c 0 nginx -c "$work/backend.conf" -g "pid $work/b.pid;" & pids+=($!)
taskset -c 1 nginx -c "$work/proxy-nginx.conf" -g "pid $work/n.pid;" & pids+=($!); nginx_pid=$!
node() { # port-base [flags...]
  local p=$1; shift
  POSTERN_LOG=warn taskset -c 1 "$bin/postern" --snapshot "$work/snapshot.json" --credentials "$work/credentials.json" \
    --public 127.0.0.1:$p --partner 127.0.0.1:$((p + 1)) --admin 127.0.0.1:$((p + 2)) --workers 1 "$@" &
  pids+=($!)
}
node 18090; plain_pid=$!
node 18190 --usage-spool "$work/spool" --node-id bench; metered_pid=$!
for port in 18092 18192; do
  for _ in $(seq 100); do curl -sf -o /dev/null http://127.0.0.1:$port/healthz && break; sleep 0.1; done
done
sleep 1

. "$root/bench/lib.sh"
declare -a n_ p_ m_
errors=0
for r in $(seq "$ROUNDS"); do
  read -r n e < <(run $nginx_pid http://127.0.0.1:18081/v1/orders/1); n_+=("$n"); errors=$((errors + e))
  read -r p e < <(run $plain_pid http://127.0.0.1:18090/v1/auth/1 "x-api-key: $key"); p_+=("$p"); errors=$((errors + e))
  read -r m e < <(run $metered_pid http://127.0.0.1:18190/v1/auth/1 "x-api-key: $key"); m_+=("$m"); errors=$((errors + e))
  echo "round $r: nginx $n  postern+apikey $p  postern+apikey+metering $m  (CPU µs/request)"
done
nm=$(median "${n_[@]}"); pm=$(median "${p_[@]}"); mm=$(median "${m_[@]}")
echo "median: nginx $nm  postern+apikey $pm  postern+apikey+metering $mm  metering adds $(awk -v a="$mm" -v b="$pm" 'BEGIN{printf "%+.2f", a - b}') µs/request; non-2xx $errors"
curl -s http://127.0.0.1:18192/readyz | head -c 600; echo
