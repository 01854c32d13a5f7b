#!/usr/bin/env bash
# The demo: the whole product on one machine, embedded. Echo backends on
# 127.0.0.1:9001-9003 and the orders gRPC service on :9004; the example config (with the built filters approved) as the config
# repository; `posternctl serve` with its embedded store on 127.0.0.1:9400, signing every
# version; two nodes following it (node-a, the canary: public :8080, partner :8081, admin
# :9901; node-b: :8180, :8181, :9911); the key service. Ctrl-C stops everything.
# Usage: examples/demo.sh <dir with the binaries>   (make demo builds them)
# Env: DEMO_STATE (default demo-state), DEMO_DWELL (each rollout stage, default 10s),
# DEMO_DETACH=1 (start everything, print the tour and return, leaving it running; stop it
# with `kill $(cat demo-state/pids)`).
set -euo pipefail
bin=$(cd "${1:-target/demo}" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
state=${DEMO_STATE:-$here/../demo-state}
mkdir -p "$state"
state=$(cd "$state" && pwd)
dwell=${DEMO_DWELL:-10s}
control=http://127.0.0.1:9400
step() { printf '==> %s\n' "$*" >&2; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
if [ "${DEMO_DETACH:-}" != 1 ]; then trap cleanup EXIT INT TERM; fi
# What a previous detached run left running.
if [ -s "$state/pids" ]; then kill $(cat "$state/pids") 2>/dev/null || true; sleep 0.5; fi
: > "$state/pids"
started() { pids+=("$1"); echo "$1" >> "$state/pids"; }
# Waits until `curl $1` answers, or fails naming the log to read.
wait_up() {
  for _ in $(seq 1 200); do curl -s -o /dev/null "$1" && return 0; sleep 0.1; done
  echo "$2 did not start; see $3" >&2; tail -20 "$3" >&2; exit 1
}

step "echo backends on 127.0.0.1:9001-9003 (log: $state/echo.log)"
for spec in 9001=echo 9002=orders-v1 9003=orders-v2; do
  port=${spec%%=*}; name=${spec#*=}
  "$bin/postern-echo" --listen "127.0.0.1:$port" --name "$name" >>"$state/echo.log" 2>&1 &
  started $!
done
step "the orders gRPC service on 127.0.0.1:9004 (h2c; log: $state/grpc.log)"
"$bin/postern-grpc-echo" --listen 127.0.0.1:9004 >"$state/grpc.log" 2>&1 &
started $!

# The config repository as the platform would hold it: the example config plus the built
# filter modules beside their manifests, each approved in platform/filters.yaml.
step "config repository $state/config: examples/config with the built filters approved"
filters=${FILTERS_DIR:-$here/../target/filters/wasm32-wasip2/release}
rm -rf "$state/config" && cp -r "$here/config" "$state/config"
for manifest in "$state"/config/teams/*/filters/*.yaml; do
  name=$(basename "$manifest" .yaml)
  cp "$filters/${name//-/_}.wasm" "${manifest%.yaml}.wasm"
  # The platform's review: the module checked in the sandbox, its digest recorded for
  # the team whose folder it is in, in platform/filters.yaml.
  "$bin/posternctl" filter approve "$manifest" --reviewer demo > "$state/review-$name.txt"
done

# Credentials for the demo: a signing key (a stand-in for the identity service's), and
# API keys made the way the key service makes them (the raw key is printed once; only
# its SHA-256 goes into platform/keys.jsonl). A second run keeps the first run's key.
step "demo credentials: an identity-service signing key, two API keys, a JWT"
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
  --plan partner --scope orders:read --scope orders:write --scope reports:read 2>/dev/null)
free_key=$("$bin/posternctl" key new "$state/config" --id demo-free --app free-app --tenant initech --plan free 2>/dev/null)
token=$("$bin/posternctl" token mint --key "$state/demo-signing-key.pem" --kid demo-1 \
  --issuer https://id.example.com --audience api.example.com --sub alice --client-id demo-app \
  --scope "orders:read profile" --ttl 60m)
# The same repository compiled to a file: what a single node without a control plane runs
# (`postern --snapshot demo-state/snapshot.json`).
"$bin/posternctl" compile "$state/config" -o "$state/snapshot.json" >/dev/null

# Who may do what on the control plane: a platform token (publish, roll back, keys) and a
# node token, by their SHA-256. Made once; a second run keeps them.
if [ ! -s "$state/tokens.env" ]; then
  echo "PLATFORM_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')" > "$state/tokens.env"
  echo "NODE_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')" >> "$state/tokens.env"
fi
# shellcheck disable=SC1091
. "$state/tokens.env"
sha() { printf %s "$1" | sha256sum | cut -d' ' -f1; }
cat > "$state/tokens.json" <<J
[{"name": "demo", "role": "platform", "sha256": "$(sha "$PLATFORM_TOKEN")"},
 {"name": "nodes", "role": "node", "sha256": "$(sha "$NODE_TOKEN")"}]
J

step "control plane: posternctl serve on $control (store $state/store; log: $state/control.log)"
"$bin/posternctl" serve "$state/config" --store "$state/store" --tokens "$state/tokens.json" \
  --listen 127.0.0.1:9400 --dwell "$dwell" --publish-dir "$state/published" \
  > "$state/control.log" 2>&1 &
started $!
wait_up "$control/v1/status" "the control plane" "$state/control.log"
POSTERN_TOKEN=$PLATFORM_TOKEN "$bin/posternctl" publish --control "$control" >/dev/null

step "nodes following it: node-a (canary) on :8080/:8081/:9901, node-b on :8180/:8181/:9911 (logs: $state/node-*.log, access logs: $state/node-*/access.log)"
for spec in node-a=8080,8081,9901 node-b=8180,8181,9911; do
  name=${spec%%=*}; IFS=, read -r pub part adm <<<"${spec#*=}"
  mkdir -p "$state/$name"
  canary=(); [ "$name" = node-a ] && canary=(--control-canary)
  POSTERN_CONTROL_TOKEN=$NODE_TOKEN "$bin/postern" --snapshot "$state/$name/snapshot.json" \
    --public "127.0.0.1:$pub" --partner "127.0.0.1:$part" --admin "127.0.0.1:$adm" \
    --node-id "$name" "${canary[@]}" --control "$control" --control-key "$state/store/signing.pub" \
    --credentials-dir "$state/published" --access-log "$state/$name/access.log" > "$state/$name.log" 2>&1 &
  started $!
  wait_up "http://127.0.0.1:$adm/readyz" "$name" "$state/$name.log"
done

cat <<TRY

Postern demo is running: the control plane on $control, node-a (canary) on
http://127.0.0.1:8080 (partner pool :8081, admin :9901), node-b on :8180 (:8181, :9911).
In another terminal, from this directory:

  export PATH=\$PWD/$(realpath --relative-to="$PWD" "$bin" 2>/dev/null || echo "$bin"):\$PATH
  export POSTERN_TOKEN=$PLATFORM_TOKEN   # the demo's platform token (publish, rollback, keys)
  export PARTNER_KEY=$partner_key
  export FREE_KEY=$free_key
  export TOKEN=$token   # alice, app demo-app, scopes orders:read profile, 60 min
TRY
# The tour is README.md's, so the two cannot drift (tests/tests/readme.rs runs it).
echo
awk '/<!-- tour:start -->/{on=1; next} /<!-- tour:end -->/{on=0} on && !/^```/' "$here/../README.md" | sed 's/^./  &/'
echo
if [ "${DEMO_DETACH:-}" = 1 ]; then exit 0; fi
echo "Ctrl-C stops everything."
wait
