#!/usr/bin/env bash
# The demo: echo backends on 127.0.0.1:9001-9003, the example config compiled into a
# snapshot, and postern in the foreground (public :8080, partner :8081, admin :9901).
# Usage: examples/demo.sh <dir with the binaries>   (make demo builds them)
set -euo pipefail
bin=${1:-target/release}
here=$(cd "$(dirname "$0")" && pwd)
state=${DEMO_STATE:-$here/../demo-state}
mkdir -p "$state"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM

for spec in 9001=echo 9002=orders-v1 9003=orders-v2; do
  port=${spec%%=*}; name=${spec#*=}
  "$bin/postern-echo" --listen "127.0.0.1:$port" --name "$name" 2>>"$state/echo.log" &
  pids+=($!)
done

# The config repository as the platform would hold it: the example config plus the built
# filter modules beside their manifests, each approved in platform/filters.yaml.
filters=${FILTERS_DIR:-$here/../target/filters/wasm32-wasip2/release}
rm -rf "$state/config" && cp -r "$here/config" "$state/config"
echo "approved:" > "$state/config/platform/filters.yaml"
for manifest in "$state"/config/teams/*/filters/*.yaml; do
  name=$(basename "$manifest" .yaml); team=$(basename "$(dirname "$(dirname "$manifest")")")
  cp "$filters/${name//-/_}.wasm" "${manifest%.yaml}.wasm"
  digest=$(sha256sum "${manifest%.yaml}.wasm" | cut -d' ' -f1)
  echo "  - { digest: \"sha256:$digest\", filter: $name, team: $team, reviewer: demo }" >> "$state/config/platform/filters.yaml"
done

"$bin/posternctl" compile "$state/config" -o "$state/snapshot.json"

cat <<'TRY'

Postern demo is starting: public pool http://127.0.0.1:8080, partner pool
http://127.0.0.1:8081, admin http://127.0.0.1:9901. Try, in another terminal:

  curl -i http://127.0.0.1:8080/v1/echo/hello?x=1             # echo route, x-request-id on the answer
  curl -i http://127.0.0.1:8080/v2/echo/hello                  # rewritten to /echo/hello upstream
  curl -i http://127.0.0.1:8080/v1/orders/42                   # exact route with a {id} parameter
  curl -i -H 'api-version: 2026-06-01' http://127.0.0.1:8080/v1/orders/42   # dated version -> orders-v2
  for k in partner-31 partner-32 partner-33 partner-34; do curl -s -H "x-api-key: $k" http://127.0.0.1:8080/v2/orders/1 | grep backend; done   # sticky 90/10 canary
  curl -i http://127.0.0.1:8080/v1/products/1                  # Deprecation, Sunset and Link headers
  curl -i -H 'x-auth-subject: admin' http://127.0.0.1:8080/v1/echo/spoof   # identity headers never reach backends
  curl -i -X DELETE http://127.0.0.1:8080/v1/orders/42         # 405 problem+json with Allow
  curl -i http://127.0.0.1:8080/nope                           # 404 route_not_found
  head -c 200000 /dev/zero | curl -i --data-binary @- http://127.0.0.1:8080/v1/orders   # 413 payload_too_large
  curl -i http://127.0.0.1:8081/partner/v1/reports/daily      # partner pool only
  curl --http2-prior-knowledge -i http://127.0.0.1:8080/v1/echo/h2   # HTTP/2 (h2c)
  curl -si http://127.0.0.1:8080/v1/echo/wasm | grep -i -E 'x-filter|x-demo'   # a Wasm filter edits request and response
  curl -i http://127.0.0.1:8080/v1/echo/tenants/x              # Wasm tenant allow-list: 403 without a verified tenant
  curl -i -X POST http://127.0.0.1:8081/partner/v1/webhooks    # Wasm HMAC verifier: 401 unsigned
  curl -s -H 'x-api-key: k1' http://127.0.0.1:8080/v2/orders/1 | grep -A1 x-experiment   # Wasm A/B tagger
  curl -s http://127.0.0.1:9901/metrics | grep postern_filter_calls_total   # what each filter costs
  curl -s http://127.0.0.1:9901/metrics | head -20             # Prometheus metrics
  curl -s http://127.0.0.1:9901/snapshot                       # running snapshot version and hash

Edit demo-state/config, then `target/release/posternctl compile demo-state/config -o demo-state/snapshot.json`:
the node picks the new snapshot up within a second (or at once on SIGHUP). Ctrl-C stops everything.

TRY

"$bin/postern" --snapshot "$state/snapshot.json"
