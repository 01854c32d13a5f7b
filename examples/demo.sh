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

# Credentials for the demo: a signing key (a stand-in for the identity service's), and
# API keys made the way the key service makes them (the raw key is printed once; only
# its SHA-256 goes into platform/keys.jsonl). A second run keeps the first run's key.
if [ ! -s "$state/demo-signing-key.pem" ] || [ ! -s "$state/signing-key.yaml" ]; then
  rm -f "$state/demo-signing-key.pem"
  "$bin/posternctl" token keygen --kid demo-1 --issuer https://id.example.com \
    --private-out "$state/demo-signing-key.pem" > "$state/signing-key.yaml"
fi
python3 - "$state/config/platform/auth.yaml" "$state/signing-key.yaml" <<'PY'
import sys
auth, key = sys.argv[1], open(sys.argv[2]).read()
text = open(auth).read().replace("signing_keys: []\n", "signing_keys:\n" + key)
open(auth, "w").write(text)
PY
partner_key=$("$bin/posternctl" key new "$state/config" --id demo-partner --app demo-app --tenant acme \
  --plan partner --scope orders:read --scope orders:write --scope reports:read)
free_key=$("$bin/posternctl" key new "$state/config" --id demo-free --app free-app --tenant initech --plan free)
token=$("$bin/posternctl" token mint --key "$state/demo-signing-key.pem" --kid demo-1 \
  --issuer https://id.example.com --audience api.example.com --sub alice --client-id demo-app \
  --scope "orders:read profile" --ttl 60m)

"$bin/posternctl" compile "$state/config" -o "$state/snapshot.json"

cat <<TRY

Demo credentials, made just now (the config holds only their hashes and the public
key). Paste these into the other terminal:

  export PARTNER_KEY=$partner_key
  export FREE_KEY=$free_key
  export TOKEN=$token   # alice, app demo-app, scopes orders:read profile, 60 min
TRY
cat <<'TRY'

Postern demo is starting: public pool http://127.0.0.1:8080, partner pool
http://127.0.0.1:8081, admin http://127.0.0.1:9901. Try, in another terminal:

  curl -i http://127.0.0.1:8080/v1/echo/hello?x=1             # echo route, x-request-id on the answer
  curl -i http://127.0.0.1:8080/v2/echo/hello                  # rewritten to /echo/hello upstream
  curl -i http://127.0.0.1:8080/v1/orders/42                   # 401 invalid_credentials: this route needs a key or a token
  curl -i -H "x-api-key: $PARTNER_KEY" http://127.0.0.1:8080/v1/orders/42   # exact route with {id}; the backend sees x-auth-* identity, never the key
  curl -i -H "authorization: Bearer $TOKEN" http://127.0.0.1:8080/v1/orders/42   # the same with alice's JWT
  curl -i -H "x-api-key: $FREE_KEY" http://127.0.0.1:8080/v1/orders/42      # 403 product_not_in_plan
  curl -i -X POST -H "authorization: Bearer $TOKEN" http://127.0.0.1:8080/v1/orders   # 403 insufficient_scope (no orders:write)
  curl -i -H "x-api-key: $PARTNER_KEY" -H 'api-version: 2026-06-01' http://127.0.0.1:8080/v1/orders/42   # dated version -> orders-v2
  curl -s -H "x-api-key: $PARTNER_KEY" http://127.0.0.1:8080/v2/orders/1 | grep -E 'backend|x-experiment' -A1   # sticky 90/10 canary + Wasm A/B tagger
  curl -i -H "x-api-key: $FREE_KEY" http://127.0.0.1:8080/v1/echo/tenants/x  # Wasm tenant allow-list on the verified tenant: 403 for initech
  for i in 1 2 3 4 5 6 7; do curl -s -o /dev/null -w '%{http_code} ' -H "x-api-key: $FREE_KEY" http://127.0.0.1:8080/v1/echo/tenants/x; done; echo   # free plan: burst of 5, then 429 rate_limited
  curl -i http://127.0.0.1:8080/v1/products/1                  # Deprecation, Sunset and Link headers
  curl -i -H 'x-auth-subject: admin' http://127.0.0.1:8080/v1/echo/spoof   # identity headers never reach backends
  curl -i -X DELETE http://127.0.0.1:8080/v1/orders/42         # 405 problem+json with Allow
  curl -i http://127.0.0.1:8080/nope                           # 404 route_not_found
  head -c 200000 /dev/zero | curl -i --data-binary @- http://127.0.0.1:8080/v1/orders   # 413 payload_too_large
  curl -i -H "x-api-key: $PARTNER_KEY" http://127.0.0.1:8081/partner/v1/reports/daily   # partner pool only
  curl --http2-prior-knowledge -i http://127.0.0.1:8080/v1/echo/h2   # HTTP/2 (h2c)
  curl -si http://127.0.0.1:8080/v1/echo/wasm | grep -i -E 'x-filter|x-demo'   # a Wasm filter edits request and response
  curl -i -X POST http://127.0.0.1:8081/partner/v1/webhooks    # Wasm HMAC verifier: 401 unsigned
  curl -s http://127.0.0.1:9901/metrics | grep postern_filter_calls_total   # what each filter costs
  curl -s http://127.0.0.1:9901/metrics | head -20             # Prometheus metrics
  curl -s http://127.0.0.1:9901/snapshot                       # running snapshot version and hash

Revoke the partner key: `target/release/posternctl key revoke demo-state/config --id demo-partner`
then compile as below; the next request with it gets 401, on an open connection too.

Edit demo-state/config, then `target/release/posternctl compile demo-state/config -o demo-state/snapshot.json`:
the node picks the new snapshot up within a second (or at once on SIGHUP). Ctrl-C stops everything.

TRY

"$bin/postern" --snapshot "$state/snapshot.json"
